//! `flashgrpo gradcheck`: the original system's gradcheck. Seeded inputs (or logits from a
//! file), the f64 reference against the streaming kernels, metrics printed by name, and
//! tolerance gates: any breach or non-finite value is a non-zero exit with the reason.

use std::time::Instant;

use anyhow::{bail, Result};
use flashgrpo_kernels::{ChunkBudget, LossOptions};
use serde::{Deserialize, Serialize};

use crate::batch::{Batch, Scores};
use crate::config::{self, ConfigArgs};
use crate::device::Device;
use crate::input_spec::InputSpec;
use crate::run::{reference_results, run_on, Impl, Results};

/// Gates; unset ones take LOSSES.md's tolerance for the dtype.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Tolerances {
    /// `|loss - loss_ref| / |loss_ref|` (default 1e-5).
    pub loss_rel: Option<f64>,
    /// Per-token outputs: `|x - x_ref| <= per_token_abs * max(1, |x_ref|)` (default 1e-5).
    pub per_token_abs: Option<f64>,
    /// `||g - g_ref|| / ||g_ref||` (default 1e-5 for f32, 1e-2 for bf16 / f16).
    pub dlogits_rel_norm: Option<f64>,
    /// `max |g - g_ref|` (no gate by default).
    pub dlogits_max_abs: Option<f64>,
    /// Fused-linear: `||g - g_ref|| / ||g_ref||` of `grad_hidden`, `grad_weight`, `grad_bias`
    /// (default 1e-4 for f32, 1e-2 for bf16 / f16 (the gradients are rounded to them)).
    pub dlinear_rel_norm: Option<f64>,
}

/// The gradcheck's own keys (the inputs are described by [`InputSpec`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GradcheckConfig {
    /// The kernel variant to check.
    #[serde(rename = "impl")]
    pub implementation: Impl,
    /// Kernel runs to time (the median is reported).
    pub repeats: usize,
    pub tolerances: Tolerances,
}

impl Default for GradcheckConfig {
    fn default() -> Self {
        Self { implementation: Impl::Fused, repeats: 3, tolerances: Tolerances::default() }
    }
}

/// The built-in default: GRPO at the original shape, as shipped in configs/.
const DEFAULT_CONFIG: &str = include_str!("../../../configs/gradcheck-grpo-original.yaml");

/// `flashgrpo gradcheck`; without `--config`, the original GRPO shape B=1, T=129, V=151936, f32.
pub fn main(args: ConfigArgs) -> Result<()> {
    let source = args.source("configs/gradcheck-grpo-original.yaml (built in)", DEFAULT_CONFIG);
    let loaded = config::load::<GradcheckConfig, InputSpec>(source, &args.sets)?;
    let batch = loaded.inputs.build(&loaded.options)?;
    let metrics = check(&loaded.command, &batch, &loaded.options, loaded.inputs.budget(), args.device)?;
    if args.json {
        println!("{}", serde_json::to_string(&metrics.as_json())?);
    } else {
        metrics.print();
    }
    let breaches = metrics.breaches(&loaded.command);
    if !breaches.is_empty() {
        bail!("gradcheck failed:\n  {}", breaches.join("\n  "));
    }
    if !args.json {
        println!("gradcheck passed");
    }
    Ok(())
}

/// The metrics of one gradcheck, by their printed names.
#[derive(Debug, Clone)]
pub struct Metrics {
    /// Where the kernels ran ([`Device::describe`]).
    device: String,
    rows: Vec<(&'static str, Value)>,
    low_precision: bool,
    /// Fused-linear: LOSSES.md's fused-linear tolerances apply.
    linear: bool,
}

#[derive(Debug, Clone, Copy)]
enum Value {
    Float(f64),
    Int(usize),
}

impl Metrics {
    fn get(&self, name: &str) -> f64 {
        self.rows.iter().find(|(n, _)| *n == name).map_or(f64::NAN, |(_, v)| match v {
            Value::Float(f) => *f,
            Value::Int(i) => *i as f64,
        })
    }

    fn print(&self) {
        println!("{:<26} {}", "device", self.device);
        for (name, value) in &self.rows {
            match value {
                Value::Float(f) => println!("{name:<26} {f:.6e}"),
                Value::Int(i) => println!("{name:<26} {i}"),
            }
        }
    }

    fn as_json(&self) -> serde_json::Value {
        let mut map = serde_json::Map::new();
        map.insert("device".into(), serde_json::json!(self.device));
        for (name, value) in &self.rows {
            let v = match value {
                Value::Float(f) => serde_json::json!(f),
                Value::Int(i) => serde_json::json!(i),
            };
            map.insert((*name).to_string(), v);
        }
        serde_json::Value::Object(map)
    }

    /// Every gate that fails, and every metric that is not finite.
    fn breaches(&self, cfg: &GradcheckConfig) -> Vec<String> {
        let t = &cfg.tolerances;
        let low_precision = self.low_precision;
        let grad_default = match (low_precision, self.linear) {
            (true, _) => 1e-2,
            (false, true) => 1e-4,
            (false, false) => 1e-5,
        };
        // (metric, configured limit, LOSSES.md's, the config key)
        let mut gates = vec![
            ("loss_rel_err", t.loss_rel, if self.linear { 1e-4 } else { 1e-5 }, "loss_rel"),
            ("fwd/per_token_worst", t.per_token_abs, if self.linear { 2e-5 } else { 1e-5 }, "per_token_abs"),
            ("dlogits_rel_norm", t.dlogits_rel_norm, grad_default, "dlogits_rel_norm"),
        ];
        for name in ["dhidden_rel_norm", "dweight_rel_norm", "dbias_rel_norm"] {
            gates.push((name, t.dlinear_rel_norm, grad_default, "dlinear_rel_norm"));
        }
        if let Some(m) = t.dlogits_max_abs {
            gates.push(("dlogits_max_abs", Some(m), m, "dlogits_max_abs"));
        }
        let mut out: Vec<String> = self
            .rows
            .iter()
            .filter_map(|(name, v)| match v {
                Value::Float(f) if !f.is_finite() => Some(format!("{name} is not finite ({f})")),
                _ => None,
            })
            .collect();
        for (name, configured, default, key) in gates {
            let (v, limit) = (self.get(name), configured.unwrap_or(default));
            if v.is_finite() && v > limit {
                let mut reason = format!("{name} = {v:.3e} exceeds the tolerance {limit:.1e}");
                if configured.is_some() && limit < default {
                    // A config written for f32 run with `--set dtype=bf16`, say.
                    reason +=
                        &format!(" (`tolerances.{key}` in the config; LOSSES.md's for these inputs is {default:.0e})");
                }
                out.push(reason);
            }
        }
        out
    }
}

fn max_abs_diff(got: &[f32], want: &[f64]) -> f64 {
    got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max)
}

/// `max_i |x_i - ref_i| / max(1, |ref_i|)`, the per-token gate's quantity.
fn worst_scaled(got: &[f32], want: &[f64]) -> f64 {
    got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).abs() / w.abs().max(1.0)).fold(0.0, f64::max)
}

fn check(
    cfg: &GradcheckConfig,
    batch: &Batch,
    options: &LossOptions,
    budget: ChunkBudget,
    device: Device,
) -> Result<Metrics> {
    if cfg.implementation == Impl::Reference {
        bail!("`impl` must be a kernel variant (fused or fused-inplace): the reference is what it is checked against");
    }
    let described = device.describe()?;
    let start = Instant::now();
    let (_, reference) = reference_results(batch, options)?;
    let ref_s = start.elapsed().as_secs_f64();
    let want = &reference.output;

    let mut times = Vec::new();
    let mut result = None;
    for _ in 0..cfg.repeats.max(1) {
        let start = Instant::now();
        let r = run_on(device, batch, options, cfg.implementation, budget)?;
        times.push(start.elapsed().as_secs_f64());
        result = Some(r);
    }
    times.sort_by(f64::total_cmp);
    let Results { output: got, grads } = result.expect("at least one run");

    let abs_diff_loss = (got.loss - want.loss).abs();
    let mut rows = vec![
        ("loss_ref", Value::Float(want.loss)),
        ("loss_kernel", Value::Float(got.loss)),
        ("abs_diff_loss", Value::Float(abs_diff_loss)),
        ("loss_rel_err", Value::Float(abs_diff_loss / want.loss.abs().max(f64::MIN_POSITIVE))),
    ];
    let logp = match (&got.logp, &want.logp) {
        (Some(g), Some(w)) => max_abs_diff(g, w),
        _ => 0.0,
    };
    rows.push(("fwd/logp_max_abs", Value::Float(logp)));
    rows.push(("fwd/per_loss_max_abs", Value::Float(max_abs_diff(&got.per_token_loss, &want.per_token_loss))));
    rows.push(("fwd/entropy_max_abs", Value::Float(max_abs_diff(&got.entropy, &want.entropy))));
    let mut worst =
        worst_scaled(&got.per_token_loss, &want.per_token_loss).max(worst_scaled(&got.entropy, &want.entropy));
    if let (Some(g), Some(w)) = (&got.logp, &want.logp) {
        worst = worst.max(worst_scaled(g, w));
    }
    if let (Some(g), Some(w)) = (&got.kl, &want.kl) {
        rows.push(("fwd/kl_max_abs", Value::Float(max_abs_diff(g, w))));
        worst = worst.max(worst_scaled(g, w));
    }
    if let (Some(g), Some(w)) = (&got.is_clipped, &want.is_clipped) {
        rows.push(("fwd/is_clipped_mismatches", Value::Int(g.iter().zip(w).filter(|(&a, &b)| a as f64 != b).count())));
    }
    rows.push(("fwd/per_token_worst", Value::Float(worst)));

    for (name, w) in &reference.grads {
        let Some(g) = grads.iter().find(|g| g.name == *name) else {
            bail!("the kernels returned no `{name}`");
        };
        let g = g.data.to_f64();
        let (mut max_abs, mut sum_abs, mut diff2, mut norm2, mut ref_max) = (0.0f64, 0.0, 0.0, 0.0, 0.0f64);
        for (&a, &b) in g.iter().zip(w) {
            let d = (a - b).abs();
            max_abs = max_abs.max(d);
            sum_abs += d;
            diff2 += d * d;
            norm2 += b * b;
            ref_max = ref_max.max(b.abs());
        }
        let [max_abs_name, max_rel_name, mean_abs_name, rel_norm_name] = metric_names(name);
        rows.push((max_abs_name, Value::Float(max_abs)));
        rows.push((max_rel_name, Value::Float(if ref_max > 0.0 { max_abs / ref_max } else { max_abs })));
        rows.push((mean_abs_name, Value::Float(sum_abs / g.len().max(1) as f64)));
        rows.push((rel_norm_name, Value::Float(if norm2 > 0.0 { (diff2 / norm2).sqrt() } else { diff2.sqrt() })));
    }
    rows.extend([
        ("shape/batch", Value::Int(batch.batch)),
        ("shape/seq_len", Value::Int(batch.seq_len)),
        ("shape/vocab", Value::Int(batch.vocab)),
        ("time/ref_grad_s", Value::Float(ref_s)),
        ("time/kernel_grad_s", Value::Float(times[times.len() / 2])),
    ]);
    let low_precision = batch.scores.dtype() != safetensors::Dtype::F32;
    let linear = matches!(batch.scores, Scores::Linear(_));
    Ok(Metrics { device: described, rows, low_precision, linear })
}

/// The metric names of a gradient's comparison: `dlogits_*` (the original's names), `dhidden_*`...
fn metric_names(grad: &str) -> [&'static str; 4] {
    match grad {
        "grad_logits" => ["dlogits_max_abs", "dlogits_max_rel", "dlogits_mean_abs", "dlogits_rel_norm"],
        "grad_hidden" => ["dhidden_max_abs", "dhidden_max_rel", "dhidden_mean_abs", "dhidden_rel_norm"],
        "grad_weight" => ["dweight_max_abs", "dweight_max_rel", "dweight_mean_abs", "dweight_rel_norm"],
        _ => ["dbias_max_abs", "dbias_max_rel", "dbias_mean_abs", "dbias_rel_norm"],
    }
}

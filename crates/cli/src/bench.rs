//! `flashgrpo bench`: the original microbenchmark. Forward + backward (the loss and its gradient,
//! as the original timed `value_and_grad`), step time statistics, peak heap bytes from the
//! counting allocator, peak RSS, and the memory floor from a copy bandwidth measured in the
//! same run.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use flashgrpo_kernels::linear::{matmul_bf16_gflops, matmul_gflops};
use flashgrpo_kernels::{
    forward, forward_backward, forward_backward_in_place, linear_forward, linear_forward_backward, ChunkBudget, DType,
    LinearGradients, LinearInputs, LossOptions, LossSpec, Op,
};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::baseline;
use crate::batch::{Batch, LinearData, Scores};
use crate::config::{self, ConfigArgs};
use crate::input_spec::InputSpec;
use crate::memory;
use crate::run::Device;
use crate::tensor_io::{FloatData, FloatElement, FloatVisitor, FloatVisitorMut};

/// What is timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum BenchImpl {
    /// The same loss written with candle tensor ops and candle autograd.
    Baseline,
    /// The streaming kernels, gradient into a separate buffer (allocated once, reused by every step).
    Fused,
    /// The streaming kernels, gradient written over the logits.
    #[default]
    FusedInplace,
    /// Fused-linear (with `hidden_size`): the loss from hidden states and the lm_head, gradients
    /// into buffers allocated once.
    FusedLinear,
}

impl BenchImpl {
    pub(crate) fn name(self) -> &'static str {
        match self {
            BenchImpl::Baseline => "baseline",
            BenchImpl::Fused => "fused",
            BenchImpl::FusedInplace => "fused-inplace",
            BenchImpl::FusedLinear => "fused-linear",
        }
    }
}

/// The bench's own keys (the inputs are described by [`InputSpec`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BenchConfig {
    #[serde(rename = "impl")]
    pub implementation: BenchImpl,
    pub warmup: usize,
    pub steps: usize,
    /// Worker threads (default: one per core).
    pub threads: Option<usize>,
    /// fused-inplace: restore the logits before each step (untimed) from a pristine copy. Off, the
    /// steps run on the previous step's gradient (same work, no second logits-sized buffer: for
    /// shapes that would not fit twice); the reported loss is then the first step's.
    pub restore: bool,
}

impl Default for BenchConfig {
    fn default() -> Self {
        Self { implementation: BenchImpl::FusedInplace, warmup: 2, steps: 10, threads: None, restore: true }
    }
}

const DEFAULT_CONFIG: &str = include_str!("../../../configs/bench-grpo-n1024-f32.yaml");

/// `flashgrpo bench`; without `--config`, `configs/bench-grpo-n1024-f32.yaml`: GRPO (dapo,
/// beta = 0.04) at N = 1024, V = 151936, f32, fused-inplace.
pub fn main(args: ConfigArgs) -> Result<()> {
    let source = args.source("configs/bench-grpo-n1024-f32.yaml (built in)", DEFAULT_CONFIG);
    let loaded = config::load::<BenchConfig, InputSpec>(source, &args.sets)?;
    if loaded.inputs.dtype == DType::F16 && loaded.command.implementation == BenchImpl::Baseline {
        bail!("the candle baseline is benchmarked in f32 and bf16 only");
    }
    let run = || -> Result<Report> {
        match args.device {
            Device::Cpu => run(&loaded.command, &loaded.inputs, &loaded.options),
            Device::Cuda => on_gpu(&loaded.command, &loaded.inputs, &loaded.options),
        }
    };
    let report = match loaded.command.threads {
        Some(n) => rayon::ThreadPoolBuilder::new().num_threads(n).build()?.install(run)?,
        None => run()?,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report.json())?);
    } else {
        report.print();
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn on_gpu(cfg: &BenchConfig, inputs: &InputSpec, options: &LossOptions) -> Result<Report> {
    crate::cuda_bench::run(cfg, inputs, options)
}

#[cfg(not(feature = "cuda"))]
fn on_gpu(_: &BenchConfig, _: &InputSpec, _: &LossOptions) -> Result<Report> {
    bail!("this flashgrpo was built without the `cuda` feature")
}

/// Bytes per second of a parallel copy (read + written) of a 512 MiB buffer (no cache holds it,
/// and every dtype and shape is measured against the same copy), best of six: the hardware's
/// streaming rate.
fn copy_bandwidth() -> f64 {
    let n = (512 << 20) / 4;
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let chunk = n.div_ceil(rayon::current_num_threads()).max(1);
    let mut best = f64::INFINITY;
    for _ in 0..6 {
        let start = Instant::now();
        dst.par_chunks_mut(chunk).zip(src.par_chunks(chunk)).for_each(|(d, s)| d.copy_from_slice(s));
        best = best.min(start.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    2.0 * (n * 4) as f64 / best
}

impl Measured {
    fn p50(&self) -> f64 {
        median(&self.times)
    }
}

/// Step times and memory of one run.
struct Measured {
    times: Vec<f64>,
    loss: f64,
    /// Resident set size just before the first step, and its peak during the steps.
    rss_before_steps: u64,
    peak_rss: u64,
    /// Peak heap bytes during a step above those live when it started, plus buffers the impl
    /// keeps between steps (the `fused` gradient buffer).
    peak_bytes: usize,
}

struct Timer<'a> {
    spec: LossSpec<'a>,
    cfg: &'a BenchConfig,
}

impl Timer<'_> {
    /// Runs `warmup + steps` steps of `step`, preceded each time by the untimed `prepare`.
    fn time<S>(
        &self,
        mut state: S,
        prepare: impl Fn(&mut S),
        step: impl Fn(&mut S) -> Result<f64>,
        kept: usize,
    ) -> Result<Measured> {
        let mut times = Vec::new();
        let mut loss = None;
        let mut peak = 0;
        memory::reset_peak_rss();
        let rss_before_steps = memory::rss_bytes();
        for i in 0..self.cfg.warmup + self.cfg.steps.max(1) {
            prepare(&mut state);
            let live = memory::live_bytes();
            memory::reset_peak();
            let start = Instant::now();
            let step_loss = step(&mut state)?;
            let elapsed = start.elapsed().as_secs_f64();
            peak = peak.max(memory::peak_bytes().saturating_sub(live));
            if i >= self.cfg.warmup {
                times.push(elapsed);
            }
            if loss.is_none() || self.cfg.restore {
                loss = Some(step_loss);
            }
        }
        let peak_rss = memory::peak_rss_bytes();
        Ok(Measured { times, loss: loss.unwrap_or(f64::NAN), rss_before_steps, peak_rss, peak_bytes: peak + kept })
    }
}

impl FloatVisitorMut for Timer<'_> {
    type Out = Result<Measured>;

    fn visit<T: FloatElement>(self, logits_mut: &mut [T]) -> Result<Measured> {
        let spec = self.spec;
        if self.cfg.implementation == BenchImpl::FusedInplace && !self.cfg.restore && spec.loss.has_gradient() {
            return self.time(logits_mut, |_| {}, |work| Ok(forward_backward_in_place(spec, work)?.loss), 0);
        }
        let logits: &[T] = logits_mut;
        if !spec.loss.has_gradient() {
            return self.time((), |_| {}, |_| Ok(forward(spec, logits)?.loss), 0);
        }
        match self.cfg.implementation {
            BenchImpl::Fused => {
                // Filled once so the timed steps do not pay for the first touch of its pages.
                let grad = vec![T::from_f32(1.0); logits.len()];
                let bytes = std::mem::size_of_val(grad.as_slice());
                self.time(grad, |_| {}, |g| Ok(forward_backward(spec, logits, g)?.loss), bytes)
            }
            BenchImpl::FusedInplace => self.time(
                logits.to_vec(),
                |work| work.copy_from_slice(logits),
                |work| Ok(forward_backward_in_place(spec, work)?.loss),
                0,
            ),
            BenchImpl::Baseline => {
                let inputs = baseline::Inputs::new(spec, baseline::Source::logits(logits)?)?;
                self.time((), |_| {}, |_| Ok(inputs.value_and_grad()?.0), 0)
            }
            BenchImpl::FusedLinear => bail!("`impl: fused-linear` needs `hidden_size` (hidden states and an lm_head)"),
        }
    }
}

/// The timer of fused-linear mode, on hidden states of any dtype.
struct LinearTimer<'a> {
    timer: Timer<'a>,
    linear: &'a LinearData,
    budget: ChunkBudget,
    vocab: usize,
}

impl FloatVisitor for LinearTimer<'_> {
    type Out = Result<Measured>;

    fn visit<T: FloatElement>(self, hidden: &[T]) -> Result<Measured> {
        let (spec, lin, budget) = (self.timer.spec, self.linear, self.budget);
        let typed =
            |d: &'_ FloatData| -> Result<Vec<T>> { Ok(T::slice_of(d).context("one dtype for all inputs")?.to_vec()) };
        let weight = typed(&lin.weight)?;
        let bias = lin.bias.as_ref().map(typed).transpose()?;
        let inputs = LinearInputs { hidden, weight: &weight, bias: bias.as_deref(), hidden_size: lin.hidden_size };
        if !spec.loss.has_gradient() {
            return self.timer.time((), |_| {}, |_| Ok(linear_forward(spec, inputs, budget)?.loss), 0);
        }
        match self.timer.cfg.implementation {
            BenchImpl::FusedLinear => {
                // Allocated (and touched) once: the gradients are outputs a training loop keeps.
                let (h, v) = (lin.hidden_size, self.vocab);
                let grads =
                    (vec![1.0f32; hidden.len()], vec![1.0f32; v * h], vec![1.0f32; if bias.is_some() { v } else { 0 }]);
                let bytes = 4 * (grads.0.len() + grads.1.len() + grads.2.len());
                let step = |g: &mut (Vec<f32>, Vec<f32>, Vec<f32>)| {
                    let has_bias = !g.2.is_empty();
                    let grads = LinearGradients {
                        hidden: &mut g.0,
                        weight: Some(&mut g.1),
                        bias: has_bias.then_some(&mut g.2[..]),
                        accumulate: false,
                    };
                    Ok(linear_forward_backward(spec, inputs, grads, budget)?.loss)
                };
                self.timer.time(grads, |_| {}, step, bytes)
            }
            BenchImpl::Baseline => {
                let source = baseline::Source::linear(hidden, &weight, bias.as_deref(), lin.hidden_size)?;
                let inputs = baseline::Inputs::new(spec, source)?;
                self.timer.time((), |_| {}, |_| Ok(inputs.value_and_grad()?.0), 0)
            }
            other => bail!("`impl: {}` works on logits; with `hidden_size` use fused-linear or baseline", other.name()),
        }
    }
}

fn run(cfg: &BenchConfig, inputs: &InputSpec, options: &LossOptions) -> Result<Report> {
    let mut batch = inputs.build(options)?;
    let input_bytes = batch.scores.size_in_bytes();
    // The scores are taken out of the batch so that the in-place steps may write the logits while
    // the spec borrows the rest.
    let mut scores = std::mem::replace(&mut batch.scores, Scores::Logits(FloatData::F32(Vec::new())));
    let timer = Timer { spec: batch.spec(options), cfg };
    let (measured, extra) = match &mut scores {
        Scores::Logits(logits) => {
            let measured = logits.visit_mut(timer)?;
            // Measured after the steps, so that its buffers do not count in the steps' peak RSS.
            let copy_bps = copy_bandwidth();
            // The floor: the logits read once and the gradient written once, at the copy bandwidth.
            let floor_s = 2.0 * input_bytes as f64 / copy_bps;
            let p50 = measured.p50();
            let extra = vec![
                ("bench/copy_gbps", json!(copy_bps / 1e9)),
                ("bench/floor_s", json!(floor_s)),
                ("bench/p50_over_floor", json!(p50 / floor_s)),
                ("mem/logits_bytes", json!(input_bytes)),
            ];
            (measured, extra)
        }
        Scores::Linear(linear) => {
            let (n, h, v) = (batch.batch * batch.seq_len, linear.hidden_size, batch.vocab);
            let lt = LinearTimer { timer, linear, budget: inputs.budget(), vocab: v };
            let measured = linear.hidden.visit(lt)?;
            let grad_bytes = 4 * (n * h + v * h + if linear.bias.is_some() { v } else { 0 });
            let products = if batch.op == Op::Entropy { 1.0 } else { 3.0 };
            let flops = products * 2.0 * (n * h * v) as f64;
            let matmul = matmul_gflops(n.min(256), h, v);
            // bf16 on AMX: the rate to compare with is that of the bf16 products.
            let bf16 = linear.hidden.dtype() == safetensors::Dtype::BF16;
            let matmul_bf16 = bf16.then(|| matmul_bf16_gflops(n.min(256), h, v)).flatten();
            let gflops = flops / measured.p50() / 1e9;
            let mut extra = vec![
                ("shape/hidden", json!(h)),
                ("bench/gflops", json!(gflops)),
                ("bench/matmul_gflops", json!(matmul)),
                ("bench/gflops_over_matmul", json!(gflops / matmul_bf16.unwrap_or(matmul))),
                ("mem/inputs_bytes", json!(input_bytes)),
                ("mem/grads_bytes", json!(grad_bytes)),
                ("mem/peak_above_grads_bytes", json!(measured.peak_bytes.saturating_sub(grad_bytes))),
            ];
            if let Some(rate) = matmul_bf16 {
                extra.push(("bench/matmul_bf16_gflops", json!(rate)));
            }
            (measured, extra)
        }
    };
    batch.scores = scores;
    Ok(Report::new(cfg, &batch, measured, extra))
}

/// The printed metrics.
pub(crate) struct Report {
    rows: Vec<(&'static str, serde_json::Value)>,
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// The median of step times.
pub(crate) fn median(times: &[f64]) -> f64 {
    let mut sorted = times.to_vec();
    sorted.sort_by(f64::total_cmp);
    percentile(&sorted, 0.5)
}

/// The rows every report starts with, on any device: what ran, the shape, the step-time
/// statistics and the loss.
pub(crate) fn step_rows(
    cfg: &BenchConfig,
    batch: &Batch,
    times: &[f64],
    loss: f64,
) -> Vec<(&'static str, serde_json::Value)> {
    let mut sorted = times.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mean = sorted.iter().sum::<f64>() / sorted.len() as f64;
    vec![
        ("bench/op", json!(format!("{:?}", batch.op).to_lowercase())),
        ("bench/impl", json!(cfg.implementation.name())),
        ("shape/batch", json!(batch.batch)),
        ("shape/seq_len", json!(batch.seq_len)),
        ("shape/vocab", json!(batch.vocab)),
        ("shape/dtype", json!(format!("{:?}", batch.scores.dtype()).to_lowercase())),
        ("bench/steps", json!(sorted.len())),
        ("bench/step_s_mean", json!(mean)),
        ("bench/step_s_p50", json!(percentile(&sorted, 0.5))),
        ("bench/step_s_p90", json!(percentile(&sorted, 0.9))),
        ("bench/step_s_min", json!(sorted[0])),
        ("bench/loss", json!(loss)),
    ]
}

impl Report {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn from_rows(rows: Vec<(&'static str, serde_json::Value)>) -> Self {
        Self { rows }
    }

    fn new(cfg: &BenchConfig, batch: &Batch, m: Measured, extra: Vec<(&'static str, serde_json::Value)>) -> Self {
        let mut rows = step_rows(cfg, batch, &m.times, m.loss);
        rows.extend([
            ("bench/threads", json!(rayon::current_num_threads())),
            ("mem/peak_bytes", json!(m.peak_bytes)),
            ("mem/peak_rss_bytes", json!(m.peak_rss)),
            ("mem/rss_before_steps_bytes", json!(m.rss_before_steps)),
        ]);
        rows.extend(extra);
        Self { rows }
    }

    fn print(&self) {
        for (name, value) in &self.rows {
            match value {
                serde_json::Value::Number(n) if n.is_f64() => {
                    println!("{name:<22} {:.6}", n.as_f64().unwrap_or(f64::NAN))
                }
                serde_json::Value::String(s) => println!("{name:<22} {s}"),
                other => println!("{name:<22} {other}"),
            }
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::Value::Object(self.rows.iter().map(|(k, v)| ((*k).to_string(), v.clone())).collect())
    }
}

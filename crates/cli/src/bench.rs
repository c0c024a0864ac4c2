//! `flashgrpo bench`: the original microbenchmark. Forward + backward (the loss and its gradient,
//! as the original timed `value_and_grad`), step time statistics, peak memory, and the floor
//! from a copy bandwidth (fused-linear: the product rate) measured in the same run, on the CPU or
//! a GPU: one bench over [`Runner`], which says how each device times a step and counts its
//! memory.

use anyhow::{bail, Context, Result};
use flashgrpo_kernels::{
    ChunkBudget, DType, ImportanceSamplingLevel, LinearGradientBuffers, LossOptions, LossSpec, Op,
};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::baseline;
use crate::batch::{Batch, LinearData, Scores};
use crate::config::{self, ConfigArgs};
use crate::device::Device;
use crate::device::{DeviceVisitor, Rows, Runner, StepMemory};
use crate::input_spec::InputSpec;
use crate::run::LinearOnBackend;
use crate::tensor_io::{FloatData, FloatElement, FloatVisitor, FloatVisitorOwned};

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
    /// fused: a new gradient buffer every step, allocated in the timed step and freed after it, as
    /// a framework that allocates its results does (XLA): the step then pays for the buffer's
    /// first touch. Off: one buffer, allocated and touched once, reused.
    pub fresh_gradient: bool,
}

impl Default for BenchConfig {
    fn default() -> Self {
        Self {
            implementation: BenchImpl::FusedInplace,
            warmup: 2,
            steps: 10,
            threads: None,
            restore: true,
            fresh_gradient: false,
        }
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
    let (cfg, inputs, options) = (&loaded.command, &loaded.inputs, &loaded.options);
    if args.device != Device::Cpu && cfg.implementation == BenchImpl::Baseline {
        bail!("the candle baseline runs on the CPU (`--device cpu`)");
    }
    // Checked before anything is generated or a device opened (a forward-only op would otherwise
    // time the logits under the wrong name).
    let linear = inputs.hidden_size.is_some();
    match cfg.implementation {
        BenchImpl::FusedLinear if !linear => {
            bail!("`impl: fused-linear` needs `hidden_size` (hidden states and an lm_head)")
        }
        BenchImpl::Fused | BenchImpl::FusedInplace if linear => bail!(
            "`impl: {}` works on logits; with `hidden_size` use fused-linear or baseline",
            cfg.implementation.name()
        ),
        _ => {}
    }
    if args.device == Device::Cuda {
        // Not on the CPU: the CPU bench's figures include the peak resident set.
        crate::memory::keep_freed_memory();
    }
    // The chosen bf16 way as the thread's too, for the product rate the bench holds a step against.
    let run = || inputs.bf16_products.run(|| args.device.run(Bench { cfg, inputs, options }));
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

/// Step times and memory of one run.
struct Measured {
    times: Vec<f64>,
    loss: f64,
    memory: StepMemory,
    /// Bytes of the buffers the timed implementation keeps between steps (gradient buffers).
    kept: u64,
    /// The best time of a pass with the step's memory traffic over its buffers, where measured.
    pass_floor_s: Option<f64>,
}

impl Measured {
    fn p50(&self) -> f64 {
        median(&self.times)
    }

    fn with_pass_floor(self, pass_floor_s: Option<f64>) -> Self {
        Self { pass_floor_s, ..self }
    }
}

/// One bench run on a device.
struct Bench<'a> {
    cfg: &'a BenchConfig,
    inputs: &'a InputSpec,
    options: &'a LossOptions,
}

impl DeviceVisitor for Bench<'_> {
    type Out = Report;

    fn visit<R: Runner>(self, runner: &R) -> Result<Report> {
        let (cfg, options) = (self.cfg, self.options);
        let mut run = runner.begin_run()?;
        let mut batch = self.inputs.build(options)?;
        let input_bytes = batch.scores.size_in_bytes();
        // The scores are taken out of the batch so that the spec may borrow the rest while the
        // steps own the scores' buffers: from here on `batch.scores` is an empty placeholder.
        let scores = std::mem::replace(&mut batch.scores, Scores::Logits(FloatData::F32(Vec::new())));
        let dtype = scores.element_dtype();
        let spec = batch.spec(options);
        let timer = Timer { runner, spec, cfg, run: &mut run };
        let (measured, linear) = match scores {
            Scores::Logits(logits) => (logits.visit_owned(LogitsSteps { timer })?, None),
            Scores::Linear(linear) => {
                let budget = self.inputs.budget();
                let steps = LinearSteps { timer, linear: &linear, budget, vocab: batch.vocab };
                (linear.hidden.visit(steps)?, Some(linear))
            }
        };
        let mut rows = step_rows(cfg, &batch, dtype, &measured.times, measured.loss);
        // Read before the rates below are measured, so that their buffers do not count.
        rows.extend(runner.memory_rows(run, measured.memory, measured.kept, input_bytes as u64)?);
        rows.extend(match linear {
            None => {
                let copy_bps = runner.copy_bandwidth()?;
                let mut extra = logits_rows(copy_bps, input_bytes, measured.p50());
                extra.extend(runner.traffic_rows(input_bytes as u64, measured.p50(), copy_bps));
                extra.extend(pass_floor_rows(&measured));
                extra
            }
            Some(linear) => linear_rows(runner, &batch, (&linear, dtype), options, input_bytes, &measured)?,
        });
        Ok(Report { rows })
    }
}

/// The floor of a logits-level loss: the logits read once and the gradient written once, at the
/// copy rate. The kernels read the logits twice at most (statistics, gradient) and write once.
fn logits_rows(copy_bps: f64, input_bytes: usize, p50: f64) -> Rows {
    let floor_s = 2.0 * input_bytes as f64 / copy_bps;
    vec![
        ("bench/copy_gbps", json!(copy_bps / 1e9)),
        ("bench/floor_s", json!(floor_s)),
        ("bench/p50_over_floor", json!(p50 / floor_s)),
        ("mem/logits_bytes", json!(input_bytes)),
    ]
}

/// A fused step against a pass with its own memory traffic over its own buffers
/// ([`Runner::pass_floor`]), where one was measured.
fn pass_floor_rows(measured: &Measured) -> Rows {
    measured.pass_floor_s.map_or_else(Vec::new, |floor| {
        vec![("bench/pass_floor_s", json!(floor)), ("bench/p50_over_pass_floor", json!(measured.p50() / floor))]
    })
}

/// A fused-linear loss against the device's product rate: the flops of its products (entropy
/// without its gradient: one; sequence-level importance sampling recomputes the logits in a
/// second pass: four; otherwise three) over the step time.
fn linear_rows<R: Runner>(
    runner: &R,
    batch: &Batch,
    (linear, dtype): (&LinearData, DType),
    options: &LossOptions,
    input_bytes: usize,
    measured: &Measured,
) -> Result<Rows> {
    let (n, h, v) = (batch.batch * batch.seq_len, linear.hidden_size, batch.vocab);
    let grad_bytes = 4 * (n * h + v * h + if linear.bias.is_some() { v } else { 0 });
    let products = if batch.op == Op::Entropy && !options.entropy_gradient {
        1.0
    } else if options.importance_sampling_level == ImportanceSamplingLevel::Sequence {
        4.0
    } else {
        3.0
    };
    let gflops = products * 2.0 * (n * h * v) as f64 / measured.p50() / 1e9;
    let (rate, mut rows) = runner.product_rates(dtype, n, h, v)?;
    rows.extend([
        ("shape/hidden", json!(h)),
        ("bench/gflops", json!(gflops)),
        ("bench/gflops_over_matmul", json!(gflops / rate)),
        ("mem/inputs_bytes", json!(input_bytes)),
        ("mem/grads_bytes", json!(grad_bytes)),
        (
            "mem/peak_above_grads_bytes",
            json!((measured.memory.above_start + measured.kept).saturating_sub(grad_bytes as u64)),
        ),
    ]);
    Ok(rows)
}

struct Timer<'a, R: Runner> {
    runner: &'a R,
    spec: LossSpec<'a>,
    cfg: &'a BenchConfig,
    run: &'a mut R::Run,
}

impl<R: Runner> Timer<'_, R> {
    /// Runs `warmup + steps` steps of `step`, preceded each time by the untimed `prepare`.
    fn time<S>(
        self,
        mut state: S,
        prepare: impl Fn(&mut S) -> Result<()>,
        step: impl Fn(&mut S) -> Result<f64>,
        kept: usize,
    ) -> Result<Measured> {
        let (runner, cfg) = (self.runner, self.cfg);
        let (mut times, mut loss, mut memory) = (Vec::new(), None, StepMemory::default());
        runner.begin_steps(self.run);
        for i in 0..cfg.warmup + cfg.steps.max(1) {
            prepare(&mut state)?;
            let start = runner.begin_step()?;
            let (step_loss, seconds) = runner.time(|| step(&mut state))?;
            memory = memory.max(runner.step_memory(start)?);
            if i >= cfg.warmup {
                times.push(seconds);
            }
            if loss.is_none() || cfg.restore {
                loss = Some(step_loss);
            }
        }
        Ok(Measured { times, loss: loss.unwrap_or(f64::NAN), memory, kept: kept as u64, pass_floor_s: None })
    }
}

/// The steps of a logits-level loss, on logits of any dtype.
struct LogitsSteps<'a, R: Runner> {
    timer: Timer<'a, R>,
}

impl<R: Runner> FloatVisitorOwned for LogitsSteps<'_, R> {
    type Out = Result<Measured>;

    fn visit<T: FloatElement>(self, host: Vec<T>) -> Result<Measured> {
        let (runner, spec, cfg) = (self.timer.runner, self.timer.spec, self.timer.cfg);
        let timer = self.timer;
        if cfg.implementation == BenchImpl::Baseline {
            let inputs = baseline::Inputs::new(spec, baseline::Source::logits(&host)?)?;
            return timer.time((), |_| Ok(()), |_| Ok(inputs.value_and_grad()?.0), 0);
        }
        let (len, bytes) = (host.len(), std::mem::size_of_val(host.as_slice()));
        if !spec.has_gradient() {
            let logits = runner.upload(host)?;
            return timer.time(logits, |_| Ok(()), |l| Ok(runner.forward(spec, l)?.loss), 0);
        }
        match cfg.implementation {
            // Restored before each step (untimed) from the host's pristine copy.
            BenchImpl::FusedInplace if cfg.restore => {
                // Filled from the host before every step, the first included.
                let mut logits = runner.zeros::<T>(len)?;
                let floor = runner.pass_floor(&mut logits, None);
                let restore = |l: &mut R::Buffer<T>| Ok(runner.refill(&host, l)?);
                timer
                    .time(logits, restore, |l| Ok(runner.forward_backward(spec, l, None)?.loss), 0)
                    .map(|m| m.with_pass_floor(floor))
            }
            // Each step on the previous step's gradient (same work, no second logits-sized
            // buffer: for shapes that would not fit twice).
            BenchImpl::FusedInplace => {
                let mut logits = runner.upload(host)?;
                let floor = runner.pass_floor(&mut logits, None);
                timer
                    .time(logits, |_| Ok(()), |l| Ok(runner.forward_backward(spec, l, None)?.loss), 0)
                    .map(|m| m.with_pass_floor(floor))
            }
            BenchImpl::Fused if cfg.fresh_gradient => {
                // The previous step's buffer is freed untimed, before the next step.
                let state = (runner.upload(host)?, None);
                let free = |(_, g): &mut (R::Buffer<T>, Option<R::Buffer<T>>)| {
                    *g = None;
                    Ok(())
                };
                let step = |(l, g): &mut (R::Buffer<T>, Option<R::Buffer<T>>)| {
                    let grad = g.insert(runner.zeros::<T>(len)?);
                    Ok(runner.forward_backward(spec, l, Some(grad))?.loss)
                };
                timer.time(state, free, step, 0)
            }
            BenchImpl::Fused => {
                // Filled once so the timed steps do not pay for the first touch of its pages.
                let mut grad = runner.upload(vec![T::from_f32(1.0); len])?;
                let mut logits = runner.upload(host)?;
                let floor = runner.pass_floor(&mut logits, Some(&mut grad));
                let step =
                    |(l, g): &mut (R::Buffer<T>, R::Buffer<T>)| Ok(runner.forward_backward(spec, l, Some(g))?.loss);
                timer.time((logits, grad), |_| Ok(()), step, bytes).map(|m| m.with_pass_floor(floor))
            }
            _ => unreachable!("bench::main refuses fused-linear without `hidden_size`"),
        }
    }
}

/// A fused-linear loss's f32 gradient buffers on a backend, kept across steps.
struct GradientBuffers<R: Runner> {
    hidden: R::Buffer<f32>,
    weight: R::Buffer<f32>,
    bias: Option<R::Buffer<f32>>,
}

/// The steps of a fused-linear loss, on hidden states of any dtype.
struct LinearSteps<'a, R: Runner> {
    timer: Timer<'a, R>,
    linear: &'a LinearData,
    budget: ChunkBudget,
    vocab: usize,
}

impl<R: Runner> FloatVisitor for LinearSteps<'_, R> {
    type Out = Result<Measured>;

    fn visit<T: FloatElement>(self, hidden: &[T]) -> Result<Measured> {
        let (runner, spec, cfg, lin, budget) =
            (self.timer.runner, self.timer.spec, self.timer.cfg, self.linear, self.budget);
        let timer = self.timer;
        if cfg.implementation == BenchImpl::Baseline {
            let typed = |d| T::slice_of(d).context("one dtype for all inputs");
            let (weight, bias) = (typed(&lin.weight)?, lin.bias.as_ref().map(typed).transpose()?);
            let source = baseline::Source::linear(hidden, weight, bias, lin.hidden_size)?;
            let inputs = baseline::Inputs::new(spec, source)?;
            return timer.time((), |_| Ok(()), |_| Ok(inputs.value_and_grad()?.0), 0);
        }
        let buffers = LinearOnBackend::upload(runner, lin, hidden)?;
        let inputs = buffers.inputs();
        if !spec.has_gradient() {
            return timer.time((), |_| Ok(()), |_| Ok(runner.linear_forward(spec, inputs, budget)?.loss), 0);
        }
        // Allocated (and touched) once: the gradients are outputs a training loop keeps.
        let (h, v) = (lin.hidden_size, self.vocab);
        let bias_len = if lin.bias.is_some() { v } else { 0 };
        let grads = GradientBuffers::<R> {
            hidden: runner.upload(vec![1.0f32; hidden.len()])?,
            weight: runner.upload(vec![1.0f32; v * h])?,
            bias: if bias_len > 0 { Some(runner.upload(vec![1.0f32; bias_len])?) } else { None },
        };
        let bytes = 4 * (hidden.len() + v * h + bias_len);
        let step = |g: &mut GradientBuffers<R>| {
            let grads =
                LinearGradientBuffers { hidden: &mut g.hidden, weight: Some(&mut g.weight), bias: g.bias.as_mut() };
            Ok(runner.linear_forward_backward(spec, inputs, grads, budget)?.loss)
        };
        timer.time(grads, |_| Ok(()), step, bytes)
    }
}

/// The printed metrics.
pub(crate) struct Report {
    rows: Vec<(&'static str, serde_json::Value)>,
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// The median of step times.
fn median(times: &[f64]) -> f64 {
    let mut sorted = times.to_vec();
    sorted.sort_by(f64::total_cmp);
    percentile(&sorted, 0.5)
}

/// The rows every report starts with, on any device: what ran, the shape, the step-time
/// statistics and the loss.
fn step_rows(cfg: &BenchConfig, batch: &Batch, dtype: DType, times: &[f64], loss: f64) -> Rows {
    let mut sorted = times.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mean = sorted.iter().sum::<f64>() / sorted.len() as f64;
    vec![
        ("bench/op", json!(format!("{:?}", batch.op).to_lowercase())),
        ("bench/impl", json!(cfg.implementation.name())),
        ("shape/batch", json!(batch.batch)),
        ("shape/seq_len", json!(batch.seq_len)),
        ("shape/vocab", json!(batch.vocab)),
        ("shape/dtype", json!(dtype.name())),
        ("bench/steps", json!(sorted.len())),
        ("bench/step_s_mean", json!(mean)),
        ("bench/step_s_p50", json!(percentile(&sorted, 0.5))),
        ("bench/step_s_p90", json!(percentile(&sorted, 0.9))),
        ("bench/step_s_min", json!(sorted[0])),
        ("bench/loss", json!(loss)),
    ]
}

impl Report {
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

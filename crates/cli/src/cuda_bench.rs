//! `flashgrpo bench --device cuda`: the microbenchmark on GPU 0. Each step is timed by CUDA events
//! around the whole call (statistics, the host objective and its two small copies, gradient);
//! memory is read from the stream-ordered allocator (its high-water mark of bytes handed out during
//! the step, which counts the inputs and the gradient buffers) and from the driver (the drop of free
//! memory from before the inputs were copied to after the steps, with the pool told to keep what it
//! reserves). The copy bandwidth (device to device) and, for fused-linear, cuBLAS's rate on the
//! forward product are measured in the same run.

use anyhow::{bail, Context, Result};
use flashgrpo_kernels::cuda::{CudaDevice, CudaElement, CudaLinearGradients};
use flashgrpo_kernels::{ChunkBudget, LossSpec, Op};
use serde_json::{json, Value};

use crate::batch::{Batch, LinearData, Scores};
use crate::bench::{median, step_rows, BenchConfig, BenchImpl, Report};
use crate::cuda_run::{gpu, DeviceLinear};
use crate::input_spec::InputSpec;
use crate::tensor_io::{FloatData, FloatElement};

/// Step times (seconds, by CUDA events) and the allocator's peak over the steps.
struct Steps {
    times: Vec<f64>,
    loss: f64,
    /// The most bytes handed out at once during a step (inputs and gradient buffers included).
    allocator_peak: u64,
    /// The most a step added above what was allocated when it started.
    step_extra: u64,
}

/// Runs `warmup + steps` steps, each after the untimed `prepare`.
fn time_steps<S>(
    device: &CudaDevice,
    cfg: &BenchConfig,
    state: &mut S,
    prepare: impl Fn(&mut S) -> Result<()>,
    step: impl Fn(&mut S) -> Result<f64>,
) -> Result<Steps> {
    let (mut times, mut loss, mut peak, mut extra) = (Vec::new(), None, 0u64, 0u64);
    for i in 0..cfg.warmup + cfg.steps.max(1) {
        prepare(state)?;
        device.synchronize()?;
        // Where the pool's attributes cannot be written, the peak stays cumulative (read as a
        // reading, not a failure).
        let _ = device.reset_allocator_peak();
        let in_use = device.memory()?.allocator_in_use.unwrap_or(0);
        let (step_loss, ms) = device.time_ms(|| step(state))?;
        let high = device.memory()?.allocator_peak.unwrap_or(0);
        peak = peak.max(high);
        extra = extra.max(high.saturating_sub(in_use));
        if i >= cfg.warmup {
            times.push(ms as f64 / 1e3);
        }
        if loss.is_none() || cfg.restore {
            loss = Some(step_loss);
        }
    }
    Ok(Steps { times, loss: loss.unwrap_or(f64::NAN), allocator_peak: peak, step_extra: extra })
}

/// Bytes per second of a device-to-device copy (read + written) of a 1 GiB buffer, median of ten.
fn copy_bandwidth(device: &CudaDevice) -> Result<f64> {
    let len = (1usize << 30) / 4;
    let src = device.upload(&vec![1.0f32; len])?;
    let mut dst = device.zeros::<f32>(len)?;
    let mut times = Vec::new();
    for i in 0..12 {
        let ((), ms) = device.time_ms(|| -> Result<()> {
            device.stream().memcpy_dtod(&src, &mut dst).map_err(|e| anyhow::anyhow!("copying on the GPU: {e:?}"))
        })?;
        if i >= 2 {
            times.push(ms as f64 / 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(2.0 * (len * 4) as f64 / times[times.len() / 2])
}

/// `flashgrpo bench --device cuda`.
pub fn run(cfg: &BenchConfig, inputs: &InputSpec, options: &flashgrpo_kernels::LossOptions) -> Result<Report> {
    let device = gpu()?;
    if let Err(e) = device.keep_reserved_memory() {
        eprintln!("warning: the allocator pool keeps releasing memory ({e}); mem/free_drop_bytes may miss the peak");
    }
    device.synchronize()?;
    let free_before = device.memory()?.free;
    let batch = inputs.build(options)?;
    let spec = batch.spec(options);
    let (steps, mut extra) = match &batch.scores {
        Scores::Logits(logits) => match logits {
            FloatData::F32(v) => logits_steps(device, cfg, spec, v)?,
            FloatData::BF16(v) => logits_steps(device, cfg, spec, v)?,
            FloatData::F16(v) => logits_steps(device, cfg, spec, v)?,
        },
        Scores::Linear(linear) => {
            let run = LinearBench { device, cfg, spec, linear, vocab: batch.vocab, budget: inputs.budget() };
            match &linear.hidden {
                FloatData::F32(h) => run.steps(h)?,
                FloatData::BF16(h) => run.steps(h)?,
                FloatData::F16(h) => run.steps(h)?,
            }
        }
    };
    let memory = device.memory()?;
    extra.push(("mem/free_drop_bytes", json!(free_before.saturating_sub(memory.free))));
    let p50 = median(&steps.times);
    let input_bytes = batch.scores.size_in_bytes();
    match &batch.scores {
        Scores::Logits(_) => {
            let copy = copy_bandwidth(device)?;
            // The floor: the logits read once and the gradient written once, at the copy rate.
            // The kernels read the logits twice (statistics, gradient) and write once.
            let floor = 2.0 * input_bytes as f64 / copy;
            extra.extend([
                ("bench/copy_gbps", json!(copy / 1e9)),
                ("bench/floor_s", json!(floor)),
                ("bench/p50_over_floor", json!(p50 / floor)),
                ("bench/moved_gbps", json!(3.0 * input_bytes as f64 / p50 / 1e9)),
                ("bench/moved_over_copy", json!(3.0 * input_bytes as f64 / p50 / copy)),
                ("mem/logits_bytes", json!(input_bytes)),
                ("mem/peak_above_logits_bytes", json!(steps.allocator_peak.saturating_sub(input_bytes as u64))),
            ]);
        }
        Scores::Linear(linear) => {
            let (n, h, v) = (batch.batch * batch.seq_len, linear.hidden_size, batch.vocab);
            // Entropy: one product (no gradient); sequence-level importance sampling recomputes the
            // logits in a second pass (four); otherwise three.
            let products = if batch.op == Op::Entropy {
                1.0
            } else if options.importance_sampling_level == flashgrpo_kernels::ImportanceSamplingLevel::Sequence {
                4.0
            } else {
                3.0
            };
            let tflops = products * 2.0 * (n * h * v) as f64 / p50 / 1e12;
            let rows = n.min(4096);
            let matmul = match &linear.hidden {
                FloatData::F32(_) => device.matmul_tflops::<f32>(rows, h, v)?,
                FloatData::BF16(_) => device.matmul_tflops::<half::bf16>(rows, h, v)?,
                FloatData::F16(_) => device.matmul_tflops::<half::f16>(rows, h, v)?,
            };
            extra.extend([
                ("shape/hidden", json!(h)),
                ("bench/tflops", json!(tflops)),
                ("bench/matmul_tflops", json!(matmul)),
                ("bench/tflops_over_matmul", json!(tflops / matmul)),
                ("mem/inputs_bytes", json!(input_bytes)),
            ]);
        }
    }
    Ok(report(cfg, &batch, device, steps, extra))
}

fn report(
    cfg: &BenchConfig,
    batch: &Batch,
    device: &CudaDevice,
    steps: Steps,
    extra: Vec<(&'static str, Value)>,
) -> Report {
    let mut rows = step_rows(cfg, batch, &steps.times, steps.loss);
    rows.extend([
        ("bench/device", json!(format!("cuda: {} ({})", device.name, device.arch))),
        ("mem/peak_bytes", json!(steps.allocator_peak)),
        ("mem/step_extra_bytes", json!(steps.step_extra)),
    ]);
    rows.extend(extra);
    Report::from_rows(rows)
}

type Measured = (Steps, Vec<(&'static str, Value)>);

fn logits_steps<T: CudaElement + FloatElement>(
    device: &CudaDevice,
    cfg: &BenchConfig,
    spec: LossSpec<'_>,
    host: &[T],
) -> Result<Measured> {
    let mut logits = device.upload(host)?;
    if !spec.loss.has_gradient() {
        let steps = time_steps(device, cfg, &mut logits, |_| Ok(()), |l| Ok(device.forward(spec, l)?.loss))?;
        return Ok((steps, Vec::new()));
    }
    let steps = match cfg.implementation {
        BenchImpl::FusedInplace => {
            let restore = |l: &mut flashgrpo_kernels::cuda::CudaSlice<T>| -> Result<()> {
                if cfg.restore {
                    device.stream().memcpy_htod(host, l).context("restoring the logits on the GPU")?;
                }
                Ok(())
            };
            time_steps(device, cfg, &mut logits, restore, |l| Ok(device.forward_backward(spec, l, None)?.loss))?
        }
        BenchImpl::Fused => {
            let mut state = (logits, device.zeros::<T>(host.len())?);
            time_steps(
                device,
                cfg,
                &mut state,
                |_| Ok(()),
                |(l, g)| Ok(device.forward_backward(spec, l, Some(g))?.loss),
            )?
        }
        other => bail!("`impl: {}` does not run on CUDA (fused or fused-inplace on logits)", other.name()),
    };
    Ok((steps, Vec::new()))
}

/// The fused-linear bench on the GPU.
struct LinearBench<'a> {
    device: &'a CudaDevice,
    cfg: &'a BenchConfig,
    spec: LossSpec<'a>,
    linear: &'a LinearData,
    vocab: usize,
    budget: ChunkBudget,
}

impl LinearBench<'_> {
    fn steps<T: CudaElement + FloatElement>(self, hidden: &[T]) -> Result<Measured> {
        let (device, lin, spec, budget) = (self.device, self.linear, self.spec, self.budget);
        if self.cfg.implementation != BenchImpl::FusedLinear {
            bail!("with `hidden_size`, `impl: fused-linear` is what runs on CUDA");
        }
        let on_gpu = DeviceLinear::upload(device, lin, hidden)?;
        let inputs = on_gpu.inputs();
        let has_bias = on_gpu.bias.is_some();
        if !spec.loss.has_gradient() {
            let steps = time_steps(
                device,
                self.cfg,
                &mut (),
                |_| Ok(()),
                |_| Ok(device.linear_forward(spec, inputs, budget)?.loss),
            )?;
            return Ok((steps, Vec::new()));
        }
        let (h, v) = (lin.hidden_size, self.vocab);
        let mut grads = (device.zeros::<f32>(hidden.len())?, device.zeros::<f32>(v * h)?, device.zeros::<f32>(v)?);
        let grad_bytes = 4 * (hidden.len() + v * h + if has_bias { v } else { 0 });
        let steps = time_steps(
            device,
            self.cfg,
            &mut grads,
            |_| Ok(()),
            |g| {
                let grads = CudaLinearGradients {
                    hidden: &mut g.0,
                    weight: Some(&mut g.1),
                    bias: if has_bias { Some(&mut g.2) } else { None },
                };
                Ok(device.linear_forward_backward(spec, inputs, grads, budget)?.loss)
            },
        )?;
        Ok((steps, vec![("mem/grads_bytes", json!(grad_bytes))]))
    }
}

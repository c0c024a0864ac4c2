//! The devices `--device` names, each a [`Backend`] of the kernels plus what `flashgrpo bench`
//! measures on it ([`Runner`]): how a step is timed (a clock on the CPU, CUDA events on a GPU),
//! what memory it counts (the counting allocator and the resident set, or the stream-ordered
//! allocator and the driver), the copy rate that sets the floor and the product rate fused-linear
//! is held against. `loss`, `gradcheck` and `bench` are written once over these.

use std::time::Instant;

use anyhow::Result;
use clap::ValueEnum;
use flashgrpo_kernels::linear::{matmul_bf16_gflops, matmul_gflops};
use flashgrpo_kernels::{Backend, Cpu, DType, Element, Isa};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::memory;

/// Where the fused kernels run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Device {
    #[default]
    Cpu,
    /// GPU 0 (feature `cuda`; needs a driver, NVRTC and, for fused-linear, cuBLAS at run time).
    Cuda,
}

/// Report rows: a metric's name and value.
pub type Rows = Vec<(&'static str, Value)>;

/// The memory a step held beyond what was allocated when it started, and the backend's
/// high-water mark of allocated bytes over the step where it keeps one.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepMemory {
    pub above_start: u64,
    pub high_water: Option<u64>,
}

impl StepMemory {
    /// The larger of two steps' figures.
    pub fn max(self, other: Self) -> Self {
        let high_water = match (self.high_water, other.high_water) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        Self { above_start: self.above_start.max(other.above_start), high_water }
    }
}

/// A backend as the bench measures it.
pub trait Runner: Backend {
    /// What a bench run's memory rows are measured against, taken before its inputs exist.
    type Run;

    fn begin_run(&self) -> Result<Self::Run>;

    /// Called once the buffers are in place, before the first step.
    fn begin_steps(&self, run: &mut Self::Run);

    /// Marks the start of a step (after its untimed preparation): the bytes allocated now.
    fn begin_step(&self) -> Result<u64>;

    /// Runs `work` and says how long it took, in seconds.
    fn time<R>(&self, work: impl FnOnce() -> Result<R>) -> Result<(R, f64)>;

    /// The step's memory, from the mark of [`begin_step`](Self::begin_step).
    fn step_memory(&self, start: u64) -> Result<StepMemory>;

    /// The run's memory rows, read right after the steps: `steps` over all steps, `kept` the
    /// bytes of buffers the timed implementation keeps between steps (gradient buffers), `inputs`
    /// the bytes of the inputs (logits, or hidden states and lm_head).
    fn memory_rows(&self, run: Self::Run, steps: StepMemory, kept: u64, inputs: u64) -> Result<Rows>;

    /// Rows on the memory traffic of a logits-level step of `p50` seconds, where the backend
    /// knows how many logits-sized transfers its kernels make.
    fn traffic_rows(&self, inputs: u64, p50: f64, copy_bps: f64) -> Rows {
        let _ = (inputs, p50, copy_bps);
        Vec::new()
    }

    /// Bytes per second of a large copy (read + written): the streaming rate.
    fn copy_bandwidth(&self) -> Result<f64>;

    /// The best time (s) of a pass with the memory traffic of a logits-level step, over the
    /// step's own buffers (`grad` absent: every line of the logits read and written back, which
    /// leaves them as they were; else the logits read and streamed into `grad`): that step's
    /// floor. `None` where not measured (the GPU, whose copy rate stands in).
    fn pass_floor<T: Element>(&self, logits: &mut Self::Buffer<T>, grad: Option<&mut Self::Buffer<T>>) -> Option<f64> {
        let _ = (logits, grad);
        None
    }

    /// The rate (GFLOP/s) of the backend's matrix product on the fused-linear forward shape in
    /// `dtype`, which the loss's own rate is held against, and rows naming every rate measured.
    fn product_rates(&self, dtype: DType, rows: usize, hidden: usize, vocab: usize) -> Result<(f64, Rows)>;
}

/// Code generic over the backend, run on the one `--device` names.
pub trait DeviceVisitor {
    type Out;
    fn visit<R: Runner>(self, runner: &R) -> Result<Self::Out>;
}

impl Device {
    /// Runs `visitor` on this device's backend (opening the GPU on first use).
    pub fn run<V: DeviceVisitor>(self, visitor: V) -> Result<V::Out> {
        match self {
            Device::Cpu => visitor.visit(&Cpu),
            Device::Cuda => on_gpu(visitor),
        }
    }

    /// What the device is, for reports: `cpu`, or `cuda: NAME (sm_XY)` (opening the GPU).
    pub fn describe(self) -> Result<String> {
        struct Describe;
        impl DeviceVisitor for Describe {
            type Out = String;
            fn visit<R: Runner>(self, runner: &R) -> Result<String> {
                Ok(runner.describe())
            }
        }
        self.run(Describe)
    }
}

#[cfg(feature = "cuda")]
fn on_gpu<V: DeviceVisitor>(visitor: V) -> Result<V::Out> {
    visitor.visit(gpu::device()?)
}

#[cfg(not(feature = "cuda"))]
fn on_gpu<V: DeviceVisitor>(_: V) -> Result<V::Out> {
    anyhow::bail!("this flashgrpo was built without the `cuda` feature")
}

/// The CPU: steps timed by the clock; heap bytes from the counting allocator, the resident set.
pub struct CpuRun {
    rss_before_steps: u64,
}

impl Runner for Cpu {
    type Run = CpuRun;

    fn begin_run(&self) -> Result<CpuRun> {
        Ok(CpuRun { rss_before_steps: 0 })
    }

    fn begin_steps(&self, run: &mut CpuRun) {
        memory::reset_peak_rss();
        run.rss_before_steps = memory::rss_bytes();
    }

    fn begin_step(&self) -> Result<u64> {
        let live = memory::live_bytes();
        memory::reset_peak();
        Ok(live as u64)
    }

    fn time<R>(&self, work: impl FnOnce() -> Result<R>) -> Result<(R, f64)> {
        let start = Instant::now();
        let out = work()?;
        Ok((out, start.elapsed().as_secs_f64()))
    }

    fn step_memory(&self, start: u64) -> Result<StepMemory> {
        Ok(StepMemory { above_start: (memory::peak_bytes() as u64).saturating_sub(start), high_water: None })
    }

    fn memory_rows(&self, run: CpuRun, steps: StepMemory, kept: u64, _inputs: u64) -> Result<Rows> {
        Ok(vec![
            ("bench/threads", json!(rayon::current_num_threads())),
            ("bench/row_kernels", json!(Isa::of_process().name())),
            ("mem/peak_bytes", json!(steps.above_start + kept)),
            ("mem/peak_rss_bytes", json!(memory::peak_rss_bytes())),
            ("mem/rss_before_steps_bytes", json!(run.rss_before_steps)),
        ])
    }

    /// A parallel copy of a 512 MiB buffer (no cache holds it, and every dtype and shape is
    /// measured against the same copy), best of six.
    fn copy_bandwidth(&self) -> Result<f64> {
        let n = (512 << 20) / 4;
        let src = vec![1.0f32; n];
        let mut dst = vec![0.0f32; n];
        let mut best = f64::INFINITY;
        for _ in 0..6 {
            let start = Instant::now();
            flashgrpo_kernels::backend::parallel_copy(&mut dst, &src);
            best = best.min(start.elapsed().as_secs_f64());
        }
        std::hint::black_box(&dst);
        Ok(2.0 * (n * 4) as f64 / best)
    }

    fn pass_floor<T: Element>(&self, logits: &mut Vec<T>, grad: Option<&mut Vec<T>>) -> Option<f64> {
        Some(match grad {
            None => crate::pass_floor::in_place_seconds(logits),
            Some(grad) => crate::pass_floor::streamed_seconds(logits, grad),
        })
    }

    /// The f32 product (`gemm`) on 256 rows, and for bf16 the bf16 products where the CPU has
    /// them (AMX, AVX512-BF16): the rate a bf16 loss is held against.
    fn product_rates(&self, dtype: DType, rows: usize, hidden: usize, vocab: usize) -> Result<(f64, Rows)> {
        let f32_rate = matmul_gflops(rows.min(256), hidden, vocab);
        let mut out: Rows = vec![("bench/matmul_gflops", json!(f32_rate))];
        let bf16_rate = (dtype == DType::BF16).then(|| matmul_bf16_gflops(rows.min(256), hidden, vocab)).flatten();
        if let Some(rate) = bf16_rate {
            out.push(("bench/matmul_bf16_gflops", json!(rate)));
        }
        if dtype == DType::BF16 {
            out.push(("bench/bf16_products", json!(flashgrpo_kernels::matmul_bf16::current().setting())));
        }
        Ok((bf16_rate.unwrap_or(f32_rate), out))
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use std::sync::OnceLock;

    use anyhow::{anyhow, Result};
    use flashgrpo_kernels::cuda::CudaDevice;
    use flashgrpo_kernels::{Backend, DType};
    use serde_json::json;

    use super::{Rows, Runner, StepMemory};

    /// GPU 0, opened (and its kernels compiled) once per process.
    pub fn device() -> Result<&'static CudaDevice> {
        static DEVICE: OnceLock<CudaDevice> = OnceLock::new();
        if let Some(d) = DEVICE.get() {
            return Ok(d);
        }
        let device = CudaDevice::new(0)?;
        Ok(DEVICE.get_or_init(|| device))
    }

    /// The GPU's free memory before a bench run's inputs were copied to it.
    pub struct GpuRun {
        free_before: usize,
    }

    /// A GPU: steps timed by CUDA events around the whole call (statistics, the host objective
    /// and its two small copies, gradient); memory from the stream-ordered allocator (its
    /// high-water mark of bytes handed out during a step, inputs and gradient buffers included)
    /// and from the driver (the drop of free memory over the run, with the pool told to keep
    /// what it reserves).
    impl Runner for CudaDevice {
        type Run = GpuRun;

        fn begin_run(&self) -> Result<GpuRun> {
            if let Err(e) = self.keep_reserved_memory() {
                eprintln!(
                    "warning: the allocator pool keeps releasing memory ({e}); mem/free_drop_bytes may miss the peak"
                );
            }
            self.synchronize()?;
            Ok(GpuRun { free_before: self.memory()?.free })
        }

        fn begin_steps(&self, _: &mut GpuRun) {}

        fn begin_step(&self) -> Result<u64> {
            self.synchronize()?;
            // Where the pool's attributes cannot be written, the peak stays cumulative (read as a
            // reading, not a failure).
            let _ = self.reset_allocator_peak();
            Ok(self.memory()?.allocator_in_use.unwrap_or(0))
        }

        fn time<R>(&self, work: impl FnOnce() -> Result<R>) -> Result<(R, f64)> {
            let (out, ms) = self.time_ms(work)?;
            Ok((out, ms as f64 / 1e3))
        }

        fn step_memory(&self, start: u64) -> Result<StepMemory> {
            let high = self.memory()?.allocator_peak.unwrap_or(0);
            Ok(StepMemory { above_start: high.saturating_sub(start), high_water: Some(high) })
        }

        fn memory_rows(&self, run: GpuRun, steps: StepMemory, _kept: u64, inputs: u64) -> Result<Rows> {
            let free = self.memory()?.free;
            let peak = steps.high_water.unwrap_or(0);
            Ok(vec![
                ("bench/device", json!(self.describe())),
                ("mem/peak_bytes", json!(peak)),
                ("mem/peak_above_inputs_bytes", json!(peak.saturating_sub(inputs))),
                ("mem/step_extra_bytes", json!(steps.above_start)),
                ("mem/free_drop_bytes", json!(run.free_before.saturating_sub(free))),
            ])
        }

        /// The kernels read the logits twice (statistics, gradient) and write once.
        fn traffic_rows(&self, inputs: u64, p50: f64, copy_bps: f64) -> Rows {
            let moved = 3.0 * inputs as f64;
            vec![
                ("bench/moved_gbps", json!(moved / p50 / 1e9)),
                ("bench/moved_over_copy", json!(moved / p50 / copy_bps)),
            ]
        }

        /// A device-to-device copy of 1 GiB, median of ten.
        fn copy_bandwidth(&self) -> Result<f64> {
            let len = (1usize << 30) / 4;
            let src = self.upload(&vec![1.0f32; len])?;
            let mut dst = self.zeros::<f32>(len)?;
            let mut times = Vec::new();
            for i in 0..12 {
                let ((), ms) = self.time_ms(|| -> Result<()> {
                    self.stream().memcpy_dtod(&src, &mut dst).map_err(|e| anyhow!("copying on the GPU: {e:?}"))
                })?;
                if i >= 2 {
                    times.push(ms as f64 / 1e3);
                }
            }
            times.sort_by(f64::total_cmp);
            Ok(2.0 * (len * 4) as f64 / times[times.len() / 2])
        }

        /// cuBLAS on up to 4096 rows, in the inputs' dtype.
        fn product_rates(&self, dtype: DType, rows: usize, hidden: usize, vocab: usize) -> Result<(f64, Rows)> {
            let rows = rows.min(4096);
            let tflops = flashgrpo_kernels::with_element!(dtype, T => self.matmul_tflops::<T>(rows, hidden, vocab)?);
            let gflops = tflops * 1e3;
            Ok((gflops, vec![("bench/matmul_gflops", json!(gflops))]))
        }
    }
}

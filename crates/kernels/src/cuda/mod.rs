//! The CUDA backend (feature `cuda`): the same three steps as the CPU engine, with the two
//! streaming passes (`rows.cu`: row statistics, gradient) on the GPU and the token objective, O(N)
//! scalar math, on the host between them. cudarc loads the driver and NVRTC at run time
//! (`dynamic-loading`), so this builds on machines with no CUDA at all; without a driver or NVRTC,
//! [`CudaDevice::new`] returns an error saying which library is missing, never a panic.
//!
//! NVRTC needs the CUDA headers (`cuda_fp16.h`, `cuda_bf16.h`): they are looked for in
//! `FLASHGRPO_CUDA_INCLUDE` (`:`-separated), `$CUDA_HOME/include`, `/usr/local/cuda/include`, and
//! beside every `lib` directory of `LD_LIBRARY_PATH` (the layout of the `nvidia-cuda-nvrtc` /
//! `nvidia-cuda-runtime` wheels: `nvidia/cu13/{lib,include}`).
//!
//! Not yet run on a GPU (the sessions so far had none): the kernels compile to PTX for sm_80 and
//! sm_90 in CI (`tests/cuda/nvrtc_compile.py`); the host side builds and reports a missing driver.

use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

use crate::engine::{LossSpec, PreparedLoss};
use crate::error::LossError;
use crate::objective::{LossOutput, RowGradient};
use crate::stats::PartialRowStats;
use crate::Element;

/// The kernels' source, compiled by NVRTC for the device at hand.
pub const ROWS_SOURCE: &str = include_str!("rows.cu");

/// Threads per block: one block per row; the statistics' shared-memory tree needs a power of two.
const THREADS: u32 = 256;

/// Logit element types the kernels are instantiated for.
pub trait CudaElement: Element + DeviceRepr + ValidAsZeroBits {
    /// The kernels' name suffix (`row_stats_f32`, ...).
    const SUFFIX: &'static str;
}

impl CudaElement for f32 {
    const SUFFIX: &'static str = "f32";
}

impl CudaElement for half::f16 {
    const SUFFIX: &'static str = "f16";
}

impl CudaElement for half::bf16 {
    const SUFFIX: &'static str = "bf16";
}

fn cuda_error(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> LossError {
    move |e| LossError::Cuda(format!("{what}: {e:?}"))
}

/// Where NVRTC looks for the CUDA headers.
pub fn include_dirs() -> Vec<String> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Ok(list) = std::env::var("FLASHGRPO_CUDA_INCLUDE") {
        dirs.extend(std::env::split_paths(&list));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(home) = std::env::var(var) {
            dirs.push(PathBuf::from(home).join("include"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/include"));
    if let Ok(list) = std::env::var("LD_LIBRARY_PATH") {
        for lib in std::env::split_paths(&list) {
            if let Some(parent) = lib.parent() {
                dirs.push(parent.join("include"));
            }
        }
    }
    dirs.into_iter().filter(|d| d.join("cuda_fp16.h").exists()).map(|d| d.display().to_string()).collect()
}

/// The device pointer of an optional buffer (0, a null pointer, when absent), and the guard that
/// orders the stream's use of it.
fn optional_ptr<'a, T>(
    buffer: Option<&'a CudaSlice<T>>,
    stream: &'a CudaStream,
) -> (u64, Option<cudarc::driver::SyncOnDrop<'a>>) {
    match buffer {
        Some(b) => {
            let (p, guard) = b.device_ptr(stream);
            (p, Some(guard))
        }
        None => (0, None),
    }
}

/// Steps 1 and 2's results, and the targets already on the device for step 3.
struct Evaluated {
    output: LossOutput,
    grads: Vec<RowGradient>,
    targets: Option<CudaSlice<i64>>,
}

/// One GPU with the kernels loaded.
pub struct CudaDevice {
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
    /// The device's name, as the driver reports it.
    pub name: String,
    /// `sm_XY`.
    pub arch: &'static str,
}

impl CudaDevice {
    /// Opens GPU `ordinal` and compiles the kernels for it.
    pub fn new(ordinal: usize) -> Result<Self, LossError> {
        // SAFETY: only probes whether the shared library can be loaded.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(LossError::Cuda(
                "no CUDA driver: libcuda.so could not be loaded (this machine has no NVIDIA GPU or driver)".into(),
            ));
        }
        // SAFETY: as above.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(LossError::Cuda(
                "no NVRTC: libnvrtc.so could not be loaded; `pip install nvidia-cuda-nvrtc nvidia-cuda-runtime` \
                 and put the wheel's lib directory (site-packages/nvidia/cu13/lib) on LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let context = CudaContext::new(ordinal).map_err(cuda_error("opening the GPU"))?;
        let (major, minor) = context.compute_capability().map_err(cuda_error("reading the compute capability"))?;
        let name = context.name().map_err(cuda_error("reading the device name"))?;
        let arch: &'static str = Box::leak(format!("sm_{major}{minor}").into_boxed_str());
        let includes = include_dirs();
        if includes.is_empty() {
            return Err(LossError::Cuda(
                "the CUDA headers (cuda_fp16.h) were not found; set FLASHGRPO_CUDA_INCLUDE".into(),
            ));
        }
        let options = CompileOptions {
            arch: Some(arch),
            include_paths: includes,
            options: vec!["--std=c++17".into()],
            ..Default::default()
        };
        let ptx = compile_ptx_with_opts(ROWS_SOURCE, options)
            .map_err(|e| LossError::Cuda(format!("NVRTC could not compile rows.cu for {arch}: {e:?}")))?;
        let module = context.load_module(ptx).map_err(cuda_error("loading the kernels"))?;
        let stream = context.default_stream();
        Ok(Self { context, stream, module, name, arch })
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Free and total device memory, in bytes.
    pub fn memory(&self) -> Result<(usize, usize), LossError> {
        self.context.mem_get_info().map_err(cuda_error("reading the memory"))
    }

    /// A host slice copied to the device.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, LossError> {
        self.stream.clone_htod(host).map_err(cuda_error("copying to the GPU"))
    }

    /// A device slice copied to the host.
    pub fn download<T: DeviceRepr + Default + Clone>(&self, device: &CudaSlice<T>) -> Result<Vec<T>, LossError> {
        self.stream.clone_dtoh(device).map_err(cuda_error("copying from the GPU"))
    }

    fn config(rows: usize) -> Result<LaunchConfig, LossError> {
        let grid = u32::try_from(rows).map_err(|_| LossError::Cuda(format!("{rows} rows exceed a grid")))?;
        Ok(LaunchConfig { grid_dim: (grid.max(1), 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 })
    }

    /// Steps 1 and 2: the row statistics of `logits` (`[N, V]` on this device) on the GPU, then the
    /// objective on the host.
    fn statistics_and_objective<T: CudaElement>(
        &self,
        prepared: &PreparedLoss<'_>,
        logits: &CudaSlice<T>,
    ) -> Result<Evaluated, LossError> {
        let rows = &prepared.spec().rows;
        let n = rows.len();
        if logits.len() != n * rows.vocab {
            return Err(LossError::Shape {
                tensor: "logits",
                got: vec![logits.len()],
                expected: format!("it must hold N*V = {n}*{} elements", rows.vocab),
            });
        }
        let vocab = i32::try_from(rows.vocab).map_err(|_| LossError::Cuda("vocab exceeds i32".into()))?;
        let inv_temperature = (1.0 / prepared.spec().options.temperature) as f32;
        let targets = rows.targets.map(|t| self.upload(t)).transpose()?;
        let active: Vec<f32> = prepared.active_rows().iter().map(|&a| if a { 1.0 } else { 0.0 }).collect();
        let active = self.upload(&active)?;
        let mut out = self.stream.alloc_zeros::<f32>(n * 5).map_err(cuda_error("allocating the statistics"))?;
        let function =
            self.module.load_function(&format!("row_stats_{}", T::SUFFIX)).map_err(cuda_error("finding row_stats"))?;
        let (targets_ptr, _t) = optional_ptr(targets.as_ref(), &self.stream);
        let mut launch = self.stream.launch_builder(&function);
        launch.arg(logits).arg(&vocab).arg(&inv_temperature).arg(&targets_ptr).arg(&active).arg(&mut out);
        // SAFETY: the arguments match `row_stats_*`'s signature in rows.cu, the buffers hold N*V
        // logits, N targets, N mask values and 5N statistics.
        unsafe { launch.launch(Self::config(n)?) }.map_err(cuda_error("launching row_stats"))?;
        drop(_t);
        let raw = self.download(&out)?;
        let stats: Vec<PartialRowStats> = raw
            .chunks_exact(5)
            .map(|s| PartialRowStats {
                max: s[0],
                sum_exp: s[1],
                sum_exp_shifted: s[2],
                sum_u: s[3],
                target_u: (!s[4].is_nan()).then_some(s[4]),
            })
            .collect();
        for (i, (s, &a)) in stats.iter().zip(prepared.active_rows()).enumerate() {
            if a && !s.is_finite() {
                let (b, t) = (i / rows.seq_len.max(1), i % rows.seq_len.max(1));
                return Err(LossError::NonFiniteLogits { row: i, b, t });
            }
        }
        let (output, grads) = prepared.objective(&stats)?;
        Ok(Evaluated { output, grads, targets })
    }

    /// The loss and per-token outputs of `logits` on this device.
    pub fn forward<T: CudaElement>(&self, spec: LossSpec<'_>, logits: &CudaSlice<T>) -> Result<LossOutput, LossError> {
        let prepared = PreparedLoss::new(spec)?;
        Ok(self.statistics_and_objective(&prepared, logits)?.output)
    }

    /// Forward and backward: the gradient into `grad` (same shape and dtype as `logits`), or, with
    /// `grad = None`, over the logits themselves.
    pub fn forward_backward<T: CudaElement>(
        &self,
        spec: LossSpec<'_>,
        logits: &mut CudaSlice<T>,
        grad: Option<&mut CudaSlice<T>>,
    ) -> Result<LossOutput, LossError> {
        let prepared = PreparedLoss::new(spec)?.expecting_gradient()?;
        let Evaluated { output, grads, targets } = self.statistics_and_objective(&prepared, logits)?;
        let n = grads.len();
        let scalars: Vec<f32> = grads.iter().flat_map(|g| [g.lse, g.a, g.b, g.c, g.d]).collect();
        let scalars = self.upload(&scalars)?;
        let vocab = prepared.spec().rows.vocab as i32;
        let inv_temperature = (1.0 / prepared.spec().options.temperature) as f32;
        let function = self
            .module
            .load_function(&format!("row_gradient_{}", T::SUFFIX))
            .map_err(cuda_error("finding row_gradient"))?;
        let (targets_ptr, _t) = optional_ptr(targets.as_ref(), &self.stream);
        let (logits_ptr, _l) = logits.device_ptr(&self.stream);
        if let Some(g) = grad.as_ref().filter(|g| g.len() != logits.len()) {
            return Err(LossError::GradientBuffer { got: g.len(), expected: logits.len() });
        }
        let (grad_ptr, _g) = optional_ptr(grad.as_deref(), &self.stream);
        let grad_ptr = if grad.is_some() { grad_ptr } else { logits_ptr };
        let mut launch = self.stream.launch_builder(&function);
        launch.arg(&logits_ptr).arg(&grad_ptr).arg(&vocab).arg(&inv_temperature).arg(&targets_ptr).arg(&scalars);
        // SAFETY: the arguments match `row_gradient_*`'s signature; `grad` holds as many elements
        // as the logits (or is the logits: each element is read before the same thread writes it).
        unsafe { launch.launch(Self::config(n)?) }.map_err(cuda_error("launching row_gradient"))?;
        self.stream.synchronize().map_err(cuda_error("waiting for the gradient"))?;
        Ok(output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_machine_without_a_gpu_gets_an_error_not_a_panic() {
        match CudaDevice::new(0) {
            Ok(device) => println!("GPU present: {} ({})", device.name, device.arch),
            Err(e) => {
                let text = e.to_string();
                assert!(text.contains("CUDA") || text.contains("NVRTC"), "{text}");
            }
        }
    }
}

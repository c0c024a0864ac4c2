//! One GPU with flashgrpo's kernels loaded: opening it (with a clear error where a library is
//! missing), NVRTC compilation of `rows.cu` for its architecture, copies, memory readings and
//! event timing.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::driver::sys;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PinnedHostSlice,
    SyncOnDrop, ValidAsZeroBits,
};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys, Ptx};

use super::overlap::RowBlocks;
use crate::error::LossError;
use crate::Element;

/// The kernels' source, compiled by NVRTC for the device at hand.
pub const ROWS_SOURCE: &str = include_str!("rows.cu");

/// Threads per block of the row kernels: one block per row; the statistics' shared-memory tree
/// needs a power of two (`FLASHGRPO_THREADS` in rows.cu).
pub(crate) const THREADS: u32 = 256;

/// Element types the kernels and products are instantiated for: every [`Element`] (which, with
/// this feature, is a `DeviceRepr`), with its kernels' name suffix and cuBLAS's name for it.
pub trait CudaElement: Element {
    /// The kernels' name suffix (`row_stats_f32`, ...).
    const SUFFIX: &'static str;
    /// cuBLAS's name for the type.
    const BLAS_TYPE: cudarc::cublas::sys::cudaDataType;
}

impl<T: Element> CudaElement for T {
    const SUFFIX: &'static str = T::DTYPE.name();
    const BLAS_TYPE: cudarc::cublas::sys::cudaDataType = match T::DTYPE {
        crate::DType::F32 => cudarc::cublas::sys::cudaDataType::CUDA_R_32F,
        crate::DType::F16 => cudarc::cublas::sys::cudaDataType::CUDA_R_16F,
        crate::DType::BF16 => cudarc::cublas::sys::cudaDataType::CUDA_R_16BF,
    };
}

/// Turns a driver error into ours, saying what was being done.
pub(crate) fn cuda_error(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> LossError {
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

/// Extra preprocessor definitions for rows.cu from `FLASHGRPO_CUDA_DEFINES` (`NAME` or
/// `NAME=VALUE`, separated by spaces or commas): the tuning switches at the top of rows.cu, so that
/// one GPU session can time variants of the kernels without a rebuild here.
fn extra_defines() -> Vec<String> {
    defines_from(&std::env::var("FLASHGRPO_CUDA_DEFINES").unwrap_or_default())
}

/// NVRTC's `--define-macro` options for a list of `NAME` / `NAME=VALUE`.
fn defines_from(list: &str) -> Vec<String> {
    list.split([' ', ',']).filter(|d| !d.is_empty()).map(|d| format!("--define-macro={d}")).collect()
}

/// Whether cuBLAS (fused-linear's products) can be loaded.
pub fn cublas_present() -> bool {
    // SAFETY: only probes whether the shared library can be loaded.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

/// `rows.cu` compiled by NVRTC to machine code (CUBIN) for `arch` (`sm_XY`). Machine code, not
/// PTX: a driver loads CUBIN from a newer NVRTC of its major version, but refuses PTX of a newer
/// version than its own. Needs NVRTC (no GPU): `flashgrpo cuda-check` runs it anywhere.
pub fn compile_kernels(arch: &str) -> Result<Vec<u8>, LossError> {
    // SAFETY: only probes whether the shared library can be loaded.
    if !unsafe { nvrtc_sys::is_culib_present() } {
        return Err(LossError::Cuda(
            "no NVRTC: libnvrtc.so could not be loaded; `pip install nvidia-cuda-nvrtc nvidia-cuda-runtime` \
             and put the wheel's lib directory (site-packages/nvidia/cu13/lib) on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let includes = include_dirs();
    if includes.is_empty() {
        return Err(LossError::Cuda(
            "the CUDA headers (cuda_fp16.h) were not found; set FLASHGRPO_CUDA_INCLUDE".into(),
        ));
    }
    let nvrtc_error = |what: &str| {
        let what = what.to_string();
        move |e: nvrtc::NvrtcError| LossError::Cuda(format!("NVRTC, {what} for {arch}: {e:?}"))
    };
    let source = std::ffi::CString::new(ROWS_SOURCE).expect("rows.cu has no NUL");
    let program = nvrtc::create_program(&source, Some(c"rows.cu")).map_err(nvrtc_error("creating the program"))?;
    let mut options = vec![format!("--gpu-architecture={arch}"), "--std=c++17".to_string()];
    options.extend(includes.iter().map(|d| format!("--include-path={d}")));
    options.extend(extra_defines());
    // SAFETY: `program` was created above and is destroyed once, below; the buffers passed to
    // NVRTC are sized by its own size queries.
    let result = unsafe {
        match nvrtc::compile_program(program, &options) {
            Err(e) => {
                let log = nvrtc::get_program_log(program).unwrap_or_default();
                let log = std::ffi::CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned();
                Err(LossError::Cuda(format!("NVRTC could not compile rows.cu for {arch}: {e:?}\n{log}")))
            }
            Ok(()) => {
                let mut size = 0usize;
                nvrtc_sys::nvrtcGetCUBINSize(program, &mut size).result().map_err(nvrtc_error("sizing the CUBIN"))?;
                let mut cubin = vec![0u8; size];
                nvrtc_sys::nvrtcGetCUBIN(program, cubin.as_mut_ptr().cast())
                    .result()
                    .map_err(nvrtc_error("reading the CUBIN"))?;
                Ok(cubin)
            }
        }
    };
    // SAFETY: created above, not destroyed before.
    unsafe { nvrtc::destroy_program(program) }.map_err(nvrtc_error("destroying the program"))?;
    match result {
        Ok(cubin) if cubin.is_empty() => {
            Err(LossError::Cuda(format!("NVRTC gave no machine code for {arch} (is it a real architecture, sm_XY?)")))
        }
        other => other,
    }
}

/// The device pointer of an optional buffer (0, a null pointer, when absent), and the guard that
/// orders the stream's use of it.
pub(crate) fn optional_ptr<'a, T>(
    buffer: Option<&'a CudaSlice<T>>,
    stream: &'a CudaStream,
) -> (u64, Option<SyncOnDrop<'a>>) {
    match buffer {
        Some(b) => {
            let (p, guard) = b.device_ptr(stream);
            (p, Some(guard))
        }
        None => (0, None),
    }
}

/// Device memory as the driver and the stream-ordered allocator see it, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Free device memory (`cuMemGetInfo`).
    pub free: usize,
    pub total: usize,
    /// The default memory pool's high-water mark of bytes handed out (cudarc allocates from it),
    /// since the last [`CudaDevice::reset_allocator_peak`]; `None` where the device has no pool.
    pub allocator_peak: Option<u64>,
    /// The bytes handed out by the pool now.
    pub allocator_in_use: Option<u64>,
}

/// One GPU with the kernels loaded.
pub struct CudaDevice {
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
    /// cuBLAS, opened on first use: the logits-level losses do not need it.
    blas: OnceLock<CudaBlas>,
    /// Two page-locked host buffers that row-local calls copy statistics back into, a block of
    /// rows at a time (`overlap`); kept, as pinning memory costs more than a block's pass.
    staging: Mutex<Vec<PinnedHostSlice<f32>>>,
    /// How row-local logits-level calls split their rows (default: from the multiprocessor count).
    pub row_blocks: RowBlocks,
    /// The device's name, as the driver reports it.
    pub name: String,
    /// `sm_XY`.
    pub arch: &'static str,
}

impl CudaDevice {
    /// Opens GPU `ordinal` and compiles the kernels for it.
    pub fn new(ordinal: usize) -> Result<Self, LossError> {
        // SAFETY: only probes whether the shared library can be loaded.
        if !unsafe { sys::is_culib_present() } {
            return Err(LossError::Cuda(
                "no CUDA driver: libcuda.so could not be loaded (this machine has no NVIDIA GPU or driver)".into(),
            ));
        }
        let context = CudaContext::new(ordinal).map_err(cuda_error("opening the GPU"))?;
        let (major, minor) = context.compute_capability().map_err(cuda_error("reading the compute capability"))?;
        let name = context.name().map_err(cuda_error("reading the device name"))?;
        let arch: &'static str = Box::leak(format!("sm_{major}{minor}").into_boxed_str());
        let cubin = compile_kernels(arch)?;
        let module = context.load_module(Ptx::from_binary(cubin)).map_err(cuda_error("loading the kernels"))?;
        let stream = context.default_stream();
        let multiprocessors = context
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cuda_error("reading the multiprocessor count"))?;
        let row_blocks = RowBlocks::for_multiprocessors(multiprocessors as usize);
        let staging = Mutex::new(Vec::new());
        Ok(Self { context, stream, module, blas: OnceLock::new(), staging, row_blocks, name, arch })
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// cuBLAS on this device's stream (opened on first use).
    pub(crate) fn blas(&self) -> Result<&CudaBlas, LossError> {
        if let Some(b) = self.blas.get() {
            return Ok(b);
        }
        if !cublas_present() {
            return Err(LossError::Cuda(
                "no cuBLAS: libcublas.so could not be loaded (fused-linear needs it); `pip install nvidia-cublas` \
                 and put its lib directory on LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let blas = CudaBlas::new(self.stream.clone()).map_err(|e| LossError::Cuda(format!("opening cuBLAS: {e:?}")))?;
        Ok(self.blas.get_or_init(|| blas))
    }

    /// The two staging buffers, of one length, at least `len` floats: they only grow, so that
    /// calls whose row count varies (RL batches) do not pin memory again each time.
    pub(crate) fn staging(&self, len: usize) -> Result<MutexGuard<'_, Vec<PinnedHostSlice<f32>>>, LossError> {
        let mut buffers = self.staging.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if buffers.len() != 2 || buffers.iter().any(|b| b.len() < len) {
            // Nothing may still be copying into the old buffers when they are freed.
            self.synchronize()?;
            buffers.clear();
            for _ in 0..2 {
                // SAFETY: the memory starts uninitialised; `overlap` reads only what a completed copy
                // wrote. Flags 0: cached (the default, write-combined, is slow for the host to read).
                let buffer = unsafe { self.context.alloc_pinned_with_flags::<f32>(len, 0) };
                buffers.push(buffer.map_err(cuda_error("allocating page-locked host memory"))?);
            }
        }
        Ok(buffers)
    }

    /// One of rows.cu's kernels by name.
    pub(crate) fn function(&self, name: &str) -> Result<CudaFunction, LossError> {
        self.module.load_function(name).map_err(|e| LossError::Cuda(format!("finding the kernel {name}: {e:?}")))
    }

    /// One block of [`THREADS`] per row.
    pub(crate) fn per_row(rows: usize) -> Result<LaunchConfig, LossError> {
        let grid = u32::try_from(rows).map_err(|_| LossError::Cuda(format!("{rows} rows exceed a grid")))?;
        Ok(LaunchConfig { grid_dim: (grid.max(1), 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 })
    }

    /// Enough blocks of [`THREADS`] for one thread per item (at most `max_blocks`; kernels that
    /// take this loop over the rest).
    pub(crate) fn per_item(items: usize, max_blocks: usize) -> LaunchConfig {
        let blocks = items.div_ceil(THREADS as usize).clamp(1, max_blocks) as u32;
        LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
    }

    /// A host slice copied to the device.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, LossError> {
        self.stream.clone_htod(host).map_err(cuda_error("copying to the GPU"))
    }

    /// A device slice copied to the host.
    pub fn download<T: DeviceRepr + Default + Clone>(&self, device: &CudaSlice<T>) -> Result<Vec<T>, LossError> {
        self.stream.clone_dtoh(device).map_err(cuda_error("copying from the GPU"))
    }

    /// A zeroed device buffer of `len` elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>, LossError> {
        self.stream.alloc_zeros::<T>(len.max(1)).map_err(cuda_error("allocating on the GPU"))
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<(), LossError> {
        self.stream.synchronize().map_err(cuda_error("waiting for the GPU"))
    }

    /// Milliseconds of GPU time taken by `work`, between two events recorded on the stream.
    pub fn time_ms<R, E: From<LossError>>(&self, work: impl FnOnce() -> Result<R, E>) -> Result<(R, f32), E> {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.stream.record_event(flags).map_err(cuda_error("recording an event"))?;
        let result = work()?;
        let end = self.stream.record_event(flags).map_err(cuda_error("recording an event"))?;
        let ms = start.elapsed_ms(&end).map_err(cuda_error("reading the events"))?;
        Ok((result, ms))
    }

    fn default_pool(&self) -> Result<Option<sys::CUmemoryPool>, LossError> {
        if !self.context.has_async_alloc() {
            return Ok(None);
        }
        self.context.bind_to_thread().map_err(cuda_error("binding the context"))?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: writes one pool handle for a valid device of the bound context.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, self.context.cu_device()) }
            .result()
            .map_err(cuda_error("reading the default memory pool"))?;
        Ok(Some(pool))
    }

    fn pool_attribute(&self, attribute: sys::CUmemPool_attribute, set: Option<u64>) -> Result<Option<u64>, LossError> {
        let Some(pool) = self.default_pool()? else { return Ok(None) };
        let mut value: u64 = set.unwrap_or(0);
        let pointer = (&mut value as *mut u64).cast();
        // SAFETY: the attributes used here are all `cuuint64_t`, read from or written to `value`.
        let result = unsafe {
            match set {
                Some(_) => sys::cuMemPoolSetAttribute(pool, attribute, pointer),
                None => sys::cuMemPoolGetAttribute(pool, attribute, pointer),
            }
        };
        result.result().map_err(cuda_error("a memory pool attribute"))?;
        Ok(Some(value))
    }

    /// Free and total device memory, and the allocator's figures (`None` where the pool's
    /// attributes cannot be read: a reading, not a reason to fail).
    pub fn memory(&self) -> Result<DeviceMemory, LossError> {
        let (free, total) = self.context.mem_get_info().map_err(cuda_error("reading the memory"))?;
        let read = |a| self.pool_attribute(a, None).ok().flatten();
        let allocator_peak = read(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH);
        let allocator_in_use = read(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT);
        Ok(DeviceMemory { free, total, allocator_peak, allocator_in_use })
    }

    /// Starts a new window for [`DeviceMemory::allocator_peak`] at the bytes in use now.
    pub fn reset_allocator_peak(&self) -> Result<(), LossError> {
        self.pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, Some(0))?;
        Ok(())
    }

    /// Keeps what the pool reserves instead of returning it to the driver at each synchronisation,
    /// so that the drop of free memory after a run shows the run's peak reservation. A property of
    /// this process's pool, not a setting of the GPU.
    pub fn keep_reserved_memory(&self) -> Result<(), LossError> {
        self.pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, Some(u64::MAX))?;
        Ok(())
    }
}

/// Waits for the stream before the module, the staging buffers and the context go: cudarc's
/// page-locked buffers do not wait for copies into them on a single stream.
impl Drop for CudaDevice {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuning_defines_split_on_spaces_and_commas() {
        assert!(defines_from("").is_empty());
        assert_eq!(
            defines_from("FLASHGRPO_FAST_EXP=0, FLASHGRPO_STATS_BYTES=32 X"),
            ["--define-macro=FLASHGRPO_FAST_EXP=0", "--define-macro=FLASHGRPO_STATS_BYTES=32", "--define-macro=X"]
        );
    }

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

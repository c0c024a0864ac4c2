//! The CUDA backend (feature `cuda`): the same three steps as the CPU engine, with the streaming
//! passes (`rows.cu`: row statistics, gradient) on the GPU and the token objective, O(N) scalar
//! math, on the host between them. Fused-linear adds cuBLAS's products around the same passes.
//! cudarc loads the driver, NVRTC and cuBLAS at run time (`dynamic-loading`), so this builds on
//! machines with no CUDA at all; a missing library is an error naming it, never a panic.
//!
//! - [`device`]: opening a GPU, compiling `rows.cu` for it, copies, memory readings, timing.
//! - [`logits`]: losses of `[N, V]` logits already on the GPU (gradient out of place or in place).
//! - [`linear`]: fused-linear losses from hidden states and an lm_head on the GPU.
//! - `overlap`: a row-local objective evaluated a block of rows at a time while the GPU streams
//!   the next block, so that the GPU does not wait for the whole objective between its passes.
//! - `passes`: launching the row passes over a block of rows; `blas`: the row-major products of
//!   fused-linear, on cuBLAS; `phases`: the `FLASHGRPO_CUDA_PHASES` diagnostic (host-clock time of
//!   each phase of a logits-level call).
//!
//! NVRTC needs the CUDA headers (`cuda_fp16.h`, `cuda_bf16.h`): they are looked for in
//! `FLASHGRPO_CUDA_INCLUDE` (`:`-separated), `$CUDA_HOME/include`, `/usr/local/cuda/include`, and
//! beside every `lib` directory of `LD_LIBRARY_PATH` (the layout of the `nvidia-cuda-nvrtc` /
//! `nvidia-cuda-runtime` wheels: `nvidia/cu13/{lib,include}`).
//!
//! Run on an H100 (docs/BENCHMARKS.md, "CUDA on an H100"): the kernel tests and gradchecks pass
//! there. CI has no GPU: there the kernels compile to PTX for sm_80 and sm_90
//! (`tests/cuda/nvrtc_compile.py`) and the host side builds and reports a missing driver.

mod blas;
pub mod device;
pub mod linear;
pub mod logits;
mod overlap;
mod passes;
mod phases;

/// Device buffers, as the functions here take them.
pub use cudarc::driver::CudaSlice;
pub use device::{compile_kernels, cublas_present, include_dirs, CudaDevice, CudaElement, DeviceMemory, ROWS_SOURCE};
pub use linear::{CudaLinearGradients, CudaLinearInputs};
pub use overlap::RowBlocks;

use crate::engine::{LossSpec, PreparedLoss};
use crate::error::LossError;

/// [`PreparedLoss::new`] for the CUDA passes, which refuse what they do not apply rather than
/// ignore it: a soft cap (`LossOptions::softcap`), the predicted tokens
/// (`LossOptions::predicted_tokens`) and the entropy's gradient (`LossOptions::entropy_gradient`),
/// computed by the CPU engine only for now, and label
/// smoothing weighted by class weights (the passes sum `u` unweighted; class weights without label
/// smoothing are each row's `c_y`, which the host's objective applies).
pub(crate) fn prepare(spec: LossSpec<'_>) -> Result<PreparedLoss<'_>, LossError> {
    if spec.options.softcap.is_some() {
        return Err(LossError::InvalidOption {
            name: "softcap",
            message: "the CUDA backend does not apply a soft cap yet; run this loss on the CPU".to_string(),
        });
    }
    if spec.options.entropy_gradient {
        return Err(LossError::InvalidOption {
            name: "entropy_gradient",
            message: "the CUDA backend does not compute the entropy's gradient yet; run this loss on the CPU"
                .to_string(),
        });
    }
    if spec.options.predicted_tokens {
        return Err(LossError::InvalidOption {
            name: "predicted_tokens",
            message: "the CUDA backend does not report predicted tokens yet; run this loss on the CPU".to_string(),
        });
    }
    if spec.loss.class_weights().is_some() && spec.options.label_smoothing != 0.0 {
        return Err(LossError::InvalidOption {
            name: "class_weights",
            message: "the CUDA backend does not weight label smoothing by class yet (class weights without label \
                      smoothing run there); run this loss on the CPU"
                .to_string(),
        });
    }
    PreparedLoss::new(spec)
}

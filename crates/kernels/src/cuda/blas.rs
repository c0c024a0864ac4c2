//! Row-major matrix products on cuBLAS (column-major), for fused-linear: f32 outputs from f32,
//! f16 or bf16 operands, f32 accumulation (`CUBLAS_COMPUTE_32F`: true f32 for f32 operands, no
//! TF32; tensor cores for f16 / bf16). cuBLAS gives the same bits on every run on one GPU model
//! with one stream, which keeps the kernels deterministic.

use std::ffi::c_void;

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;

use crate::error::LossError;

/// An operand: a row-major matrix at `ptr` with `ld` elements between rows, used as it is or
/// transposed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Operand {
    pub ptr: u64,
    pub ld: usize,
    pub dtype: cudaDataType,
    pub transposed: bool,
}

/// `C [m, n] (f32, row-major, ld `ldc`) = op(A) [m, k] @ op(B) [k, n] + beta * C`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    blas: &CudaBlas,
    (m, n, k): (usize, usize, usize),
    a: Operand,
    b: Operand,
    c: u64,
    ldc: usize,
    beta: f32,
) -> Result<(), LossError> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    let int = |x: usize, what: &str| {
        i32::try_from(x).map_err(|_| LossError::Cuda(format!("a product's {what} ({x}) exceeds cuBLAS's i32")))
    };
    let op = |o: &Operand| if o.transposed { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
    let (alpha, beta) = (1.0f32, beta);
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: B's buffer comes first, and
    // a row-major buffer read column-major is already its transpose, so the flags stay as given.
    // SAFETY: the pointers are live device buffers of the sizes the dimensions and leading
    // dimensions describe (checked by the callers), alpha and beta are host f32 (the handle's
    // default pointer mode), and the type combination is one cublasGemmEx supports with
    // CUBLAS_COMPUTE_32F (A and B of one type, C f32).
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            op(&b),
            op(&a),
            int(n, "columns")?,
            int(m, "rows")?,
            int(k, "inner size")?,
            (&alpha as *const f32).cast::<c_void>(),
            b.ptr as *const c_void,
            b.dtype,
            int(b.ld, "leading dimension")?,
            a.ptr as *const c_void,
            a.dtype,
            int(a.ld, "leading dimension")?,
            (&beta as *const f32).cast::<c_void>(),
            c as *mut c_void,
            cudaDataType::CUDA_R_32F,
            int(ldc, "leading dimension")?,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| LossError::Cuda(format!("cuBLAS product [{m}, {k}] @ [{k}, {n}]: {e:?}")))
}

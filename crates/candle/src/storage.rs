//! Reading and writing candle CPU storage as typed, contiguous slices.

use candle_core::{bail, CpuStorage, Layout, Result, Shape};
use half::{bf16, f16};

/// A contiguous float tensor's data, borrowed from candle's storage.
pub(crate) enum Floats<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
    F64(&'a [f64]),
}

/// The contiguous elements of `storage` under `layout`; `what` names the tensor in errors.
pub(crate) fn floats<'a>(storage: &'a CpuStorage, layout: &Layout, what: &str) -> Result<Floats<'a>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("{what} must be contiguous (call .contiguous() first)")
    };
    Ok(match storage {
        CpuStorage::F32(v) => Floats::F32(&v[start..end]),
        CpuStorage::BF16(v) => Floats::BF16(&v[start..end]),
        CpuStorage::F16(v) => Floats::F16(&v[start..end]),
        CpuStorage::F64(v) => Floats::F64(&v[start..end]),
        other => bail!("{what} must be a float tensor, not {:?}", candle_core::backend::BackendStorage::dtype(other)),
    })
}

impl Floats<'_> {
    /// Widened to f64 (for the f64 paths of the model ops).
    pub fn to_f64(&self) -> Vec<f64> {
        match self {
            Floats::F32(v) => v.iter().map(|&x| x as f64).collect(),
            Floats::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
            Floats::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
            Floats::F64(v) => v.to_vec(),
        }
    }

    /// Widened to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            Floats::F32(v) => v.to_vec(),
            Floats::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
            Floats::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            Floats::F64(v) => v.iter().map(|&x| x as f32).collect(),
        }
    }

    pub fn is_f64(&self) -> bool {
        matches!(self, Floats::F64(_))
    }

    /// A storage of the same dtype holding `values` (rounded to nearest even).
    pub fn like_f32(&self, values: Vec<f32>) -> CpuStorage {
        match self {
            Floats::F32(_) => CpuStorage::F32(values),
            Floats::BF16(_) => CpuStorage::BF16(values.iter().map(|&x| bf16::from_f32(x)).collect()),
            Floats::F16(_) => CpuStorage::F16(values.iter().map(|&x| f16::from_f32(x)).collect()),
            Floats::F64(_) => CpuStorage::F64(values.iter().map(|&x| x as f64).collect()),
        }
    }

    /// A storage of the same dtype holding `values`.
    pub fn like_f64(&self, values: Vec<f64>) -> CpuStorage {
        match self {
            Floats::F64(_) => CpuStorage::F64(values),
            _ => self.like_f32(values.iter().map(|&x| x as f32).collect()),
        }
    }
}

/// Runs `f` in f64 for f64 tensors and in f32 otherwise, returning a storage of the input's dtype.
pub(crate) fn compute<F32, F64>(input: &Floats<'_>, f32_path: F32, f64_path: F64) -> CpuStorage
where
    F32: FnOnce(Vec<f32>) -> Vec<f32>,
    F64: FnOnce(Vec<f64>) -> Vec<f64>,
{
    if input.is_f64() {
        input.like_f64(f64_path(input.to_f64()))
    } else {
        input.like_f32(f32_path(input.to_f32()))
    }
}

/// `(storage, shape)` as a custom op returns it.
pub(crate) fn out(storage: CpuStorage, shape: &Shape) -> Result<(CpuStorage, Shape)> {
    Ok((storage, shape.clone()))
}

//! The logits element types: f32, bf16 and f16. Everything is accumulated in f32 whatever the
//! storage type; the gradient is written back in the storage type (one rounding).

use half::{bf16, f16};

/// Storage type of logits and of their gradient; in configs `f32`, `bf16` or `f16`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum DType {
    #[default]
    #[serde(rename = "f32", alias = "float32")]
    F32,
    #[serde(rename = "bf16", alias = "bfloat16")]
    BF16,
    #[serde(rename = "f16", alias = "float16")]
    F16,
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = crate::LossError;

    /// `f32` / `float32`, `bf16` / `bfloat16`, `f16` / `float16` (the spellings of the CLI, of
    /// PyTorch and of NumPy / JAX).
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name {
            "f32" | "float32" => Ok(DType::F32),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "f16" | "float16" => Ok(DType::F16),
            _ => Err(crate::LossError::UnknownDType { name: name.to_string() }),
        }
    }
}

impl DType {
    /// `f32`, `bf16` or `f16`: the configs' spelling, and the suffix of the CUDA kernels' names.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }

    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }
}

/// Runs `$body` with the type alias `$T` bound to the [`Element`] of `$dtype`: the one dtype
/// dispatch of every front end that holds untyped storage (the Python bindings, the CLI).
#[macro_export]
macro_rules! with_element {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::BF16 => {
                type $T = $crate::half::bf16;
                $body
            }
            $crate::DType::F16 => {
                type $T = $crate::half::f16;
                $body
            }
        }
    };
}

/// What a GPU buffer's element must be (cudarc's `DeviceRepr` and `ValidAsZeroBits`), asked of
/// every [`Element`] when the `cuda` feature is on: one `T: Element` bound then serves both
/// backends of [`crate::Backend`]. Nothing without the feature.
#[cfg(feature = "cuda")]
pub trait DeviceElement: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits {}
#[cfg(feature = "cuda")]
impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits> DeviceElement for T {}
/// What a GPU buffer's element must be: nothing without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub trait DeviceElement {}
#[cfg(not(feature = "cuda"))]
impl<T> DeviceElement for T {}

/// Only this crate implements [`Element`]: the vector kernels read and write an element's memory
/// as its [`DType`] says (16 bf16 are 32 bytes), so a type of another size or layout claiming a
/// dtype would make them read past its slices.
mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// A logits element: loaded widened to f32, stored rounded to nearest even. Implemented for
/// `f32`, `half::bf16` and `half::f16` only (sealed).
pub trait Element:
    sealed::Sealed + DeviceElement + Copy + Send + Sync + Default + PartialEq + std::fmt::Debug + 'static
{
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(value: f32) -> Self;
    /// The values themselves, when they already are f32 (no widening pass needed).
    fn as_f32_slice(values: &[Self]) -> Option<&[f32]> {
        let _ = values;
        None
    }
    /// The values' bf16 bits, when they are bf16 (the bf16 matrix products read them as they are).
    fn as_bf16_bits(values: &[Self]) -> Option<&[u16]> {
        let _ = values;
        None
    }
    /// As [`as_f32_slice`](Self::as_f32_slice), mutably.
    fn as_f32_slice_mut(values: &mut [Self]) -> Option<&mut [f32]> {
        let _ = values;
        None
    }
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn as_f32_slice(values: &[Self]) -> Option<&[f32]> {
        Some(values)
    }
    #[inline(always)]
    fn as_f32_slice_mut(values: &mut [Self]) -> Option<&mut [f32]> {
        Some(values)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        value
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn as_bf16_bits(values: &[Self]) -> Option<&[u16]> {
        use half::slice::HalfFloatSliceExt;
        Some(values.reinterpret_cast())
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        // A bf16 is the top half of an f32: widening is a shift, which vectorises.
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    /// Round to nearest even, as `half` does, written branch-free so that a loop of it vectorises.
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        let bits = value.to_bits();
        let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16;
        let quiet_nan = (bits >> 16) | 0x0040;
        bf16::from_bits(if value.is_nan() { quiet_nan } else { rounded } as u16)
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        f16::from_f32(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_matches_half() {
        let mut bits = 0u32;
        loop {
            let v = f32::from_bits(bits);
            assert_eq!(<bf16 as Element>::from_f32(v).to_bits(), bf16::from_f32(v).to_bits(), "{v:e} ({bits:#x})");
            bits = match bits.checked_add(0x0000_1F3B) {
                Some(b) => b,
                None => break,
            };
        }
        for v in [f32::MAX, f32::INFINITY, -f32::INFINITY, f32::NAN, 1.0 + f32::EPSILON, 3.0039062, -0.0] {
            assert_eq!(<bf16 as Element>::from_f32(v).to_bits(), bf16::from_f32(v).to_bits(), "{v:e}");
        }
    }

    #[test]
    fn bf16_widening_matches_half() {
        for v in [0.0f32, -0.0, 1.5, -3.25e7, 1e-30, f32::INFINITY, f32::MIN_POSITIVE] {
            let b = bf16::from_f32(v);
            assert_eq!(Element::to_f32(b).to_bits(), b.to_f32().to_bits());
        }
    }
}

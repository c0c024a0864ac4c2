//! The logits element types: f32, bf16 and f16. Everything is accumulated in f32 whatever the
//! storage type; the gradient is written back in the storage type (one rounding).

use half::{bf16, f16};

/// Storage type of logits and of their gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    BF16,
    F16,
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        })
    }
}

/// A logits element: loaded widened to f32, stored rounded to nearest even.
pub trait Element: Copy + Send + Sync + Default + PartialEq + std::fmt::Debug + 'static {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(value: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
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
    #[inline(always)]
    fn to_f32(self) -> f32 {
        // A bf16 is the top half of an f32: widening is a shift, which vectorises.
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        bf16::from_f32(value)
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
    fn bf16_widening_matches_half() {
        for v in [0.0f32, -0.0, 1.5, -3.25e7, 1e-30, f32::INFINITY, f32::MIN_POSITIVE] {
            let b = bf16::from_f32(v);
            assert_eq!(Element::to_f32(b).to_bits(), b.to_f32().to_bits());
        }
    }
}

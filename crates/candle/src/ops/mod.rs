//! Differentiable fused ops for the model. candle's fast `rms_norm`, `rope` and
//! `softmax_last_dim` drop gradients (and its `index_select` backward spends two `[V, H]` buffers); these have a backward, each a kernel of ours run through
//! `apply_op*_no_bwd`, and each is tested against candle's slow composed version.
//! Computation is in f32 for f32 / bf16 / f16 tensors and in f64 for f64 ones.

mod embedding;
mod masked_softmax;
mod rms_norm;
mod rope;

pub use embedding::embedding;
pub use masked_softmax::{masked_softmax, AttentionMask};
pub use rms_norm::rms_norm;
pub use rope::{rope, RopeTable};

use std::iter::Sum;
use std::ops::{Add, AddAssign, Div, Mul, Neg, Sub};

/// The arithmetic the op kernels are written over: f32 or f64.
pub(crate) trait Real:
    Copy
    + Send
    + Sync
    + Default
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + Sum
{
    fn from_f64(x: f64) -> Self;
    fn sqrt(self) -> Self;
    fn exp(self) -> Self;
}

impl Real for f32 {
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    fn exp(self) -> Self {
        f32::exp(self)
    }
}

impl Real for f64 {
    fn from_f64(x: f64) -> Self {
        x
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    fn exp(self) -> Self {
        f64::exp(self)
    }
}

//! Errors of the kernels: each names the tensor, row or option at fault, so the user knows what
//! to fix without reading our code.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum LossError {
    #[error("invalid option `{name}`: {message}")]
    InvalidOption { name: &'static str, message: String },

    #[error("`{tensor}` has shape {got:?}, but {expected}")]
    Shape { tensor: &'static str, got: Vec<usize>, expected: String },

    #[error("missing input `{tensor}`: {why}")]
    MissingInput { tensor: &'static str, why: String },

    #[error("`{tensor}` and `{other}` were both given: {why}")]
    ConflictingInputs { tensor: &'static str, other: &'static str, why: String },

    #[error(
        "targets[{b}, {t}] (row {row}) = {value} is outside the vocabulary [0, {vocab}) on an unmasked row; \
         mask the row or fix the target"
    )]
    TargetOutOfRange { row: usize, b: usize, t: usize, value: i64, vocab: usize },

    #[error("logits row {row} (b = {b}, t = {t}) contains NaN or Inf")]
    NonFiniteLogits { row: usize, b: usize, t: usize },

    #[error("`{tensor}` has a non-finite value {value} at row {row} (b = {b}, t = {t})")]
    NonFiniteInput { tensor: &'static str, row: usize, b: usize, t: usize, value: f32 },

    #[error("`mask` must hold 0 or 1, but mask[{b}, {t}] (row {row}) = {value}")]
    MaskValue { row: usize, b: usize, t: usize, value: f32 },

    #[error("the gradient buffer has {got} elements, but the logits have {expected}")]
    GradientBuffer { got: usize, expected: usize },

    #[error("the `{op}` op has no gradient")]
    NoGradient { op: &'static str },

    #[error("unknown dtype `{name}`: expected f32 (float32), bf16 (bfloat16) or f16 (float16)")]
    UnknownDType { name: String },

    #[error("unknown op `{name}`: expected grpo, cross_entropy, entropy or logprob")]
    UnknownOp { name: String },

    #[error("vocabulary shards: {0}")]
    Shard(String),

    #[error("CUDA: {0}")]
    Cuda(String),
}

//! # flashgrpo-kernels
//!
//! Fused, streaming loss kernels for reinforcement learning and fine-tuning of language models:
//! GRPO and its PPO-family variants, cross-entropy, entropy and per-token log-probabilities,
//! forward and backward, over `[B, T, V]` logits in f32, bf16 or f16, without ever building an
//! `[N, V]` temporary. The semantics are those of `spec/LOSSES.md` (TRL / Liger-Kernel); see
//! the repository's `docs/LOSSES.md`.
//!
//! Every loss is three steps over the rows of the logits:
//! 1. **row statistics** ([`stats`]): one streaming pass per row, f32 accumulation;
//! 2. **token objective** ([`objective`]): scalar math per row, the loss and four gradient
//!    scalars per row;
//! 3. **gradient pass**: a second streaming pass writing
//!    `dlogits_j = a*[j=y] + p_j (b + c log p_j) + d`, into a new buffer or over the logits.
//!
//! [`forward`], [`forward_backward`] and [`forward_backward_in_place`] run the three steps;
//! [`PreparedLoss`] exposes them one by one for vocabulary-sharded (tensor-parallel) callers,
//! and [`BatchShard`] gives data-parallel callers the global normalisers. [`reference`](mod@reference) is the
//! f64 implementation everything is tested against.
//!
//! ```
//! use flashgrpo_kernels::{forward_backward, Loss, LossOptions, LossSpec, PolicyInputs, Rows};
//! let (b, t, v) = (1, 2, 5);
//! let logits = vec![0.5f32; b * t * v];
//! let mut grad = vec![0.0f32; b * t * v];
//! let options = LossOptions { beta: 0.0, ..Default::default() };
//! let spec = LossSpec {
//!     loss: Loss::Grpo(PolicyInputs::new(&[1.0])),
//!     rows: Rows { batch: b, seq_len: t, vocab: v, targets: Some(&[1, 3]), mask: None },
//!     options: &options,
//!     batch_shard: None,
//! };
//! let out = forward_backward(spec, &logits, &mut grad).unwrap();
//! assert!((out.loss + 1.0).abs() < 1e-6); // on-policy: r = 1, loss = -A
//! ```

pub mod backend;
mod cpu;
/// Re-exported for [`with_element!`]'s bf16 and f16.
pub use half;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod element;
mod engine;
pub mod error;
pub mod huge_pages;
pub mod inputs;
pub mod linear;
pub mod matmul;
pub mod matmul_bf16;
pub mod objective;
pub mod options;
pub mod owned;
pub mod reference;
mod scratch;
pub mod stats;
pub mod synthetic;

pub use backend::{Backend, Cpu, LinearBuffers, LinearGradientBuffers};
pub use cpu::isa::{with_isa, Isa};
pub use cpu::GradientTarget;
pub use element::{DType, Element};
pub use engine::{combine_shards, forward, forward_backward, forward_backward_in_place, LossSpec, PreparedLoss};
pub use error::LossError;
pub use inputs::{BatchShard, CrossEntropyInputs, IsRatio, Loss, Op, PolicyInputs, Rows};
pub use linear::{
    linear_forward, linear_forward_backward, ChunkBudget, LinearGradients, LinearInputs, PreparedLinearLoss,
};
pub use matmul_bf16::{with_bf16_products, Bf16Choice, Bf16Products};
pub use objective::{quantile, LossOutput, OutputUpstreams, RowGradient};
pub use options::{
    Aggregation, EntropyBonus, ImportanceSamplingLevel, KlEstimator, LossOptions, LossType, Reduction,
    RolloutCorrection,
};
pub use owned::{LossInputs, LossKind};
pub use stats::{Argmax, PartialRowStats, RowStats};

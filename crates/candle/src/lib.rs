//! # flashgrpo-candle
//!
//! flashgrpo's kernels inside candle's autograd:
//! - [`loss_from_logits`] and [`loss_from_hidden`] (fused-linear): GRPO, cross-entropy, entropy
//!   and log-probabilities as candle ops; `loss.backward()` gives the gradients of the logits, or
//!   of the hidden states, lm_head weight and bias, with no `[N, V]` tensor on the fused-linear
//!   path;
//! - [`ops`]: RMSNorm, rotary embedding and masked attention softmax with backward (candle's fast
//!   versions of these drop gradients).

pub mod composed;
pub mod loss;
pub mod ops;
mod storage;

pub use loss::{loss_from_hidden, loss_from_logits, LossInputs, LossKind, LossTensors};

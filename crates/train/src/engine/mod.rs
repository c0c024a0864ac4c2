//! The engine: Qwen2's forward and backward written out over f32 buffers, llm.c's way, for the
//! GRPO trainer's hot paths (generation, log-probabilities, the update).
//!
//! Why not candle's autograd: profiled on the built-in GRPO step (2 cores), the `gemm` micro-kernels
//! took 30% of the time and the rest went to what a graph of small tensors costs: strided copies
//! (`contiguous`, `repeat_kv`, the KV cache's `Tensor::cat` every token), elementwise ops that
//! allocate their outputs, `exp` in f64, thread wake-ups. Here every buffer is owned by a
//! [`Workspace`] reused from step to step, grouped-query attention reads the shared key/value
//! heads in place, and a prompt shared by the `G` completions of a group is computed once
//! ([`Packing`]).
//!
//! The candle model ([`crate::model::Qwen2`]) stays the reference: it holds the parameters,
//! loads and saves Hugging Face directories, and is checked against transformers; the engine's
//! hidden states, log-probabilities and every parameter's gradient are checked against it
//! (crates/train/tests/engine.rs).

pub mod attention;
pub mod backward;
pub mod forward;
pub mod head;
pub(crate) mod math;
pub(crate) mod ops;
pub mod packing;
pub mod weights;

/// Runs `f` on one of rayon's worker threads. The engine's work is many short parallel loops (a
/// decode step is a few dozen); called from outside the pool, each one hands its work to the
/// pool and puts the caller to sleep until it is done, which measured up to a sixth of a rollout
/// in scheduler time. From a worker, a loop too small to split runs inline and the others are
/// shared with the other workers directly.
pub fn on_workers<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}

pub use attention::Query;
pub use backward::{backward, BackwardBuffers};
pub use forward::{forward, Input, KvCache, Pass, Workspace};
pub use head::{Head, HeadGradients};
pub use packing::Packing;
pub use weights::{Dims, Weights};

//! A loss as front ends hold it: owned, so it can live across calls (an autograd graph, a
//! training step's micro-batches), and borrowed as a [`LossSpec`] for each kernel call. The
//! candle ops and the trainer hold this description; the CLI and the Python bindings borrow
//! their buffers into a `LossSpec` directly, with the same [`Op`](crate::Op), [`LossOptions`] and
//! [`ChunkBudget`].

use crate::engine::LossSpec;
use crate::inputs::{BatchShard, CrossEntropyInputs, IsRatio, Loss, PolicyInputs, Rows};
use crate::linear::ChunkBudget;
use crate::options::LossOptions;

/// Which loss, with the inputs only GRPO needs (host data: they carry no gradient).
#[derive(Debug, Clone)]
pub enum LossKind {
    Grpo {
        /// `[B]`.
        advantages: Vec<f32>,
        /// `[B*T]`; `None`: on-policy.
        old_logp: Option<Vec<f32>>,
        /// `[B*T]`; required when `beta != 0`.
        ref_logp: Option<Vec<f32>>,
        /// `[B*T]` (or `[B]` with `per_sequence`).
        is_ratio: Option<(Vec<f32>, bool)>,
        /// `[B*T]`: the sampler's own log-probabilities (rollout correction, off-policy mask).
        sampling_logp: Option<Vec<f32>>,
    },
    CrossEntropy {
        /// `[V]`: a weight per class (LOSSES.md, "Class weights").
        class_weights: Option<Vec<f32>>,
    },
    Entropy,
    Logprob,
}

/// Everything a loss needs besides the scores.
#[derive(Debug, Clone)]
pub struct LossInputs {
    pub kind: LossKind,
    pub batch: usize,
    pub seq_len: usize,
    /// `[B*T]`.
    pub targets: Option<Vec<i64>>,
    /// `[B*T]`, 0 / 1.
    pub mask: Option<Vec<f32>>,
    pub options: LossOptions,
    /// Fused-linear memory budget.
    pub budget: ChunkBudget,
    /// The whole batch's normalisers when this call is one micro-batch (or one data-parallel
    /// shard) of it: the micro-batches' losses then sum to the batch's loss.
    pub batch_shard: Option<BatchShard>,
}

impl LossInputs {
    /// An owned copy of a kernels' loss spec.
    pub fn from_spec(spec: &LossSpec<'_>, budget: ChunkBudget) -> Self {
        let kind = match spec.loss {
            Loss::Grpo(p) => LossKind::Grpo {
                advantages: p.advantages.to_vec(),
                old_logp: p.old_logp.map(<[f32]>::to_vec),
                ref_logp: p.ref_logp.map(<[f32]>::to_vec),
                is_ratio: p.is_ratio.map(|r| match r {
                    IsRatio::PerToken(v) => (v.to_vec(), false),
                    IsRatio::PerSequence(v) => (v.to_vec(), true),
                }),
                sampling_logp: p.sampling_logp.map(<[f32]>::to_vec),
            },
            Loss::CrossEntropy(c) => LossKind::CrossEntropy { class_weights: c.class_weights.map(<[f32]>::to_vec) },
            Loss::Entropy => LossKind::Entropy,
            Loss::Logprob => LossKind::Logprob,
        };
        Self {
            kind,
            batch: spec.rows.batch,
            seq_len: spec.rows.seq_len,
            targets: spec.rows.targets.map(<[i64]>::to_vec),
            mask: spec.rows.mask.map(<[f32]>::to_vec),
            options: spec.options.clone(),
            budget,
            batch_shard: spec.batch_shard,
        }
    }

    /// The kernels' description of this loss over a vocabulary of `vocab` columns.
    pub fn spec(&self, vocab: usize) -> LossSpec<'_> {
        let loss = match &self.kind {
            LossKind::Grpo { advantages, old_logp, ref_logp, is_ratio, sampling_logp } => Loss::Grpo(PolicyInputs {
                advantages,
                old_logp: old_logp.as_deref(),
                ref_logp: ref_logp.as_deref(),
                is_ratio: is_ratio.as_ref().map(|(v, per_sequence)| {
                    if *per_sequence {
                        IsRatio::PerSequence(v)
                    } else {
                        IsRatio::PerToken(v)
                    }
                }),
                sampling_logp: sampling_logp.as_deref(),
            }),
            LossKind::CrossEntropy { class_weights } => {
                Loss::CrossEntropy(CrossEntropyInputs { class_weights: class_weights.as_deref() })
            }
            LossKind::Entropy => Loss::Entropy,
            LossKind::Logprob => Loss::Logprob,
        };
        LossSpec {
            loss,
            rows: Rows {
                batch: self.batch,
                seq_len: self.seq_len,
                vocab,
                targets: self.targets.as_deref(),
                mask: self.mask.as_deref(),
            },
            options: &self.options,
            batch_shard: self.batch_shard,
        }
    }

    /// Whether the op has a gradient output ([`Op::has_gradient`](crate::Op::has_gradient)).
    pub fn has_gradient(&self) -> bool {
        self.spec(0).loss.has_gradient(&self.options)
    }
}

//! Vocabulary-parallel losses (Megatron-style): each rank holds a contiguous slice of the
//! vocabulary (its logits columns, or its rows of the lm_head), streams its slice for the rows'
//! partial statistics, and the ranks exchange them: **one all-gather of 7 f32 per row per rank**
//! (max, `sum exp`, `sum exp * shifted`, `sum u`, the target's f64 `u` as two f32 and whether
//! this slice holds it: 28 bytes per row from each rank). Every rank then combines the same statistics in the
//! same order ([`combine_shards`]), so every rank computes the same objective (sequence-level
//! GRPO included: it needs only the rows' statistics) and writes the gradient of its own slice.
//! The fused-linear form streams its rows of the lm_head with the kernels' sharded fused-linear
//! loss (no logits tensor) and adds one all-reduce (sum) of `grad_hidden`, `N x H` f32.
//!
//! One all-gather rather than Megatron's two all-reduces (max, then the rescaled sums): the same
//! bytes for two ranks, one latency instead of two, and every rank's combine is the tested
//! single-process [`combine_shards`], so K ranks give the statistics of K shards in one process
//! bit for bit.

use std::ops::Range;

use flashgrpo_collective::{share, Collective, ReduceOp};
use flashgrpo_kernels::{
    combine_shards, ChunkBudget, Element, GradientTarget, LinearGradients, LinearInputs, LossError, LossOutput,
    LossSpec, PartialRowStats, PreparedLinearLoss, PreparedLoss,
};

use crate::error::Result;

/// Floats per row in the exchange.
const STAT_FLOATS: usize = 7;

/// This rank's columns of a `vocab`-column vocabulary.
pub fn columns(comm: &dyn Collective, vocab: usize) -> Range<usize> {
    share(vocab, comm.size(), comm.rank())
}

fn encode(stats: &[PartialRowStats]) -> Vec<f32> {
    stats
        .iter()
        .flat_map(|s| {
            // The f64 target `u` (an exact product of two f32) as a sum of two f32, exactly.
            let (high, low, has) = s.target_u.map_or((0.0, 0.0, 0.0), |t| {
                let high = t as f32;
                (high, (t - high as f64) as f32, 1.0)
            });
            [s.max, s.sum_exp, s.sum_exp_shifted, s.sum_u, high, low, has]
        })
        .collect()
}

fn decode(values: &[f32]) -> Vec<PartialRowStats> {
    values
        .chunks(STAT_FLOATS)
        .map(|v| PartialRowStats {
            max: v[0],
            sum_exp: v[1],
            sum_exp_shifted: v[2],
            sum_u: v[3],
            target_u: (v[6] != 0.0).then_some(v[4] as f64 + v[5] as f64),
            argmax: None, // the trainer asks for no predicted tokens
        })
        .collect()
}

/// The whole vocabulary's row statistics from each rank's partial ones (one all-gather).
pub fn combined_statistics(
    comm: &dyn Collective,
    local: &[PartialRowStats],
    vocab: usize,
) -> Result<Vec<PartialRowStats>> {
    let mine = encode(local);
    let mut all = vec![0.0f32; mine.len() * comm.size()];
    comm.all_gather_f32(&mine, &mut all)?;
    let n = mine.len();
    let shards: Vec<(Range<usize>, Vec<PartialRowStats>)> =
        (0..comm.size()).map(|r| (share(vocab, comm.size(), r), decode(&all[r * n..(r + 1) * n]))).collect();
    Ok(combine_shards(vocab, &shards)?)
}

/// The exchange carries no argmax: predicted tokens are refused rather than left out.
fn refuse_predicted_tokens(spec: &LossSpec<'_>) -> Result<()> {
    if spec.options.predicted_tokens {
        return Err(LossError::InvalidOption {
            name: "predicted_tokens",
            message: "vocabulary-parallel losses do not report predicted tokens yet; run without --vocab-parallel"
                .into(),
        }
        .into());
    }
    Ok(())
}

/// The loss over logits split by columns: `logits` is this rank's `[N, columns.len()]` slice;
/// with `grad`, its gradient (same shape) is written there. Every rank returns the same output.
pub fn logits_loss<T: Element>(
    comm: &dyn Collective,
    spec: LossSpec<'_>,
    logits: &[T],
    grad: Option<&mut [T]>,
) -> Result<LossOutput> {
    refuse_predicted_tokens(&spec)?;
    let vocab = spec.rows.vocab;
    let cols = columns(comm, vocab);
    let prepared = PreparedLoss::new(spec)?;
    let stats = combined_statistics(comm, &prepared.statistics(logits, cols.clone())?, vocab)?;
    let (output, row_grads) = prepared.objective(&stats)?;
    if let Some(out) = grad {
        prepared.gradient(GradientTarget::Into { logits, out }, cols, &row_grads)?;
    }
    Ok(output)
}

/// This rank's part of a fused-linear loss: its rows of the lm_head (and bias).
pub struct LinearShard<'a, T> {
    /// `[N, H]`, every rank the same.
    pub hidden: &'a [T],
    /// `[columns.len(), H]`: this rank's rows of the lm_head.
    pub weight: &'a [T],
    /// `[columns.len()]`.
    pub bias: Option<&'a [T]>,
    pub hidden_size: usize,
}

impl<'a, T> LinearShard<'a, T> {
    fn inputs(&self) -> LinearInputs<'a, T> {
        LinearInputs { hidden: self.hidden, weight: self.weight, bias: self.bias, hidden_size: self.hidden_size }
    }
}

/// Gradients of a fused-linear shard, f32: `hidden` (overwritten, then summed over the ranks)
/// and this rank's rows of the weight and bias (overwritten, or added to with `accumulate`).
pub struct LinearShardGrads<'a> {
    pub hidden: &'a mut [f32],
    pub weight: Option<&'a mut [f32]>,
    pub bias: Option<&'a mut [f32]>,
    pub accumulate: bool,
}

/// The fused-linear loss with the lm_head split by rows: the kernels' sharded fused-linear
/// ([`PreparedLinearLoss`]) streams this rank's rows twice, for the statistics and, once the
/// objective is known, for the gradients (recomputing the logits: no `[N, V/K]` tensor), and one
/// all-reduce sums the ranks' parts of `grad_hidden`.
pub fn linear_loss<T: Element>(
    comm: &dyn Collective,
    spec: LossSpec<'_>,
    shard: LinearShard<'_, T>,
    grads: Option<LinearShardGrads<'_>>,
    budget: ChunkBudget,
) -> Result<LossOutput> {
    refuse_predicted_tokens(&spec)?;
    let vocab = spec.rows.vocab;
    let cols = columns(comm, vocab);
    let prepared = PreparedLinearLoss::new(spec, budget)?;
    let local = if cols.is_empty() {
        vec![PartialRowStats::EMPTY; spec.rows.len()]
    } else {
        prepared.statistics(shard.inputs(), cols.clone())?
    };
    let stats = combined_statistics(comm, &local, vocab)?;
    let (output, row_grads) = prepared.objective(&stats)?;
    let Some(mut g) = grads else { return Ok(output) };
    if cols.is_empty() {
        g.hidden.fill(0.0);
    } else {
        let target = LinearGradients {
            hidden: &mut *g.hidden,
            weight: g.weight.as_deref_mut(),
            bias: g.bias.as_deref_mut(),
            accumulate: g.accumulate,
        };
        prepared.gradient(shard.inputs(), cols, &row_grads, target)?;
    }
    comm.all_reduce_f32(g.hidden, ReduceOp::Sum)?;
    Ok(output)
}

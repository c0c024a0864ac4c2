//! Vocabulary-parallel losses (Megatron-style): each rank holds a contiguous slice of the
//! vocabulary (its logits columns, or its rows of the lm_head), streams its slice for the rows'
//! partial statistics, and the ranks exchange them: **one all-gather of 7 f32 per row per rank**
//! (max, `sum exp`, `sum exp * shifted`, `sum u`, the target's f64 `u` as two f32 and whether
//! this slice holds it: 28 bytes per row from each rank; with predicted tokens, 4 f32 more: the
//! slice's argmax value, its column as two exact 16-bit halves, and whether the slice has one).
//! Every rank then combines the same statistics in the
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
    combine_shards, Argmax, ChunkBudget, Element, GradientTarget, LinearGradients, LinearInputs, LossOutput, LossSpec,
    PartialRowStats, PreparedLinearLoss, PreparedLoss,
};

use crate::error::Result;

/// Floats per row in the exchange.
const STAT_FLOATS: usize = 7;
/// Floats per row the argmax adds (predicted tokens).
const ARGMAX_FLOATS: usize = 4;
/// A column travels as two 16-bit halves, each exact in an f32.
const HALF: usize = 1 << 16;

/// This rank's columns of a `vocab`-column vocabulary.
pub fn columns(comm: &dyn Collective, vocab: usize) -> Range<usize> {
    share(vocab, comm.size(), comm.rank())
}

/// Each row's statistics as the exchange's floats; with `argmax`, the row part's argmax too.
fn encode(stats: &[PartialRowStats], argmax: bool) -> Vec<f32> {
    let mut values = Vec::with_capacity(stats.len() * (STAT_FLOATS + if argmax { ARGMAX_FLOATS } else { 0 }));
    for s in stats {
        // The f64 target `u` (an exact product of two f32) as a sum of two f32, exactly.
        let (high, low, has) = s.target_u.map_or((0.0, 0.0, 0.0), |t| {
            let high = t as f32;
            (high, (t - high as f64) as f32, 1.0)
        });
        values.extend([s.max, s.sum_exp, s.sum_exp_shifted, s.sum_u, high, low, has]);
        if argmax {
            values.extend(
                s.argmax.map_or([0.0; ARGMAX_FLOATS], |a| {
                    [a.value, (a.column / HALF) as f32, (a.column % HALF) as f32, 1.0]
                }),
            );
        }
    }
    values
}

/// [`encode`]'s inverse.
fn decode(values: &[f32], argmax: bool) -> Vec<PartialRowStats> {
    let width = STAT_FLOATS + if argmax { ARGMAX_FLOATS } else { 0 };
    values
        .chunks(width)
        .map(|v| PartialRowStats {
            max: v[0],
            sum_exp: v[1],
            sum_exp_shifted: v[2],
            sum_u: v[3],
            target_u: (v[6] != 0.0).then_some(v[4] as f64 + v[5] as f64),
            argmax: (argmax && v[10] != 0.0)
                .then(|| Argmax { value: v[7], column: v[8] as usize * HALF + v[9] as usize }),
        })
        .collect()
}

/// The whole vocabulary's row statistics from each rank's partial ones (one all-gather), with
/// each row's argmax where `argmax` (every rank must pass the same: it sets the exchange's width).
pub fn combined_statistics(
    comm: &dyn Collective,
    local: &[PartialRowStats],
    vocab: usize,
    argmax: bool,
) -> Result<Vec<PartialRowStats>> {
    let mine = encode(local, argmax);
    let mut all = vec![0.0f32; mine.len() * comm.size()];
    comm.all_gather_f32(&mine, &mut all)?;
    let n = mine.len();
    let shards: Vec<(Range<usize>, Vec<PartialRowStats>)> =
        (0..comm.size()).map(|r| (share(vocab, comm.size(), r), decode(&all[r * n..(r + 1) * n], argmax))).collect();
    Ok(combine_shards(vocab, &shards)?)
}

/// The loss over logits split by columns: `logits` is this rank's `[N, columns.len()]` slice;
/// with `grad`, its gradient (same shape) is written there. Every rank returns the same output.
pub fn logits_loss<T: Element>(
    comm: &dyn Collective,
    spec: LossSpec<'_>,
    logits: &[T],
    grad: Option<&mut [T]>,
) -> Result<LossOutput> {
    let vocab = spec.rows.vocab;
    let cols = columns(comm, vocab);
    let prepared = PreparedLoss::new(spec)?;
    let local = prepared.statistics(logits, cols.clone())?;
    let stats = combined_statistics(comm, &local, vocab, spec.options.predicted_tokens)?;
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
    let vocab = spec.rows.vocab;
    let cols = columns(comm, vocab);
    let prepared = PreparedLinearLoss::new(spec, budget)?;
    let local = if cols.is_empty() {
        vec![PartialRowStats::EMPTY; spec.rows.len()]
    } else {
        prepared.statistics(shard.inputs(), cols.clone())?
    };
    let stats = combined_statistics(comm, &local, vocab, spec.options.predicted_tokens)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The exchange's floats give back every statistic, the target's f64 `u` and the argmax's
    /// column exactly (columns past 2^16 and past f32's 2^24 integers included).
    #[test]
    fn the_exchange_round_trips_exactly() {
        let columns = [0usize, 1, 65_535, 65_536, 151_935, (1 << 24) + 5, (1 << 31) + 3];
        let stats: Vec<PartialRowStats> = columns
            .iter()
            .enumerate()
            .map(|(i, &column)| PartialRowStats {
                max: 1.5 + i as f32,
                sum_exp: 0.25 * i as f32,
                sum_exp_shifted: -3.0,
                sum_u: 7.0,
                target_u: (i % 2 == 0).then_some(1.0 / 3.0 * i as f64),
                argmax: (i != 3).then_some(Argmax { value: -0.5 * i as f32, column }),
            })
            .collect();
        for argmax in [false, true] {
            let back = decode(&encode(&stats, argmax), argmax);
            for (s, b) in stats.iter().zip(&back) {
                let want = PartialRowStats {
                    target_u: s.target_u.map(|t| t as f32 as f64 + (t - t as f32 as f64) as f32 as f64),
                    argmax: if argmax { s.argmax } else { None },
                    ..*s
                };
                assert_eq!(*b, want);
            }
        }
    }
}

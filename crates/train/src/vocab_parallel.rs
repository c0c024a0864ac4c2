//! Vocabulary-parallel losses (Megatron-style): each rank holds a contiguous slice of the
//! vocabulary (its logits columns, or its rows of the lm_head), streams its slice for the rows'
//! partial statistics, and the ranks exchange them: **one all-gather of 6 f32 per row per rank**
//! (max, `sum exp`, `sum exp * shifted`, `sum u`, the target's `u` and whether this slice holds
//! it: 24 bytes per row from each rank). Every rank then combines the same statistics in the
//! same order ([`combine_shards`]), so every rank computes the same objective (sequence-level
//! GRPO included: it needs only the rows' statistics) and writes the gradient of its own slice.
//! The fused-linear form adds one all-reduce (sum) of `grad_hidden`, `N x H` f32.
//!
//! One all-gather rather than Megatron's two all-reduces (max, then the rescaled sums): the same
//! bytes for two ranks, one latency instead of two, and every rank's combine is the tested
//! single-process [`combine_shards`], so K ranks give the statistics of K shards in one process
//! bit for bit.

use std::ops::Range;

use flashgrpo_collective::{share, Collective, ReduceOp};
use flashgrpo_kernels::matmul::{matmul_nn, matmul_nt, matmul_tn, Mat, MatMut};
use flashgrpo_kernels::{combine_shards, Element, GradientTarget, LossOutput, LossSpec, PartialRowStats, PreparedLoss};

use crate::error::Result;

/// Floats per row in the exchange.
const STAT_FLOATS: usize = 6;

/// This rank's columns of a `vocab`-column vocabulary.
pub fn columns(comm: &dyn Collective, vocab: usize) -> Range<usize> {
    share(vocab, comm.size(), comm.rank())
}

fn encode(stats: &[PartialRowStats]) -> Vec<f32> {
    stats
        .iter()
        .flat_map(|s| {
            let (t, has) = s.target_u.map_or((0.0, 0.0), |t| (t, 1.0));
            [s.max, s.sum_exp, s.sum_exp_shifted, s.sum_u, t, has]
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
            target_u: (v[5] != 0.0).then_some(v[4]),
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
    let shards: Vec<(Range<usize>, Vec<PartialRowStats>)> = all
        .chunks(mine.len().max(1))
        .take(comm.size())
        .enumerate()
        .map(|(r, v)| (share(vocab, comm.size(), r), decode(if mine.is_empty() { &[] } else { v })))
        .collect();
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
    let stats = combined_statistics(comm, &prepared.statistics(logits, cols.clone())?, vocab)?;
    let (output, row_grads) = prepared.objective(&stats)?;
    if let Some(out) = grad {
        prepared.gradient(GradientTarget::Into { logits, out }, cols, &row_grads)?;
    }
    Ok(output)
}

/// This rank's part of a fused-linear loss: its rows of the lm_head (and bias), f32.
pub struct LinearShard<'a> {
    /// `[N, H]`, every rank the same.
    pub hidden: &'a [f32],
    /// `[columns.len(), H]`: this rank's rows of the lm_head.
    pub weight: &'a [f32],
    /// `[columns.len()]`.
    pub bias: Option<&'a [f32]>,
    pub hidden_size: usize,
}

/// Gradients of a fused-linear shard: `hidden` (summed over the ranks) and this rank's rows of
/// the weight and bias.
pub struct LinearShardGrads<'a> {
    pub hidden: &'a mut [f32],
    pub weight: &'a mut [f32],
    pub bias: Option<&'a mut [f32]>,
}

/// The fused-linear loss with the lm_head split by rows. This rank's logits slice `[N, V/K]`
/// is formed, streamed for statistics and for its gradient, then turned into `grad_weight`'s
/// rows (`dz^T h`) and a part of `grad_hidden` (`dz W`) that one all-reduce sums.
pub fn linear_loss(
    comm: &dyn Collective,
    spec: LossSpec<'_>,
    shard: LinearShard<'_>,
    grads: Option<LinearShardGrads<'_>>,
) -> Result<LossOutput> {
    let (n, h) = (spec.rows.len(), shard.hidden_size);
    let v = columns(comm, spec.rows.vocab).len();
    let mut logits = vec![0.0f32; n * v];
    if let Some(b) = shard.bias {
        logits.chunks_mut(v.max(1)).for_each(|row| row.copy_from_slice(b));
    }
    if v > 0 {
        let mut z = MatMut::new(&mut logits, n, v);
        matmul_nt(&mut z, shard.bias.is_some(), Mat::new(shard.hidden, n, h), Mat::new(shard.weight, v, h));
    }
    let Some(g) = grads else {
        return logits_loss(comm, spec, &logits, None);
    };
    let mut dz = vec![0.0f32; n * v];
    let output = logits_loss(comm, spec, &logits, Some(&mut dz))?;
    drop(logits);
    g.hidden.fill(0.0);
    if v > 0 {
        matmul_nn(&mut MatMut::new(g.hidden, n, h), false, Mat::new(&dz, n, v), Mat::new(shard.weight, v, h));
        matmul_tn(&mut MatMut::new(g.weight, v, h), false, Mat::new(&dz, n, v), Mat::new(shard.hidden, n, h));
    }
    if let Some(gb) = g.bias {
        gb.fill(0.0);
        for row in dz.chunks(v.max(1)) {
            gb.iter_mut().zip(row).for_each(|(b, d)| *b += d);
        }
    }
    comm.all_reduce_f32(g.hidden, ReduceOp::Sum)?;
    Ok(output)
}

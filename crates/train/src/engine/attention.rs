//! Causal grouped-query attention over slots of keys and values, forward and backward.
//!
//! A query attends to the keys of a [`Query`]: a parent range (the prompt its sequence continues,
//! stored once however many completions share it) and then its own sequence's slots up to and
//! including its own. Grouped-query heads read their shared key/value head in place (no
//! `repeat_kv` copy), and the keys are visited in the same order in generation and in training,
//! so a token's attention is computed the same way in both. Forward: softmax with its
//! log-sum-exp kept per (query, head); backward recomputes the probabilities from it (flash
//! attention's way) instead of storing them.

use std::ops::Range;

use rayon::prelude::*;

use super::weights::Dims;

/// The keys of one query: every slot of `parent`, then `own` (ending at the query's own slot).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    pub parent: Range<usize>,
    pub own: Range<usize>,
}

impl Query {
    fn keys(&self) -> impl Iterator<Item = usize> + '_ {
        self.parent.clone().chain(self.own.clone())
    }

    fn len(&self) -> usize {
        self.parent.len() + self.own.len()
    }
}

/// `a . b` with eight partial sums in a fixed order (vectorisable, deterministic).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8.remainder().iter().zip(b8.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in a8.zip(b8) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `y += a x`.
#[inline]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, &x)| *y += a * x);
}

/// Attention of the queries `q [n, heads * head_dim]` over the slots of `k`, `v`
/// `[slots, kv_heads * head_dim]`: `out [n, heads * head_dim]` and `lse [n, heads]`.
pub fn forward(out: &mut [f32], lse: &mut [f32], q: &[f32], k: &[f32], v: &[f32], queries: &[Query], d: &Dims) {
    let (hd, qd, kvd, group) = (d.head_dim, d.q_dim(), d.kv_dim(), d.group());
    let scale = 1.0 / (hd as f32).sqrt();
    out.par_chunks_mut(qd).zip(lse.par_chunks_mut(d.heads)).zip(q.par_chunks(qd)).zip(queries).for_each_init(
        Vec::new,
        |scores, (((out, lse), q), query)| {
            scores.resize(query.len(), 0.0);
            for h in 0..d.heads {
                let g = (h / group) * hd;
                let qh = &q[h * hd..(h + 1) * hd];
                let mut max = f32::NEG_INFINITY;
                for (s, j) in scores.iter_mut().zip(query.keys()) {
                    *s = scale * dot(qh, &k[j * kvd + g..j * kvd + g + hd]);
                    max = max.max(*s);
                }
                let oh = &mut out[h * hd..(h + 1) * hd];
                oh.fill(0.0);
                let mut sum = 0.0f32;
                for (s, j) in scores.iter().zip(query.keys()) {
                    let p = (s - max).exp();
                    sum += p;
                    axpy(oh, p, &v[j * kvd + g..j * kvd + g + hd]);
                }
                oh.iter_mut().for_each(|o| *o /= sum);
                lse[h] = max + sum.ln();
            }
        },
    );
}

/// One (block, key/value head)'s gradients, local to the block's slots.
struct UnitGrads {
    block: usize,
    kv_head: usize,
    /// `[len, group * head_dim]`.
    dq: Vec<f32>,
    /// `[len, head_dim]` each.
    dk: Vec<f32>,
    dv: Vec<f32>,
}

/// The gradients of [`forward`] from `d_out`, for training, where query `i` sits at slot `i`:
/// `dq`, `dk`, `dv` are overwritten. `blocks` are contiguous ranges of slots closed under the
/// queries' keys (a prompt and the completions that continue it): each (block, key/value head)
/// is one task that accumulates its keys' gradients in a fixed order, so the result does not
/// depend on the thread count.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    d_out: &[f32],
    out: &[f32],
    lse: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    queries: &[Query],
    blocks: &[Range<usize>],
    d: &Dims,
) {
    let (hd, qd, kvd, group) = (d.head_dim, d.q_dim(), d.kv_dim(), d.group());
    let scale = 1.0 / (hd as f32).sqrt();
    // D = dO . O per (query, head).
    let mut delta = vec![0.0f32; queries.len() * d.heads];
    delta.par_chunks_mut(d.heads).zip(d_out.par_chunks(qd)).zip(out.par_chunks(qd)).for_each(|((dl, go), o)| {
        for (h, dl) in dl.iter_mut().enumerate() {
            *dl = dot(&go[h * hd..(h + 1) * hd], &o[h * hd..(h + 1) * hd]);
        }
    });
    let units: Vec<(usize, usize)> = (0..blocks.len()).flat_map(|b| (0..d.kv_heads).map(move |g| (b, g))).collect();
    let grads: Vec<UnitGrads> = units
        .par_iter()
        .map(|&(b, kv_head)| {
            let block = &blocks[b];
            let len = block.len();
            let mut u = UnitGrads {
                block: b,
                kv_head,
                dq: vec![0.0; len * group * hd],
                dk: vec![0.0; len * hd],
                dv: vec![0.0; len * hd],
            };
            let g = kv_head * hd;
            for i in block.clone() {
                let query = &queries[i];
                debug_assert!(query.keys().all(|j| block.contains(&j)), "query {i} reads outside its block");
                for hg in 0..group {
                    let h = kv_head * group + hg;
                    let (qh, go) =
                        (&q[i * qd + h * hd..i * qd + (h + 1) * hd], &d_out[i * qd + h * hd..i * qd + (h + 1) * hd]);
                    let (l, dl) = (lse[i * d.heads + h], delta[i * d.heads + h]);
                    let local_dq = (i - block.start) * group * hd + hg * hd;
                    for j in query.keys() {
                        let kj = &k[j * kvd + g..j * kvd + g + hd];
                        let p = (scale * dot(qh, kj) - l).exp();
                        let ds = p * (dot(go, &v[j * kvd + g..j * kvd + g + hd]) - dl);
                        axpy(&mut u.dq[local_dq..local_dq + hd], scale * ds, kj);
                        let jl = (j - block.start) * hd;
                        axpy(&mut u.dk[jl..jl + hd], scale * ds, qh);
                        axpy(&mut u.dv[jl..jl + hd], p, go);
                    }
                }
            }
            u
        })
        .collect();
    for u in grads {
        let block = &blocks[u.block];
        let g = u.kv_head * hd;
        for (local, i) in block.clone().enumerate() {
            let heads = u.kv_head * group * hd..(u.kv_head + 1) * group * hd;
            dq[i * qd + heads.start..i * qd + heads.end]
                .copy_from_slice(&u.dq[local * group * hd..(local + 1) * group * hd]);
            dk[i * kvd + g..i * kvd + g + hd].copy_from_slice(&u.dk[local * hd..(local + 1) * hd]);
            dv[i * kvd + g..i * kvd + g + hd].copy_from_slice(&u.dv[local * hd..(local + 1) * hd]);
        }
    }
}

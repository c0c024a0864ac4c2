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

use super::math::{avx2_or_baseline, axpy, dot, fast_exp, sum};
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

/// The most query heads per key/value head (Qwen2.5-0.5B has 7, the larger Qwen2.5 models 7 or 8).
pub const MAX_GROUP: usize = 16;

/// Attention of the queries `q [n, heads * head_dim]` over the slots of `k`, `v`
/// `[slots, kv_heads * head_dim]`: `out [n, heads * head_dim]` and `lse [n, heads]`.
pub fn forward(out: &mut [f32], lse: &mut [f32], q: &[f32], k: &[f32], v: &[f32], queries: &[Query], d: &Dims) {
    let qd = d.q_dim();
    out.par_chunks_mut(qd)
        .zip(lse.par_chunks_mut(d.heads))
        .zip(q.par_chunks(qd))
        .zip(queries)
        .for_each_init(Vec::new, |scores, (((out, lse), q), query)| attend(out, lse, q, k, v, query, scores, d));
}

avx2_or_baseline!(
    /// One query's attention, every head.
    #[allow(clippy::too_many_arguments)]
    fn attend(out: &mut [f32], lse: &mut [f32], q: &[f32], k: &[f32], v: &[f32], query: &Query, scores: &mut Vec<f32>, d: &Dims)
        => attend_body
);

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_body(
    out: &mut [f32],
    lse: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    query: &Query,
    scores: &mut Vec<f32>,
    d: &Dims,
) {
    let (hd, kvd, group) = (d.head_dim, d.kv_dim(), d.group());
    let scale = 1.0 / (hd as f32).sqrt();
    let keys = query.len();
    scores.resize(group * keys, 0.0);
    for kv_head in 0..d.kv_heads {
        // The group's heads read each key and value once.
        let g = kv_head * hd;
        let heads = kv_head * group..(kv_head + 1) * group;
        for (jj, j) in query.keys().enumerate() {
            let kj = &k[j * kvd + g..j * kvd + g + hd];
            for (hg, h) in heads.clone().enumerate() {
                scores[hg * keys + jj] = scale * dot(&q[h * hd..(h + 1) * hd], kj);
            }
        }
        let mut sums = [0.0f32; MAX_GROUP];
        for (hg, h) in heads.clone().enumerate() {
            let row = &mut scores[hg * keys..(hg + 1) * keys];
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            row.iter_mut().for_each(|s| *s = fast_exp(*s - max));
            sums[hg] = sum(row);
            lse[h] = max + sums[hg].ln();
        }
        let outs = &mut out[heads.start * hd..heads.end * hd];
        outs.fill(0.0);
        for (jj, j) in query.keys().enumerate() {
            let vj = &v[j * kvd + g..j * kvd + g + hd];
            for (hg, oh) in outs.chunks_exact_mut(hd).enumerate() {
                axpy(oh, scores[hg * keys + jj], vj);
            }
        }
        for (oh, s) in outs.chunks_exact_mut(hd).zip(sums) {
            let inv = 1.0 / s;
            oh.iter_mut().for_each(|o| *o *= inv);
        }
    }
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

/// What the backward reads: the forward's inputs and outputs, and `delta = dO . O`.
struct Saved<'a> {
    d_out: &'a [f32],
    lse: &'a [f32],
    delta: &'a [f32],
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    queries: &'a [Query],
}

avx2_or_baseline!(
    /// One (block, key/value head)'s gradients, its queries in order.
    fn unit_backward(u: &mut UnitGrads, block: &Range<usize>, s: &Saved<'_>, d: &Dims, p: &mut Vec<f32>) => unit_backward_body
);

#[inline(always)]
fn unit_backward_body(u: &mut UnitGrads, block: &Range<usize>, s: &Saved<'_>, d: &Dims, p: &mut Vec<f32>) {
    let (hd, qd, kvd, group) = (d.head_dim, d.q_dim(), d.kv_dim(), d.group());
    let scale = 1.0 / (hd as f32).sqrt();
    let g = u.kv_head * hd;
    let heads = u.kv_head * group..(u.kv_head + 1) * group;
    for i in block.clone() {
        let query = &s.queries[i];
        debug_assert!(query.keys().all(|j| block.contains(&j)), "query {i} reads outside its block");
        let keys = query.len();
        p.resize(group * keys, 0.0);
        // The probabilities, recomputed from the scores and the forward's log-sum-exp.
        for (jj, j) in query.keys().enumerate() {
            let kj = &s.k[j * kvd + g..j * kvd + g + hd];
            for (hg, h) in heads.clone().enumerate() {
                p[hg * keys + jj] = scale * dot(&s.q[i * qd + h * hd..i * qd + (h + 1) * hd], kj);
            }
        }
        for (hg, h) in heads.clone().enumerate() {
            let l = s.lse[i * d.heads + h];
            p[hg * keys..(hg + 1) * keys].iter_mut().for_each(|x| *x = fast_exp(*x - l));
        }
        let local_dq = (i - block.start) * group * hd;
        for (jj, j) in query.keys().enumerate() {
            let (kj, vj) = (&s.k[j * kvd + g..j * kvd + g + hd], &s.v[j * kvd + g..j * kvd + g + hd]);
            let jl = (j - block.start) * hd;
            for (hg, h) in heads.clone().enumerate() {
                let qh = &s.q[i * qd + h * hd..i * qd + (h + 1) * hd];
                let go = &s.d_out[i * qd + h * hd..i * qd + (h + 1) * hd];
                let pj = p[hg * keys + jj];
                let ds = pj * (dot(go, vj) - s.delta[i * d.heads + h]);
                axpy(&mut u.dq[local_dq + hg * hd..local_dq + (hg + 1) * hd], scale * ds, kj);
                axpy(&mut u.dk[jl..jl + hd], scale * ds, qh);
                axpy(&mut u.dv[jl..jl + hd], pj, go);
            }
        }
    }
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
    // D = dO . O per (query, head).
    let mut delta = vec![0.0f32; queries.len() * d.heads];
    delta.par_chunks_mut(d.heads).zip(d_out.par_chunks(qd)).zip(out.par_chunks(qd)).for_each(|((dl, go), o)| {
        for (h, dl) in dl.iter_mut().enumerate() {
            *dl = dot(&go[h * hd..(h + 1) * hd], &o[h * hd..(h + 1) * hd]);
        }
    });
    let units: Vec<(usize, usize)> = (0..blocks.len()).flat_map(|b| (0..d.kv_heads).map(move |g| (b, g))).collect();
    let saved = Saved { d_out, lse, delta: &delta, q, k, v, queries };
    let grads: Vec<UnitGrads> = units
        .par_iter()
        .map(|&(b, kv_head)| {
            let len = blocks[b].len();
            let mut u = UnitGrads {
                block: b,
                kv_head,
                dq: vec![0.0; len * group * hd],
                dk: vec![0.0; len * hd],
                dv: vec![0.0; len * hd],
            };
            unit_backward(&mut u, &blocks[b], &saved, d, &mut Vec::new());
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

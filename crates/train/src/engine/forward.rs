//! The model's forward over slots: embedding, the decoder layers, the final norm. Three kinds of
//! pass share one layer function:
//! - [`Pass::Train`] keeps every layer's activations for [`super::backward`](fn@super::backward);
//! - [`Pass::Score`] keeps none (one layer's buffers are reused): log-probabilities, prefill
//!   without a cache;
//! - [`Pass::Cached`] also writes each slot's keys and values into a [`KvCache`] and attends over
//!   the cache: prefill and decode in generation.

use super::attention::{self, Query};
use super::ops;
use super::weights::{Dims, Weights};
use crate::error::{Result, TrainError};

/// The keys and values of every slot of a generation, per layer, preallocated once and written
/// in place (`[slots, kv_heads * head_dim]` each).
#[derive(Debug, Default)]
pub struct KvCache {
    layers: Vec<(Vec<f32>, Vec<f32>)>,
}

impl KvCache {
    /// Room for `slots` slots (reusing the allocation when it suffices).
    pub fn reserve(&mut self, d: &Dims, slots: usize) {
        self.layers.resize_with(d.layers, Default::default);
        for (k, v) in &mut self.layers {
            k.resize(slots * d.kv_dim(), 0.0);
            v.resize(slots * d.kv_dim(), 0.0);
        }
    }
}

/// What a forward keeps and where its keys and values go.
pub enum Pass<'a> {
    /// Keep every layer's activations (for the backward).
    Train,
    /// Keep nothing but the final hidden states.
    Score,
    /// As `Score`, with row `i`'s keys and values written to `slots[i]` of the cache, and the
    /// queries' key slots referring to the cache.
    Cached { cache: &'a mut KvCache, slots: &'a [usize] },
}

/// The rows of a forward: one token each, its position and its query's keys.
#[derive(Clone, Copy)]
pub struct Input<'a> {
    pub tokens: &'a [u32],
    pub positions: &'a [u32],
    pub queries: &'a [Query],
}

/// One layer's activations over `n` rows (what its backward reads).
#[derive(Debug, Default)]
pub struct LayerActs {
    pub h1: Vec<f32>,
    pub rstd1: Vec<f32>,
    /// After the rotary embedding.
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub att: Vec<f32>,
    pub lse: Vec<f32>,
    pub x_mid: Vec<f32>,
    pub h2: Vec<f32>,
    pub rstd2: Vec<f32>,
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub act: Vec<f32>,
}

impl LayerActs {
    fn resize(&mut self, n: usize, d: &Dims) {
        let (h, qd, kvd, i) = (d.hidden, d.q_dim(), d.kv_dim(), d.intermediate);
        for (buf, width) in [
            (&mut self.h1, h),
            (&mut self.rstd1, 1),
            (&mut self.q, qd),
            (&mut self.k, kvd),
            (&mut self.v, kvd),
            (&mut self.att, qd),
            (&mut self.lse, d.heads),
            (&mut self.x_mid, h),
            (&mut self.h2, h),
            (&mut self.rstd2, 1),
            (&mut self.gate, i),
            (&mut self.up, i),
            (&mut self.act, i),
        ] {
            buf.resize(n * width, 0.0);
        }
    }
}

/// Buffers reused from one forward (and backward) to the next: a training step allocates them
/// once, not per operation.
#[derive(Debug, Default)]
pub struct Workspace {
    /// Per layer (`Train`), or one reused by every layer.
    pub(crate) layers: Vec<LayerActs>,
    /// The residual stream: layer `l`'s input is `residual[l]` (`Train`: `L + 1` buffers; otherwise
    /// two, alternating); the last one is the final norm's input.
    pub(crate) residual: Vec<Vec<f32>>,
    pub(crate) rstd_final: Vec<f32>,
    /// The final hidden states `[rows, H]` (after the final norm).
    pub hidden: Vec<f32>,
    /// Which residual buffer the final norm read.
    pub(crate) last: usize,
    pub(crate) rows: usize,
}

/// Decoder layer `l`: `next = x + attention(norm(x)) + mlp(norm(...))`, its activations in `a`.
fn layer(
    weights: &Weights<'_>,
    l: usize,
    x: &[f32],
    next: &mut [f32],
    a: &mut LayerActs,
    input: Input<'_>,
    store: Option<(&mut [f32], &mut [f32], &[usize])>,
) {
    let (w, d, rope) = (&weights.layers[l], &weights.dims, weights.rope);
    let (h, qd, kvd) = (d.hidden, d.q_dim(), d.kv_dim());
    a.resize(input.tokens.len(), d);
    ops::rms_norm(&mut a.h1, &mut a.rstd1, x, &w.input_norm, d.eps);
    ops::linear(&mut a.q, &a.h1, w.q.weight(), Some(&w.q_bias), h);
    ops::linear(&mut a.k, &a.h1, w.k.weight(), Some(&w.k_bias), h);
    ops::linear(&mut a.v, &a.h1, w.v.weight(), Some(&w.v_bias), h);
    ops::rope(&mut a.q, input.positions, d.head_dim, rope, false);
    ops::rope(&mut a.k, input.positions, d.head_dim, rope, false);
    match store {
        Some((k, v, slots)) => {
            for (r, &s) in slots.iter().enumerate() {
                k[s * kvd..(s + 1) * kvd].copy_from_slice(&a.k[r * kvd..(r + 1) * kvd]);
                v[s * kvd..(s + 1) * kvd].copy_from_slice(&a.v[r * kvd..(r + 1) * kvd]);
            }
            attention::forward(&mut a.att, &mut a.lse, &a.q, k, v, input.queries, d);
        }
        None => attention::forward(&mut a.att, &mut a.lse, &a.q, &a.k, &a.v, input.queries, d),
    }
    a.x_mid.copy_from_slice(x);
    ops::linear_add(&mut a.x_mid, &a.att, w.o.weight(), qd);
    ops::rms_norm(&mut a.h2, &mut a.rstd2, &a.x_mid, &w.post_norm, d.eps);
    ops::linear(&mut a.gate, &a.h2, w.gate.weight(), None, h);
    ops::linear(&mut a.up, &a.h2, w.up.weight(), None, h);
    ops::silu_gate(&mut a.act, &a.gate, &a.up);
    next.copy_from_slice(&a.x_mid);
    ops::linear_add(next, &a.act, w.down.weight(), d.intermediate);
}

/// Runs the model over `input`; the final hidden states are in `ws.hidden`. A token outside the
/// vocabulary or a position beyond the rotary table is an error naming the row.
pub fn forward(w: &Weights<'_>, input: Input<'_>, ws: &mut Workspace, mut pass: Pass<'_>) -> Result<()> {
    let d = &w.dims;
    if let Some(r) = input.tokens.iter().position(|&t| t as usize >= d.vocab) {
        return Err(TrainError::Other(format!(
            "row {r}: token {} is outside the vocabulary of {}",
            input.tokens[r], d.vocab
        )));
    }
    let reach = w.rope.max_positions();
    if let Some(r) = input.positions.iter().position(|&p| p as usize >= reach) {
        return Err(TrainError::Other(format!(
            "row {r}: position {} is beyond max_position_embeddings = {reach}",
            input.positions[r]
        )));
    }
    let n = input.tokens.len();
    let train = matches!(pass, Pass::Train);
    let residuals = if train { d.layers + 1 } else { 2 };
    ws.rows = n;
    ws.residual.resize_with(residuals, Vec::new);
    ws.layers.resize_with(if train { d.layers } else { 1 }, Default::default);
    for r in &mut ws.residual {
        r.resize(n * d.hidden, 0.0);
    }
    ops::embed(&mut ws.residual[0], input.tokens, w.embed.weight(), d.hidden);
    for l in 0..d.layers {
        let (src, dst) = if train { (l, l + 1) } else { (l % 2, (l + 1) % 2) };
        let (x, next) = split_two(&mut ws.residual, src, dst);
        let acts = &mut ws.layers[if train { l } else { 0 }];
        let store = match &mut pass {
            Pass::Cached { cache, slots } => {
                let (k, v) = &mut cache.layers[l];
                Some((&mut k[..], &mut v[..], *slots))
            }
            _ => None,
        };
        layer(w, l, x, next, acts, input, store);
    }
    ws.last = if train { d.layers } else { d.layers % 2 };
    ws.hidden.resize(n * d.hidden, 0.0);
    ws.rstd_final.resize(n, 0.0);
    ops::rms_norm(&mut ws.hidden, &mut ws.rstd_final, &ws.residual[ws.last], &w.norm, d.eps);
    Ok(())
}

/// `(&v[a], &mut v[b])` for `a != b`.
fn split_two(v: &mut [Vec<f32>], a: usize, b: usize) -> (&[f32], &mut [f32]) {
    assert_ne!(a, b);
    if a < b {
        let (lo, hi) = v.split_at_mut(b);
        (&lo[a], &mut hi[0])
    } else {
        let (lo, hi) = v.split_at_mut(a);
        (&hi[0], &mut lo[b])
    }
}

//! The backward of a [`Pass::Train`](super::Pass::Train) forward: from the gradient of the loss
//! with respect to the final hidden states back through the final norm, every layer (MLP, norm,
//! attention, rotary embedding, projections, norm) and the embedding, adding each parameter's
//! gradient to its buffer in [`GradBuffers`] (the products accumulate in place: no per-parameter
//! temporary).

use super::attention;
use super::forward::{LayerActs, Workspace};
use super::ops;
use super::packing::Packing;
use super::weights::{Dims, LayerWeights, Weights};
use crate::optim::GradBuffers;

/// The backward's own buffers, reused across calls.
#[derive(Debug, Default)]
pub struct BackwardBuffers {
    /// The gradient of the residual stream at the current layer boundary.
    dx: Vec<f32>,
    dh: Vec<f32>,
    d_att: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    d_act: Vec<f32>,
    d_gate: Vec<f32>,
    d_up: Vec<f32>,
}

impl BackwardBuffers {
    fn resize(&mut self, n: usize, d: &Dims) {
        let (h, qd, kvd, i) = (d.hidden, d.q_dim(), d.kv_dim(), d.intermediate);
        for (buf, width) in [
            (&mut self.dh, h),
            (&mut self.d_att, qd),
            (&mut self.dq, qd),
            (&mut self.dk, kvd),
            (&mut self.dv, kvd),
            (&mut self.d_act, i),
            (&mut self.d_gate, i),
            (&mut self.d_up, i),
        ] {
            buf.resize(n * width, 0.0);
        }
    }
}

/// Adds the gradients of the parameters to `grads`, given `d_hidden [slots, H]`, the gradient of
/// the loss with respect to `ws.hidden` (the forward's final hidden states over `packing`), and
/// calls `after_layer(l, grads)` as soon as layer `l`'s gradients are complete (layers in reverse
/// order): a data-parallel update starts summing them over the ranks while the layers below are
/// still computed (`&mut |_, _| {}` when nothing waits for them). An all-zero `d_hidden` adds
/// nothing and computes nothing (`after_layer` is still called for every layer).
pub fn backward(
    w: &Weights<'_>,
    packing: &Packing,
    ws: &mut Workspace,
    bufs: &mut BackwardBuffers,
    d_hidden: &[f32],
    grads: &mut GradBuffers,
    after_layer: &mut dyn FnMut(usize, &mut GradBuffers),
) {
    let d = &w.dims;
    let n = ws.rows;
    assert_eq!(ws.layers.len(), d.layers, "the forward must be a Pass::Train");
    assert_eq!(d_hidden.len(), n * d.hidden, "d_hidden must be [rows, hidden] of the forward");
    if d_hidden.iter().all(|&g| g == 0.0) {
        // Nothing to add: with finite weights and activations every gradient of a zero `d_hidden`
        // is zero, and adding zeros changes no buffer's value. GRPO makes such
        // micro-batches often (every group's rewards equal: all advantages zero, and no KL or
        // entropy term), and the backward is two thirds of the layers' products.
        for l in (0..d.layers).rev() {
            after_layer(l, grads);
        }
        return;
    }
    bufs.resize(n, d);
    bufs.dx.clear();
    bufs.dx.resize(n * d.hidden, 0.0);
    ops::rms_norm_backward(
        &mut bufs.dx,
        grads.get_mut(w.norm.index),
        d_hidden,
        &ws.residual[d.layers],
        &ws.rstd_final,
        &w.norm,
    );
    for l in (0..d.layers).rev() {
        layer_backward(&w.layers[l], d, w, &ws.layers[l], &ws.residual[l], packing, bufs, grads);
        after_layer(l, grads);
    }
    ops::embed_backward(grads.get_mut(w.embed.index), &packing.tokens, &bufs.dx, d.hidden);
}

/// One layer's backward: `bufs.dx` holds the gradient of the layer's output on entry and that of
/// its input `x` on return.
#[allow(clippy::too_many_arguments)]
fn layer_backward(
    lw: &LayerWeights<'_>,
    d: &Dims,
    w: &Weights<'_>,
    a: &LayerActs,
    x: &[f32],
    packing: &Packing,
    b: &mut BackwardBuffers,
    grads: &mut GradBuffers,
) {
    let (h, qd, inter) = (d.hidden, d.q_dim(), d.intermediate);
    // MLP: next = x_mid + act @ down^T.
    ops::linear_backward(&b.dx, &a.act, lw.down.weight(), &mut b.d_act, false, grads.get_mut(lw.down.index), inter);
    ops::silu_gate_backward(&mut b.d_gate, &mut b.d_up, &b.d_act, &a.gate, &a.up);
    ops::linear_backward(&b.d_gate, &a.h2, lw.gate.weight(), &mut b.dh, false, grads.get_mut(lw.gate.index), h);
    ops::linear_backward(&b.d_up, &a.h2, lw.up.weight(), &mut b.dh, true, grads.get_mut(lw.up.index), h);
    // dx becomes the gradient of x_mid.
    ops::rms_norm_backward(&mut b.dx, grads.get_mut(lw.post_norm.index), &b.dh, &a.x_mid, &a.rstd2, &lw.post_norm);
    // Attention: x_mid = x + att @ o^T.
    ops::linear_backward(&b.dx, &a.att, lw.o.weight(), &mut b.d_att, false, grads.get_mut(lw.o.index), qd);
    attention::backward(
        &mut b.dq,
        &mut b.dk,
        &mut b.dv,
        &b.d_att,
        &a.att,
        &a.lse,
        &a.q,
        &a.k,
        &a.v,
        &packing.queries,
        &packing.blocks,
        d,
    );
    ops::rope(&mut b.dq, &packing.positions, d.head_dim, w.rope, true);
    ops::rope(&mut b.dk, &packing.positions, d.head_dim, w.rope, true);
    ops::add_column_sums(grads.get_mut(lw.q_bias.index), &b.dq);
    ops::add_column_sums(grads.get_mut(lw.k_bias.index), &b.dk);
    ops::add_column_sums(grads.get_mut(lw.v_bias.index), &b.dv);
    ops::linear_backward(&b.dq, &a.h1, lw.q.weight(), &mut b.dh, false, grads.get_mut(lw.q.index), h);
    ops::linear_backward(&b.dk, &a.h1, lw.k.weight(), &mut b.dh, true, grads.get_mut(lw.k.index), h);
    ops::linear_backward(&b.dv, &a.h1, lw.v.weight(), &mut b.dh, true, grads.get_mut(lw.v.index), h);
    // dx becomes the gradient of x.
    ops::rms_norm_backward(&mut b.dx, grads.get_mut(lw.input_norm.index), &b.dh, x, &a.rstd1, &lw.input_norm);
}

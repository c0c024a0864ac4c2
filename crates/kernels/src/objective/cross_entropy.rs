//! Cross-entropy with label smoothing, z-loss and class weights (PyTorch's `F.cross_entropy`,
//! Liger's `LigerCrossEntropyLoss` with `lse_square_scale` and `weight`):
//! `l = (1-s) c_y (lse - u_y) + (s/V) sum_j c_j (lse - u_j) + z lse^2`, with `c = 1` without
//! class weights (`(s/V) sum_j (lse - u_j) = s (lse - mean_j u_j)`), times the row's detached
//! `p_y` with `token_scaling` (Liger's `use_token_scaling`). `mean` divides the first two terms
//! by the counted rows' summed `c_y` and the z-loss by their number, as Liger does.

use super::{GradTerms, RowOutcome};
use crate::inputs::Normalisers;
use crate::options::{LossOptions, Reduction};
use crate::stats::RowStats;

pub(crate) struct CrossEntropy<'a> {
    options: &'a LossOptions,
    vocab: usize,
    /// `[V]` class weights and `[B*T]` targets, when the loss has class weights.
    class_weights: Option<(&'a [f32], &'a [i64])>,
    /// `sum_j c_j / V`: the smoothing term's weight of `lse` (1 without class weights).
    mean_class_weight: f64,
    /// The reduction weight of the cross-entropy terms of every counted row.
    weight: f64,
    /// The reduction weight of every counted row's z-loss.
    z_weight: f64,
}

impl<'a> CrossEntropy<'a> {
    pub fn new(
        options: &'a LossOptions,
        vocab: usize,
        class_weights: Option<(&'a [f32], &'a [i64])>,
        norm: &Normalisers,
    ) -> Self {
        let (weight, z_weight) = match options.reduction {
            // A batch whose counted targets weigh 0 in all has loss 0 (PyTorch and Liger: NaN).
            Reduction::Mean => {
                (if norm.target_weight == 0.0 { 0.0 } else { 1.0 / norm.target_weight }, 1.0 / norm.valid_rows.max(1.0))
            }
            Reduction::Sum | Reduction::None => (1.0, 1.0),
        };
        let mean_class_weight =
            class_weights.map_or(1.0, |(c, _)| c.iter().fold(0.0, |acc, &w| acc + w as f64) / vocab as f64);
        Self { options, vocab, class_weights, mean_class_weight, weight, z_weight }
    }

    pub fn row(&self, row: usize, st: &RowStats) -> RowOutcome {
        let (s, z) = (self.options.label_smoothing, self.options.z_loss);
        let c_y = self.class_weights.map_or(1.0, |(c, y)| c[y[row] as usize] as f64);
        let logp = st.logp.unwrap_or(0.0);
        // A detached factor: it scales the row's loss and its gradient alike.
        let scale = if self.options.token_scaling { logp.exp() } else { 1.0 };
        let (w, wz) = (self.weight * scale, self.z_weight * scale);
        // `mean_u` is the class-weighted `sum_j c_j u_j / V` with class weights. One class:
        // `lse = u_0`, so the term is 0 exactly (its f32 sums would leave ~1e-8 of `c_0 u_0`).
        let smoothing = if self.vocab == 1 { 0.0 } else { s * (self.mean_class_weight * st.lse - st.mean_u) };
        let cross_entropy = -(1.0 - s) * c_y * logp + smoothing;
        let z_loss = z * st.lse * st.lse;
        let mut terms = GradTerms::default();
        if self.vocab == 1 {
            // One class: `log p` and `lse - u_0` are constants (0), so only the z-loss has a
            // gradient; their terms would cancel around it in f32 (~1e-7 of `w`).
            terms.lse(2.0 * z * st.lse * wz);
        } else {
            terms.logp(-(1.0 - s) * c_y * w);
            terms.lse(s * self.mean_class_weight * w + 2.0 * z * st.lse * wz);
            // With class weights the gradient pass takes this term times each column's `c_j`.
            terms.mean_u(-s * w, self.vocab);
        }
        RowOutcome {
            loss: scale * (cross_entropy + z_loss),
            weighted_loss: self.weight * scale * cross_entropy + self.z_weight * scale * z_loss,
            grad: terms.finish(st, self.options.temperature),
            ..RowOutcome::ZERO
        }
    }
}

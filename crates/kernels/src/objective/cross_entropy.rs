//! Cross-entropy with label smoothing and z-loss (PyTorch's `F.cross_entropy`, Liger's
//! `LigerCrossEntropyLoss` with `lse_square_scale`):
//! `l = (1-s)(lse - u_y) + s(lse - mean_j u_j) + z lse^2 = -(1-s) logp + s(lse - mean_u) + z lse^2`,
//! times the row's detached `p_y` with `token_scaling` (Liger's `use_token_scaling`).

use super::{GradTerms, RowOutcome};
use crate::inputs::Normalisers;
use crate::options::{LossOptions, Reduction};
use crate::stats::RowStats;

pub(crate) struct CrossEntropy<'a> {
    options: &'a LossOptions,
    vocab: usize,
    /// The reduction weight of every counted row.
    weight: f64,
}

impl<'a> CrossEntropy<'a> {
    pub fn new(options: &'a LossOptions, vocab: usize, norm: &Normalisers) -> Self {
        let weight = match options.reduction {
            Reduction::Mean => 1.0 / norm.valid_rows.max(1.0),
            Reduction::Sum | Reduction::None => 1.0,
        };
        Self { options, vocab, weight }
    }

    pub fn row(&self, st: &RowStats) -> RowOutcome {
        let (s, z) = (self.options.label_smoothing, self.options.z_loss);
        let logp = st.logp.unwrap_or(0.0);
        // A detached factor: it scales the row's loss and its gradient alike.
        let scale = if self.options.token_scaling { logp.exp() } else { 1.0 };
        let w = self.weight * scale;
        let loss = scale * (-(1.0 - s) * logp + s * (st.lse - st.mean_u) + z * st.lse * st.lse);
        let mut terms = GradTerms::default();
        if self.vocab == 1 {
            // One class: `log p` and `lse - mean u` are constants (0), so only the z-loss has a
            // gradient; their terms would cancel around it in f32 (~1e-7 of `w`).
            terms.lse(2.0 * z * st.lse * w);
        } else {
            terms.logp(-(1.0 - s) * w);
            terms.lse((s + 2.0 * z * st.lse) * w);
            terms.mean_u(-s * w, self.vocab);
        }
        RowOutcome {
            loss,
            weighted_loss: self.weight * loss,
            grad: terms.finish(st, self.options.temperature),
            ..RowOutcome::ZERO
        }
    }
}

//! The two no-policy ops: entropy (a no-grad diagnostic unless `entropy_gradient`; `loss` is its
//! mean over unmasked rows, or with `entropy_gradient` and `reduction` `sum` / `none` their sum)
//! and per-token log-probabilities (used for old and reference log-probs; `loss` is
//! `sum(mask * logp)`, whose gradient this op returns).

use super::{GradTerms, RowOutcome};
use crate::inputs::Normalisers;
use crate::options::{LossOptions, Reduction};
use crate::stats::RowStats;

/// The entropy op's objective.
pub(crate) struct Entropy {
    /// Each row's weight in `loss`.
    weight: f64,
    /// With `entropy_gradient`: the temperature the gradient's `du/dx` takes.
    gradient: Option<f64>,
}

impl Entropy {
    pub fn new(options: &LossOptions, norm: &Normalisers) -> Self {
        // Without its gradient the op is what it always was, whatever `reduction` says.
        let weight = match (options.entropy_gradient, options.reduction) {
            (true, Reduction::Sum | Reduction::None) => 1.0,
            _ => 1.0 / norm.valid_rows.max(1.0),
        };
        Self { weight, gradient: options.entropy_gradient.then_some(options.temperature) }
    }

    pub fn row(&self, st: &RowStats) -> RowOutcome {
        let grad = self.gradient.map_or(super::RowGradient::ZERO, |temperature| {
            let mut terms = GradTerms::default();
            terms.entropy(self.weight, st.entropy);
            terms.finish(st, temperature)
        });
        RowOutcome { loss: st.entropy, weighted_loss: st.entropy * self.weight, grad, ..RowOutcome::ZERO }
    }
}

pub(crate) fn logprob(st: &RowStats, temperature: f64) -> RowOutcome {
    let logp = st.logp.unwrap_or(0.0);
    let mut terms = GradTerms::default();
    terms.logp(1.0);
    RowOutcome { loss: logp, weighted_loss: logp, grad: terms.finish(st, temperature), ..RowOutcome::ZERO }
}

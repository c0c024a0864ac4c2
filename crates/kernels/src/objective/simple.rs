//! The two no-policy ops: entropy (a no-grad diagnostic; `loss` is its mean over unmasked
//! rows) and per-token log-probabilities (used for old and reference log-probs; `loss` is
//! `sum(mask * logp)`, whose gradient this op returns).

use super::{GradTerms, RowOutcome};
use crate::inputs::Normalisers;
use crate::stats::RowStats;

pub(crate) fn entropy(st: &RowStats, norm: &Normalisers) -> RowOutcome {
    RowOutcome { loss: st.entropy, weighted_loss: st.entropy / norm.valid_rows.max(1.0), ..RowOutcome::ZERO }
}

pub(crate) fn logprob(st: &RowStats, temperature: f64) -> RowOutcome {
    let logp = st.logp.unwrap_or(0.0);
    let mut terms = GradTerms::default();
    terms.logp(1.0);
    RowOutcome { loss: logp, weighted_loss: logp, grad: terms.finish(st, temperature), ..RowOutcome::ZERO }
}

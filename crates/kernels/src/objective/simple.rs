//! The two no-policy ops: entropy (a no-grad diagnostic) and per-token log-probabilities (used
//! for old and reference log-probs; its gradient is that of `sum(mask * logp)`).

use super::{ordered_sum, per_active_row, row_outputs, GradTerms, LossOutput, RowGradient};
use crate::inputs::{Normalisers, Rows};
use crate::options::LossOptions;
use crate::stats::RowStats;

/// `loss` = mean entropy over unmasked rows; `per_token_loss` = the entropy; no gradient.
pub(super) fn entropy(
    rows: &Rows,
    _options: &LossOptions,
    norm: &Normalisers,
    active: &[bool],
    stats: &[RowStats],
) -> (LossOutput, Vec<RowGradient>) {
    let (logp, entropy) = row_outputs(rows, active, stats);
    let sum = ordered_sum(active.iter().zip(stats).filter(|(&a, _)| a).map(|(_, s)| s.entropy));
    let output = LossOutput {
        loss: sum / norm.valid_rows.max(1.0),
        per_token_loss: entropy.clone(),
        logp,
        entropy,
        kl: None,
        is_clipped: None,
    };
    (output, vec![RowGradient::ZERO; rows.len()])
}

/// `loss = sum(mask * logp)`; `per_token_loss` = the masked logp.
pub(super) fn logprob(
    rows: &Rows,
    options: &LossOptions,
    active: &[bool],
    stats: &[RowStats],
) -> (LossOutput, Vec<RowGradient>) {
    let logp = per_active_row(active, |i| stats[i].logp.unwrap_or(0.0));
    let loss = ordered_sum(active.iter().zip(stats).filter(|(&a, _)| a).map(|(_, s)| s.logp.unwrap_or(0.0)));
    let grads = active
        .iter()
        .zip(stats)
        .map(|(&a, st)| {
            if !a {
                return RowGradient::ZERO;
            }
            let mut terms = GradTerms::default();
            terms.logp(1.0);
            terms.finish(st, options.temperature)
        })
        .collect();
    let (_, entropy) = row_outputs(rows, active, stats);
    let output =
        LossOutput { loss, per_token_loss: logp.clone(), logp: Some(logp), entropy, kl: None, is_clipped: None };
    (output, grads)
}

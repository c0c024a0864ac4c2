//! Upstream gradients of an op's per-token outputs besides its loss: each row's `entropy` and
//! `lse` are functions of that row's logits alone, so a caller that back-propagates through them
//! (verl's `FusedLinearForPPO` hands back differentiable log-probabilities *and* entropies;
//! Liger's fused-linear scaled cross-entropy its selected tokens' log-probabilities, `u_k - lse`)
//! gets their gradient in the same four scalars per row as the loss's:
//!
//! `d(g_H H + g_lse lse)/du_j = -g_H p_j (log p_j + H) + g_lse p_j`
//!
//! so one gradient pass writes the gradient of the loss and of every output at once.

use rayon::prelude::*;

use super::{GradTerms, RowGradient, ROWS_PER_TASK};
use crate::error::LossError;
use crate::inputs::{Loss, Rows};
use crate::options::LossOptions;
use crate::stats::RowStats;

/// Per-token upstream gradients of a loss's outputs, one value per row each; `None`: zero.
/// What [`crate::PreparedLoss::output_gradients`] turns into row gradients.
#[derive(Debug, Clone, Copy, Default)]
pub struct OutputUpstreams<'a> {
    /// Of each row's term in the loss, as [`crate::PreparedLoss::upstream_gradients`] takes it
    /// (for a per-token loss, of `per_token_loss`; for `logprob`, of `logp`).
    pub loss: Option<&'a [f32]>,
    /// Of each row's `entropy` output.
    pub entropy: Option<&'a [f32]>,
    /// Of each row's `lse` output.
    pub lse: Option<&'a [f32]>,
}

impl OutputUpstreams<'_> {
    /// Refuses upstreams of another length than the rows (named), `loss`'s as
    /// [`super::check_upstream`] does, and any upstream on an op without a gradient.
    pub(crate) fn check(&self, loss: &Loss, rows: &Rows, options: &LossOptions) -> Result<(), LossError> {
        let given = [self.loss, self.entropy, self.lse].iter().any(Option::is_some);
        if given && !loss.has_gradient(options) {
            return Err(LossError::NoGradient { op: loss.name() });
        }
        if let Some(upstream) = self.loss {
            super::check_upstream(loss, rows, options, upstream)?;
        }
        for (tensor, upstream) in [("upstream_entropy", self.entropy), ("upstream_lse", self.lse)] {
            if let Some(u) = upstream.filter(|u| u.len() != rows.len()) {
                return Err(LossError::Shape {
                    tensor,
                    got: vec![u.len()],
                    expected: format!("one upstream gradient per row, B*T = {}", rows.len()),
                });
            }
        }
        Ok(())
    }

    /// Whether an output besides the loss has an upstream.
    pub(crate) fn has_outputs(&self) -> bool {
        self.entropy.is_some() || self.lse.is_some()
    }

    /// Row `i`'s upstreams of its `entropy` and `lse` (0 where absent).
    pub(crate) fn outputs_at(&self, i: usize) -> (f64, f64) {
        let at = |u: Option<&[f32]>| u.map_or(0.0, |u| u[i] as f64);
        (at(self.entropy), at(self.lse))
    }
}

/// Adds the gradient of the `entropy` and `lse` upstreams to each active row's gradient (rows
/// that take no part output 0 and stay without a gradient, whatever their upstream).
pub(crate) fn add_output_terms(
    grads: &mut [RowGradient],
    active: &[bool],
    stats: &[RowStats],
    upstreams: &OutputUpstreams,
    temperature: f64,
) {
    if !upstreams.has_outputs() {
        return;
    }
    grads.par_iter_mut().enumerate().with_min_len(ROWS_PER_TASK).filter(|(i, _)| active[*i]).for_each(|(i, g)| {
        let (entropy, lse) = upstreams.outputs_at(i);
        let mut terms = GradTerms::default();
        terms.entropy(entropy, stats[i].entropy);
        terms.lse(lse);
        *g = g.plus(&terms.finish(&stats[i], temperature));
    });
}

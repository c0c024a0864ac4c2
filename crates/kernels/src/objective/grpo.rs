//! The GRPO / PPO-family token objective (TRL's `GRPOTrainer._compute_loss`, Liger's
//! `LigerFusedLinearGRPOFunction.ppo_loss_fn`), with the gradient of each term written out.
//!
//! Each row's loss depends on `logp` directly (cispo, KL) and through the log importance weight
//! `log_w` (PPO surrogate, sapo, bias-corrected KL). At token level `log_w = logp - old`; at
//! sequence level it is the masked mean over the sequence, so its gradient is shared evenly by
//! the sequence's unmasked rows.

use super::{ordered_sum, GradTerms, RowGradient, RowOutcome};
use crate::inputs::{Normalisers, PolicyInputs, Rows};
use crate::options::{ImportanceSamplingLevel, LossOptions, LossType};
use crate::stats::RowStats;

/// One row's loss and its partial derivatives, before the reduction weight.
struct TokenTerms {
    loss: f64,
    kl: f64,
    clipped: bool,
    /// d loss / d logp, holding `log_w` fixed.
    d_logp: f64,
    /// d loss / d log_w.
    d_log_w: f64,
}

/// The policy term of one token: `(loss, d/dlogp, d/dlog_w, is_clipped)`.
fn policy_term(options: &LossOptions, logp: f64, log_w: f64, advantage: f64) -> (f64, f64, f64, bool) {
    let r = log_w.exp();
    let (lo, hi) = (1.0 - options.epsilon_low, 1.0 + options.epsilon_high());
    let ppo_clipped = (r < lo && advantage < 0.0) || (r > hi && advantage > 0.0);
    match options.loss_type {
        LossType::Cispo => {
            // -stop_grad(min(r, eps_high)) * A * logp
            let k = r.min(options.epsilon_high());
            let clipped = r > options.epsilon_high() && advantage > 0.0;
            (-k * advantage * logp, -k * advantage, 0.0, clipped)
        }
        LossType::Sapo => {
            let tau = if advantage > 0.0 { options.sapo_temperature_pos } else { options.sapo_temperature_neg };
            let sig = 1.0 / (1.0 + (-tau * (r - 1.0)).exp());
            let loss = -advantage * (4.0 / tau) * sig;
            (loss, 0.0, -advantage * 4.0 * sig * (1.0 - sig) * r, ppo_clipped)
        }
        LossType::Grpo | LossType::Bnpo | LossType::DrGrpo | LossType::Dapo => {
            // -min(r1*A, clip(r)*A) with r1 = min(r, delta). Each branch passes d/dlog_w = r*A
            // where its clamp is not active (closed interval, as torch.clamp); the smaller branch
            // wins, and a tie splits the gradient evenly (torch.min). The clipped branch can carry
            // the gradient when delta < 1 + epsilon_high.
            let r1 = options.delta.map_or(r, |d| r.min(d));
            let unclipped = r1 * advantage;
            let clipped = r.clamp(lo, hi) * advantage;
            let through = |passes: bool| if passes { -advantage * r } else { 0.0 };
            let d_unclipped = through(options.delta.is_none_or(|d| r <= d));
            let d_clipped = through(lo <= r && r <= hi);
            let d_log_w = if unclipped < clipped {
                d_unclipped
            } else if clipped < unclipped {
                d_clipped
            } else {
                0.5 * (d_unclipped + d_clipped)
            };
            (-unclipped.min(clipped), 0.0, d_log_w, ppo_clipped)
        }
    }
}

fn token_terms(
    options: &LossOptions,
    inputs: &PolicyInputs,
    rows: &Rows,
    row: usize,
    logp: f64,
    log_w: f64,
    entropy: f64,
) -> TokenTerms {
    let b = row / rows.seq_len;
    let advantage = inputs.advantages[b] as f64;
    let (mut loss, mut d_logp, mut d_log_w, clipped) = policy_term(options, logp, log_w, advantage);
    if let Some(is_ratio) = inputs.is_ratio {
        let k = is_ratio.at(row, rows.seq_len) as f64;
        loss *= k;
        d_logp *= k;
        d_log_w *= k;
    }
    let mut kl = 0.0;
    if let Some(ref_logp) = inputs.ref_logp {
        let diff = ref_logp[row] as f64 - logp;
        let k3 = diff.exp() - diff - 1.0;
        let dk3 = 1.0 - diff.exp();
        let (k3, dk3_logp, dk3_log_w) = if options.use_bias_correction_kl {
            let r = log_w.exp();
            (k3 * r, dk3 * r, k3 * r)
        } else {
            (k3, dk3, 0.0)
        };
        kl = k3;
        if options.beta != 0.0 {
            loss += options.beta * k3;
            d_logp += options.beta * dk3_logp;
            d_log_w += options.beta * dk3_log_w;
        }
    }
    loss -= options.entropy_coef * entropy;
    TokenTerms { loss, kl, clipped, d_logp, d_log_w }
}

/// GRPO prepared for a batch: normalisers and per-sequence counts resolved.
pub(crate) struct Grpo<'a> {
    inputs: PolicyInputs<'a>,
    rows: Rows<'a>,
    options: &'a LossOptions,
    norm: Normalisers,
    /// Unmasked rows per sequence, at least 1.
    counts: Vec<f64>,
}

impl<'a> Grpo<'a> {
    pub fn new(
        inputs: PolicyInputs<'a>,
        rows: Rows<'a>,
        options: &'a LossOptions,
        norm: Normalisers,
        active: &[bool],
    ) -> Self {
        let t = rows.seq_len;
        let counts =
            (0..rows.batch).map(|b| active[b * t..(b + 1) * t].iter().filter(|&&a| a).count().max(1) as f64).collect();
        Self { inputs, rows, options, norm, counts }
    }

    /// Token level: each row's loss depends on that row alone.
    pub fn is_row_local(&self) -> bool {
        self.options.importance_sampling_level == ImportanceSamplingLevel::Token
    }

    /// The reduction weight of an unmasked row.
    fn weight(&self, row: usize) -> f64 {
        let n = &self.norm;
        match self.options.loss_type {
            LossType::Grpo | LossType::Sapo => 1.0 / (n.batch * self.counts[row / self.rows.seq_len]),
            LossType::Bnpo => 1.0 / n.valid_rows.max(1.0),
            LossType::DrGrpo => 1.0 / (n.batch * n.max_completion_length),
            LossType::Dapo | LossType::Cispo => 1.0 / n.num_items.max(1.0),
        }
    }

    fn log_ratio(&self, row: usize, stats: &RowStats) -> f64 {
        self.inputs.old_logp.map_or(0.0, |old| stats.logp.unwrap_or(0.0) - old[row] as f64)
    }

    /// One unmasked row, given its log importance weight; the gradient through `log_w` is
    /// returned separately (already weighted) so a sequence can share it.
    fn row_with(&self, row: usize, stats: &RowStats, log_w: f64) -> (RowOutcome, f64, f64) {
        let logp = stats.logp.unwrap_or(0.0);
        let t = token_terms(self.options, &self.inputs, &self.rows, row, logp, log_w, stats.entropy);
        let w = self.weight(row);
        let outcome = RowOutcome {
            loss: t.loss,
            weighted_loss: w * t.loss,
            kl: t.kl,
            clipped: t.clipped,
            grad: RowGradient::ZERO,
        };
        (outcome, w * t.d_logp, w * t.d_log_w)
    }

    fn gradient(&self, row: usize, stats: &RowStats, d_logp: f64) -> RowGradient {
        let mut terms = GradTerms::default();
        terms.logp(d_logp);
        terms.entropy(-self.options.entropy_coef * self.weight(row), stats.entropy);
        terms.finish(stats, self.options.temperature)
    }

    /// Token level only.
    pub fn row(&self, row: usize, stats: &RowStats) -> RowOutcome {
        let (mut outcome, d_logp, d_log_w) = self.row_with(row, stats, self.log_ratio(row, stats));
        outcome.grad = self.gradient(row, stats, d_logp + d_log_w);
        outcome
    }

    /// Every row; at sequence level (GSPO) the log-weight is the masked mean of the sequence's
    /// log-ratios, and its gradient is shared evenly by the sequence's unmasked rows.
    pub fn all(&self, active: &[bool], stats: &[RowStats]) -> Vec<RowOutcome> {
        if self.is_row_local() {
            return (0..stats.len())
                .map(|i| if active[i] { self.row(i, &stats[i]) } else { RowOutcome::ZERO })
                .collect();
        }
        let t_len = self.rows.seq_len;
        let mut outcomes = vec![RowOutcome::ZERO; stats.len()];
        for b in 0..self.rows.batch {
            let on: Vec<usize> = (b * t_len..(b + 1) * t_len).filter(|&i| active[i]).collect();
            let log_w = ordered_sum(on.iter().map(|&i| self.log_ratio(i, &stats[i]))) / self.counts[b];
            let parts: Vec<(usize, RowOutcome, f64, f64)> = on
                .iter()
                .map(|&i| {
                    let (o, d_logp, d_log_w) = self.row_with(i, &stats[i], log_w);
                    (i, o, d_logp, d_log_w)
                })
                .collect();
            let shared = ordered_sum(parts.iter().map(|p| p.3)) / self.counts[b];
            for (i, mut o, d_logp, _) in parts {
                o.grad = self.gradient(i, &stats[i], d_logp + shared);
                outcomes[i] = o;
            }
        }
        outcomes
    }
}

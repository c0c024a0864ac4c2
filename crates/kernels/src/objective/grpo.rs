//! The GRPO / PPO-family token objective (TRL's `GRPOTrainer._compute_loss`, Liger's
//! `LigerFusedLinearGRPOFunction.ppo_loss_fn`), with the gradient of each term written out.
//!
//! Each row's loss depends on `logp` directly (cispo, KL) and through the log importance weight
//! `log_w` (PPO surrogate, sapo, bias-corrected KL). At token level `log_w = logp - old`; at
//! sequence level it is the masked mean over the sequence, so its gradient is shared evenly by
//! the sequence's unmasked rows.

use super::{ordered_sum, row_outputs, to_f32, GradTerms, LossOutput, RowGradient};
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

pub(super) fn evaluate(
    inputs: &PolicyInputs,
    rows: &Rows,
    options: &LossOptions,
    norm: &Normalisers,
    active: &[bool],
    stats: &[RowStats],
) -> (LossOutput, Vec<RowGradient>) {
    let (n, seq_len) = (rows.len(), rows.seq_len);
    let logp = |i: usize| stats[i].logp.unwrap_or(0.0);
    let log_ratio = |i: usize| inputs.old_logp.map_or(0.0, |old| logp(i) - old[i] as f64);
    let counts: Vec<f64> = (0..rows.batch)
        .map(|b| active[b * seq_len..(b + 1) * seq_len].iter().filter(|&&a| a).count().max(1) as f64)
        .collect();
    let count = |b: usize| counts[b];

    // Sequence level (GSPO): one log-weight per sequence, the masked mean of the log-ratios.
    let seq_log_w: Vec<f64> = match options.importance_sampling_level {
        ImportanceSamplingLevel::Token => Vec::new(),
        ImportanceSamplingLevel::Sequence => (0..rows.batch)
            .map(|b| {
                ordered_sum((0..seq_len).map(|t| b * seq_len + t).filter(|&i| active[i]).map(log_ratio)) / count(b)
            })
            .collect(),
    };
    let log_w = |i: usize| match options.importance_sampling_level {
        ImportanceSamplingLevel::Token => log_ratio(i),
        ImportanceSamplingLevel::Sequence => seq_log_w[i / seq_len],
    };
    let weight = |i: usize| match options.loss_type {
        LossType::Grpo | LossType::Sapo => 1.0 / (norm.batch * count(i / seq_len)),
        LossType::Bnpo => 1.0 / norm.valid_rows.max(1.0),
        LossType::DrGrpo => 1.0 / (norm.batch * norm.max_completion_length),
        LossType::Dapo | LossType::Cispo => 1.0 / norm.num_items.max(1.0),
    };

    let mut per_token = vec![0.0; n];
    let mut kl = vec![0.0; n];
    let mut clipped = vec![0.0f32; n];
    let mut weighted = vec![0.0; n];
    let mut d_logp = vec![0.0; n];
    let mut d_log_w = vec![0.0; n];
    for i in (0..n).filter(|&i| active[i]) {
        let t = token_terms(options, inputs, rows, i, logp(i), log_w(i), stats[i].entropy);
        let w = weight(i);
        per_token[i] = t.loss;
        kl[i] = t.kl;
        clipped[i] = if t.clipped { 1.0 } else { 0.0 };
        weighted[i] = w * t.loss;
        d_logp[i] = w * t.d_logp;
        d_log_w[i] = w * t.d_log_w;
    }
    if options.importance_sampling_level == ImportanceSamplingLevel::Sequence {
        // d log_w_b / d logp_t = 1 / count(b) for each unmasked t of sequence b.
        for b in 0..rows.batch {
            let range = b * seq_len..(b + 1) * seq_len;
            let shared = ordered_sum(d_log_w[range.clone()].iter().copied()) / count(b);
            d_log_w[range.clone()].iter_mut().zip(&active[range]).for_each(|(g, &a)| *g = if a { shared } else { 0.0 });
        }
    }
    let grads = (0..n)
        .map(|i| {
            if !active[i] {
                return RowGradient::ZERO;
            }
            let mut terms = GradTerms::default();
            terms.logp(d_logp[i] + d_log_w[i]);
            terms.entropy(-options.entropy_coef * weight(i), stats[i].entropy);
            terms.finish(&stats[i], options.temperature)
        })
        .collect();

    let (logp, entropy) = row_outputs(rows, active, stats);
    let output = LossOutput {
        loss: ordered_sum(weighted.iter().copied()),
        per_token_loss: to_f32(&per_token),
        logp,
        entropy,
        kl: Some(to_f32(&kl)),
        is_clipped: Some(clipped),
    };
    (output, grads)
}

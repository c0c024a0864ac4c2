//! The per-token pieces of the GRPO / PPO-family objective, each a pure function with its
//! derivative written out: the policy term of every loss type, torch's `min` gradient rule, the
//! KL estimators, the rollout correction's bounds and vespo's gamma weight.

use crate::options::{KlEstimator, LossOptions, LossType};

/// The policy term of one token: `(loss, d/dlogp, d/dlog_w, is_clipped)`.
pub(crate) fn policy_term(
    options: &LossOptions,
    logp: f64,
    log_w: f64,
    advantage: f64,
    phi: f64,
    selected: bool,
) -> (f64, f64, f64, bool) {
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
        // -stop_grad(phi(w)) * A * logp
        LossType::Vespo => (-phi * advantage * logp, -phi * advantage, 0.0, false),
        LossType::Gpg => (-advantage * logp, -advantage, 0.0, false),
        // -A r (no clip), + ppo_kl_coef |log r| on the selected rows (torch.abs: gradient sign, 0 at 0).
        LossType::KlCov => {
            let (mut loss, mut d_log_w) = (-advantage * r, -advantage * r);
            if selected {
                loss += options.ppo_kl_coef * log_w.abs();
                d_log_w += options.ppo_kl_coef
                    * if log_w > 0.0 {
                        1.0
                    } else if log_w < 0.0 {
                        -1.0
                    } else {
                        0.0
                    };
            }
            (loss, 0.0, d_log_w, selected)
        }
        // The sequence's geometric-mean term is added by `Grpo::geo_mean`; per token only the KL
        // and the entropy bonus remain.
        LossType::GeoMean => (0.0, 0.0, 0.0, false),
        LossType::Grpo | LossType::Bnpo | LossType::DrGrpo | LossType::Dapo | LossType::Luspo | LossType::ClipCov => {
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
            let d_log_w = tie_split(unclipped, clipped, d_unclipped, d_clipped);
            let loss = -unclipped.min(clipped);
            let (loss, d_log_w) = match options.clip_ratio_c {
                // verl's dual clip: for A < 0, min(-A*c, loss), torch.min's gradient.
                Some(c) if advantage < 0.0 => {
                    let bound = -advantage * c;
                    (loss.min(bound), tie_split(loss, bound, d_log_w, 0.0))
                }
                _ => (loss, d_log_w),
            };
            // clip_cov: the selected rows' term is multiplied by 0.
            if options.loss_type == LossType::ClipCov {
                let keep = if selected { 0.0 } else { 1.0 };
                (loss * keep, 0.0, d_log_w * keep, selected)
            } else {
                (loss, 0.0, d_log_w, ppo_clipped)
            }
        }
    }
}

/// The gradient of `min(x, y)` as torch gives it: the smaller one's, half each on a tie.
pub(crate) fn tie_split(x: f64, y: f64, dx: f64, dy: f64) -> f64 {
    if x < y {
        dx
    } else if y < x {
        dy
    } else {
        0.5 * (dx + dy)
    }
}

/// The KL estimator of `logp` against `ref_logp`: `(value, d value / d logp)`.
pub(crate) fn kl_estimate(estimator: KlEstimator, logp: f64, ref_logp: f64) -> (f64, f64) {
    let d = ref_logp - logp;
    match estimator {
        KlEstimator::K3 => (d.exp() - d - 1.0, 1.0 - d.exp()),
        KlEstimator::LowVarKl => {
            // torch.clamp passes the gradient on the closed interval.
            let dc = d.clamp(-20.0, 20.0);
            let pass_d = (-20.0..=20.0).contains(&d);
            let k = dc.exp() - dc - 1.0;
            let kc = k.clamp(-10.0, 10.0);
            let pass_k = (-10.0..=10.0).contains(&k);
            let grad = if pass_d && pass_k { 1.0 - dc.exp() } else { 0.0 };
            (kc, grad)
        }
        KlEstimator::K1 => (-d, 1.0),
        KlEstimator::K2 => (0.5 * d * d, -d),
        // torch.abs has gradient sign(x), 0 at 0.
        KlEstimator::Abs => (
            d.abs(),
            if d > 0.0 {
                -1.0
            } else if d < 0.0 {
                1.0
            } else {
                0.0
            },
        ),
    }
}

/// Rollout correction: clamps (`*_truncate`) or zeroes (`*_mask`) the ratio outside the bounds.
pub(crate) fn bound_ratio(options: &LossOptions, ratio: f64) -> f64 {
    let (lo, hi) = (options.vllm_importance_sampling_clip_min, options.vllm_importance_sampling_clip_max);
    if options.vllm_importance_sampling_mode.masks() {
        let outside = lo.is_some_and(|l| ratio < l) || hi.is_some_and(|h| ratio > h);
        if outside {
            0.0
        } else {
            ratio
        }
    } else {
        let r = lo.map_or(ratio, |l| ratio.max(l));
        hi.map_or(r, |h| r.min(h))
    }
}

/// vespo's gamma weight `phi(w) = exp(lambda + k log w - lambda w)` from the sequence's summed
/// log-ratio (TRL's `get_gamma_weights`, in log space, non-finite -> 0).
pub(crate) fn vespo_phi(options: &LossOptions, seq_log_ratio: f64, advantage: f64) -> f64 {
    let lower = 1e-8f64.ln();
    let log_w = seq_log_ratio.clamp(lower, 20.0);
    let (k, lambda) = if advantage >= 0.0 {
        (options.vespo_k_pos, options.vespo_lambda_pos)
    } else {
        (options.vespo_k_neg, options.vespo_lambda_neg)
    };
    let lambda = lambda.max(1e-4);
    let phi = (lambda + k * log_w - lambda * log_w.exp()).exp();
    if phi.is_finite() {
        phi
    } else {
        0.0
    }
}

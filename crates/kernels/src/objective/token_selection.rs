//! Which tokens a whole-batch option acts on: TRL's high-entropy tokens (a quantile of the batch's
//! entropies) and verl's covariance selections (`kl_cov`, `clip_cov`). Detached quantities,
//! computed once per batch from every row's statistics.

use crate::inputs::BatchShard;
use crate::options::{LossOptions, LossType};

use super::ordered_sum;

/// The entropy the top-entropy mask ranks and compares: the per-token output's f32 value. TRL
/// takes its threshold over f32 entropies (`entropies[mask].float()`), so a token at the quantile
/// itself is kept exactly when TRL keeps it.
pub(crate) fn ranked_entropy(h: f64) -> f64 {
    h as f32 as f64
}

/// Whether a token of entropy `h` trains the policy term under `threshold` (`None`: every token).
pub(crate) fn trains(threshold: Option<f64>, h: f64) -> bool {
    threshold.is_none_or(|t| ranked_entropy(h) >= t)
}

/// `torch.quantile(values, q)` (linear interpolation, torch's `lerp`); `values` sorted, not empty.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    let pos = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    let (a, b, w) = (sorted[lo], sorted[hi], pos - pos.floor());
    if w < 0.5 {
        a + w * (b - a)
    } else {
        b - (b - a) * (1.0 - w)
    }
}

/// verl's `kl_cov` / `clip_cov` token selection, from the detached `logp` and log-ratios of every
/// row: the covariance `(A_i - mean A)(logp_i - mean logp)` over the unmasked rows; `kl_cov` takes
/// the `max(1, floor(kl_cov_ratio * n))` largest (ties: the lower row), `clip_cov` draws
/// `min(max(1, floor(clip_cov_ratio * n)), candidates)` at random (a permutation seeded by
/// `clip_cov_seed`) among the rows with `clip_cov_lb < cov < clip_cov_ub` that the PPO clip does
/// not already clip.
pub(crate) fn covariance_selection(
    options: &LossOptions,
    seq_len: usize,
    active: &[bool],
    advantages: &[f32],
    logp: &[f64],
    log_w: &[f64],
) -> Vec<bool> {
    let mut selected = vec![false; active.len()];
    let valid: Vec<usize> = (0..active.len()).filter(|&i| active[i]).collect();
    if valid.is_empty() {
        return selected;
    }
    let n = valid.len() as f64;
    let adv = |i: usize| advantages[i / seq_len] as f64;
    let mean_a = ordered_sum(valid.iter().map(|&i| adv(i))) / n;
    let mean_l = ordered_sum(valid.iter().map(|&i| logp[i])) / n;
    let cov = |i: usize| (adv(i) - mean_a) * (logp[i] - mean_l);
    if options.loss_type == LossType::KlCov {
        let k = ((n * options.kl_cov_ratio) as usize).max(1);
        let mut order = valid.clone();
        order.sort_by(|&a, &b| cov(b).total_cmp(&cov(a)).then(a.cmp(&b)));
        for &i in order.iter().take(k) {
            selected[i] = true;
        }
        return selected;
    }
    let (lo, hi) = (1.0 - options.epsilon_low, 1.0 + options.epsilon_high());
    let clipped_by_ppo = |i: usize| {
        let (a, r) = (adv(i), log_w[i].exp());
        -a * r.clamp(lo, hi) > -a * r
    };
    let mut candidates: Vec<usize> = valid
        .iter()
        .copied()
        .filter(|&i| !clipped_by_ppo(i) && options.clip_cov_lb < cov(i) && cov(i) < options.clip_cov_ub)
        .collect();
    let k = ((n * options.clip_cov_ratio) as usize).max(1).min(candidates.len());
    let mut rng = crate::synthetic::Rng::new(options.clip_cov_seed);
    for j in 0..k {
        let pick = j + rng.below(candidates.len() - j);
        candidates.swap(j, pick);
        selected[candidates[j]] = true;
    }
    selected
}

/// The top-entropy threshold (`None` when `top_entropy_quantile` is 1) and the masked-mean entropy
/// bonus's row count, from the shard's global values when it carries them, else from the rows at
/// hand (`entropy(i)` of each active row).
pub(crate) fn high_entropy_counts(
    options: &LossOptions,
    shard: Option<BatchShard>,
    active: &[bool],
    valid_rows: f64,
    entropy: impl Fn(usize) -> f64,
) -> (Option<f64>, f64) {
    let threshold = (options.top_entropy_quantile < 1.0).then(|| {
        shard.and_then(|s| s.entropy_threshold).unwrap_or_else(|| {
            let mut h: Vec<f64> =
                (0..active.len()).filter(|&i| active[i]).map(|i| ranked_entropy(entropy(i))).collect();
            h.sort_by(f64::total_cmp);
            // No row takes part: every row is masked out (TRL returns an all-false mask).
            if h.is_empty() {
                f64::INFINITY
            } else {
                quantile(&h, 1.0 - options.top_entropy_quantile)
            }
        })
    });
    let bonus_rows = match (threshold, shard.and_then(|s| s.global_bonus_rows)) {
        (None, _) => valid_rows,
        (Some(_), Some(n)) => n,
        (Some(thr), None) => (0..active.len()).filter(|&i| active[i] && trains(Some(thr), entropy(i))).count() as f64,
    };
    (threshold, bonus_rows.max(1.0))
}

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

/// `torch.quantile(values, q)` of f32 `values` (TRL's entropies), as torch computes it: `q`, the
/// rank, the weight and the linear interpolation (torch's `lerp`) in f32; `values` sorted, not
/// empty. In f64 the threshold could fall a hair above a value that torch's f32 interpolation
/// rounds it back onto, and that token, which TRL keeps (`>=`), was dropped
/// (bench/tools/logits_fuzz.py). Matches `torch.quantile` on 20000 random cases.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    let pos = q as f32 * (sorted.len() - 1) as f32;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    let (a, b, w) = (sorted[lo] as f32, sorted[hi.min(sorted.len() - 1)] as f32, pos - pos.floor());
    let v = if w < 0.5 { a + w * (b - a) } else { b - (b - a) * (1.0 - w) };
    v as f64
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

#[cfg(test)]
mod tests {
    use super::quantile;

    /// `torch.quantile` of f32 values (torch 2.15), where the same interpolation in f64 gives
    /// another value: `(sorted values, q, torch's result)`.
    #[test]
    fn quantile_is_torch_s_in_f32() {
        let cases: [(&[f32], f64, f32); 4] = [
            (
                &[7.6200767, 7.6201077, 7.620159, 7.6201954, 7.6202073, 7.620252, 7.6202526],
                0.775_958_567_435_716_9,
                7.620237,
            ),
            (&[7.6200337, 7.6201406, 7.620195, 7.6202703], 0.246_572_832_619_830_32, 7.620113),
            (
                &[7.6200304, 7.6200547, 7.6200747, 7.6201167, 7.6201224, 7.620219, 7.6202602],
                0.761_925_427_594_386,
                7.6201777,
            ),
            (&[7.620038, 7.620042, 7.6201854], 0.001_774_862_202_534_643_9, 7.620038),
        ];
        for (values, q, want) in cases {
            let sorted: Vec<f64> = values.iter().map(|&v| v as f64).collect();
            assert_eq!(quantile(&sorted, q), want as f64, "{values:?} at {q}");
        }
        assert_eq!(quantile(&[2.0], 0.3), 2.0);
        assert_eq!(quantile(&[1.0, 3.0], 1.0), 3.0);
    }
}

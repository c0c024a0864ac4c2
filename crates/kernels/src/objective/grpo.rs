//! The GRPO / PPO-family token objective (TRL's `GRPOTrainer._compute_loss`, Liger's
//! `LigerFusedLinearGRPOFunction.ppo_loss_fn`, verl's `core_algos`), with the gradient of each
//! term written out.
//!
//! Each row's loss depends on `logp` directly (cispo, vespo, gpg, KL) and through the log
//! importance weight `log_w` (PPO surrogate, sapo, bias-corrected KL). At token level
//! `log_w = logp - old`; at sequence level it is the masked mean over the sequence, so its
//! gradient is shared evenly by the sequence's unmasked rows.
//!
//! Some options need quantities of a whole sequence or of the whole batch (GSPO's mean log-ratio,
//! vespo's gamma weight, the off-policy mask, the entropy quantile): they are gathered in a
//! [`SequenceContext`] per sequence and a [`BatchContext`] before the rows' terms. When none of
//! them depends on the rows' statistics the objective is row-local and the context is built once,
//! from the inputs alone, so the kernels keep their one sweep.

use super::policy_terms::{bound_ratio, kl_estimate, policy_term, tie_split, vespo_phi};
use super::token_selection::{covariance_selection, high_entropy_counts, trains};
use rayon::prelude::*;

use super::{each_active_row, ordered_sum, sequences_per_task, GradTerms, RowGradient, RowOutcome};
use crate::inputs::{BatchShard, IsRatio, Normalisers, PolicyInputs, Rows};
use crate::options::{Aggregation, EntropyBonus, ImportanceSamplingLevel, LossOptions, LossType, RolloutCorrection};
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

/// What a row's terms need from its sequence.
#[derive(Debug, Clone, Copy)]
struct SequenceContext {
    /// GSPO: the sequence's log importance weight (`None` at token level).
    log_w: Option<f64>,
    /// The off-policy mask: 0 drops the sequence's policy term.
    keep: f64,
    /// Sequence-level rollout correction weight.
    rollout: Option<f64>,
    /// vespo's detached gamma weight `phi(w)`.
    phi: f64,
}

impl SequenceContext {
    const PLAIN: Self = Self { log_w: None, keep: 1.0, rollout: None, phi: 1.0 };
}

/// What a row's terms need from the whole batch.
#[derive(Debug, Clone)]
struct BatchContext {
    /// `top_entropy_quantile < 1`: rows below this entropy take no part in the policy term.
    entropy_threshold: Option<f64>,
    /// `entropy_bonus: masked_mean`: the number of rows the bonus averages over (at least 1).
    bonus_rows: f64,
    sequences: Vec<SequenceContext>,
    /// `kl_cov` / `clip_cov`: the rows the covariance selection picked.
    selected: Vec<bool>,
}

/// GRPO prepared for a batch: normalisers, per-sequence counts and (when row-local) the context.
pub(crate) struct Grpo<'a> {
    inputs: PolicyInputs<'a>,
    rows: Rows<'a>,
    options: &'a LossOptions,
    norm: Normalisers,
    shard: Option<BatchShard>,
    /// Unmasked rows per sequence, at least 1.
    counts: Vec<f64>,
    /// The context, when it needs no row statistics.
    fixed: Option<BatchContext>,
}

impl<'a> Grpo<'a> {
    pub fn new(
        inputs: PolicyInputs<'a>,
        rows: Rows<'a>,
        options: &'a LossOptions,
        norm: Normalisers,
        shard: Option<BatchShard>,
        active: &[bool],
    ) -> Self {
        let t = rows.seq_len;
        let counts =
            (0..rows.batch).map(|b| active[b * t..(b + 1) * t].iter().filter(|&&a| a).count().max(1) as f64).collect();
        let mut grpo = Self { inputs, rows, options, norm, shard, counts, fixed: None };
        if grpo.is_row_local() {
            grpo.fixed = Some(grpo.context(active, None));
        }
        grpo
    }

    /// Whether every row's loss depends on that row's statistics alone.
    pub fn is_row_local(&self) -> bool {
        let o = self.options;
        let threshold_known =
            o.top_entropy_quantile >= 1.0 || self.shard.is_some_and(|s| s.entropy_threshold.is_some());
        let bonus_known = o.entropy_bonus == EntropyBonus::Token
            || o.entropy_coef == 0.0
            || o.top_entropy_quantile >= 1.0
            || self.shard.is_some_and(|s| s.global_bonus_rows.is_some());
        let rollout_known =
            self.rollout_correction().is_none_or(|mode| !mode.per_sequence()) || self.inputs.old_logp.is_some();
        o.importance_sampling_level == ImportanceSamplingLevel::Token
            && !matches!(o.loss_type, LossType::Vespo | LossType::GeoMean | LossType::KlCov | LossType::ClipCov)
            && o.off_policy_mask_threshold.is_none()
            && threshold_known
            && bonus_known
            && rollout_known
    }

    /// The rollout correction's mode, when it applies (`sampling_logp` given, correction on).
    fn rollout_correction(&self) -> Option<RolloutCorrection> {
        (self.inputs.sampling_logp.is_some() && self.options.vllm_importance_sampling_correction)
            .then_some(self.options.vllm_importance_sampling_mode)
    }

    /// The old policy's log-probability of a row (`logp` itself, detached, when on-policy).
    fn old(&self, row: usize, logp: f64) -> f64 {
        self.inputs.old_logp.map_or(logp, |old| old[row] as f64)
    }

    /// `old - sampling` of a row (0 where the sampler gave NaN), the rollout correction's log-ratio.
    fn rollout_log_ratio(&self, row: usize, logp: f64) -> f64 {
        let sampling = self.inputs.sampling_logp.map_or(f64::NAN, |s| s[row] as f64);
        let diff = self.old(row, logp) - sampling;
        if diff.is_nan() {
            0.0
        } else {
            diff
        }
    }

    /// The batch and sequence context. `stats` is `None` when only the inputs are needed
    /// (row-local objectives); then `logp` stands in as its own detached old value.
    fn context(&self, active: &[bool], stats: Option<&[RowStats]>) -> BatchContext {
        let o = self.options;
        let logp = |i: usize| stats.map_or(0.0, |s| s[i].logp.unwrap_or(0.0));
        let (entropy_threshold, bonus_rows) = high_entropy_counts(o, self.shard, active, self.norm.valid_rows, |i| {
            stats.expect("a batch-local entropy threshold needs the statistics")[i].entropy
        });
        let t_len = self.rows.seq_len;
        let sequences: Vec<SequenceContext> = (0..self.rows.batch)
            .map(|b| {
                let on: Vec<usize> = (b * t_len..(b + 1) * t_len).filter(|&i| active[i]).collect();
                let advantage = self.inputs.advantages[b] as f64;
                let log_ratio = |i: usize| logp(i) - self.old(i, logp(i));
                let mut seq = SequenceContext::PLAIN;
                if o.importance_sampling_level == ImportanceSamplingLevel::Sequence {
                    seq.log_w = Some(ordered_sum(on.iter().map(|&i| log_ratio(i))) / self.counts[b]);
                }
                if let Some(threshold) = o.off_policy_mask_threshold {
                    // Forward KL of the sampler against the current policy, detached.
                    let kl = |i: usize| {
                        let sampling = self.inputs.sampling_logp.map_or(self.old(i, logp(i)), |s| s[i] as f64);
                        let d = sampling - logp(i);
                        if d.is_nan() {
                            0.0
                        } else {
                            d
                        }
                    };
                    let mean_kl = ordered_sum(on.iter().map(|&i| kl(i))) / self.counts[b];
                    seq.keep = if advantage >= 0.0 || mean_kl <= threshold { 1.0 } else { 0.0 };
                }
                if self.rollout_correction().is_some_and(RolloutCorrection::per_sequence) {
                    let sum = ordered_sum(on.iter().map(|&i| self.rollout_log_ratio(i, logp(i))));
                    seq.rollout = Some(bound_ratio(o, sum.exp()));
                }
                if o.loss_type == LossType::Vespo {
                    let mut sum = ordered_sum(on.iter().map(|&i| log_ratio(i).clamp(-20.0, 20.0)));
                    let lower = 1e-8f64.ln();
                    match (self.inputs.is_ratio, self.rollout_correction()) {
                        (Some(IsRatio::PerSequence(v)), _) => sum += (v[b] as f64).ln().clamp(lower, 20.0),
                        (Some(IsRatio::PerToken(v)), _) => {
                            sum += ordered_sum(on.iter().map(|&i| (v[i] as f64).ln().clamp(lower, 20.0)))
                        }
                        (None, Some(_)) => {
                            let ratio = |i: usize| bound_ratio(o, self.rollout_log_ratio(i, logp(i)).exp());
                            sum += ordered_sum(on.iter().map(|&i| ratio(i).ln().clamp(lower, 20.0)));
                        }
                        (None, None) => {}
                    }
                    seq.phi = vespo_phi(o, sum, advantage);
                }
                seq
            })
            .collect();
        let selected = match (o.loss_type, stats) {
            (LossType::KlCov | LossType::ClipCov, Some(stats)) => {
                let logp: Vec<f64> = stats.iter().map(|s| s.logp.unwrap_or(0.0)).collect();
                let log_w: Vec<f64> = (0..active.len())
                    .map(|i| sequences[i / t_len].log_w.unwrap_or_else(|| logp[i] - self.old(i, logp[i])))
                    .collect();
                covariance_selection(o, t_len, active, self.inputs.advantages, &logp, &log_w)
            }
            _ => Vec::new(),
        };
        BatchContext { entropy_threshold, bonus_rows, sequences, selected }
    }

    /// The reduction weight of an unmasked row.
    fn weight(&self, row: usize) -> f64 {
        let n = &self.norm;
        match self.options.aggregation() {
            Aggregation::SequenceMean => 1.0 / (n.batch * self.counts[row / self.rows.seq_len]),
            Aggregation::SequenceSum => 1.0 / n.batch,
            Aggregation::BatchTimesLength => 1.0 / (n.batch * n.max_completion_length),
            Aggregation::TokenMean => 1.0 / n.valid_rows.max(1.0),
            Aggregation::NumItems => 1.0 / n.num_items.max(1.0),
            // verl: a row belongs to a sequence with tokens, so the count is at least 1.
            Aggregation::SeqMeanTokenMean => {
                1.0 / ((self.counts[row / self.rows.seq_len] + 1e-8) * n.sequences_with_tokens.max(1.0))
            }
            Aggregation::SeqMeanTokenSum => 1.0 / n.sequences_with_tokens.max(1.0),
            Aggregation::SeqMeanTokenSumNorm => 1.0 / n.max_completion_length,
            Aggregation::TokenSum => 1.0,
        }
    }

    /// The weight of a row's policy term from `is_ratio` or the rollout correction (vespo takes
    /// them into `phi` instead).
    fn policy_weight(&self, row: usize, logp: f64, seq: &SequenceContext) -> f64 {
        if self.options.loss_type == LossType::Vespo {
            return 1.0;
        }
        if let Some(is_ratio) = self.inputs.is_ratio {
            return is_ratio.at(row, self.rows.seq_len) as f64;
        }
        match (self.rollout_correction(), seq.rollout) {
            (_, Some(r)) => r,
            (Some(_), None) => bound_ratio(self.options, self.rollout_log_ratio(row, logp).exp()),
            (None, None) => 1.0,
        }
    }

    fn token_terms(&self, row: usize, stats: &RowStats, ctx: &BatchContext, log_w: f64) -> TokenTerms {
        let o = self.options;
        let b = row / self.rows.seq_len;
        let seq = &ctx.sequences[b];
        let (logp, entropy) = (stats.logp.unwrap_or(0.0), stats.entropy);
        let advantage = self.inputs.advantages[b] as f64;
        let selected = ctx.selected.get(row).copied().unwrap_or(false);
        let (mut loss, mut d_logp, mut d_log_w, clipped) = policy_term(o, logp, log_w, advantage, seq.phi, selected);
        let trained = trains(ctx.entropy_threshold, entropy);
        let k = seq.keep * if trained { 1.0 } else { 0.0 } * self.policy_weight(row, logp, seq);
        loss *= k;
        d_logp *= k;
        d_log_w *= k;
        let mut kl = 0.0;
        if let Some(ref_logp) = self.inputs.ref_logp {
            let (value, d_value) = kl_estimate(o.kl_loss_type, logp, ref_logp[row] as f64);
            let (value, d_value_logp, d_value_log_w) = if o.use_bias_correction_kl {
                let r = log_w.exp();
                (value * r, d_value * r, value * r)
            } else {
                (value, d_value, 0.0)
            };
            kl = value;
            if o.beta != 0.0 {
                loss += o.beta * value;
                d_logp += o.beta * d_value_logp;
                d_log_w += o.beta * d_value_log_w;
            }
        }
        if o.entropy_bonus == EntropyBonus::Token {
            loss -= o.entropy_coef * entropy;
        }
        TokenTerms { loss, kl, clipped, d_logp, d_log_w }
    }

    /// The masked-mean entropy bonus's `d total / d H` of a row (0 when the bonus is per token).
    fn mean_bonus(&self, row_entropy: f64, ctx: &BatchContext) -> f64 {
        let o = self.options;
        let trained = trains(ctx.entropy_threshold, row_entropy);
        if o.entropy_bonus == EntropyBonus::MaskedMean && trained {
            -o.entropy_coef / ctx.bonus_rows
        } else {
            0.0
        }
    }

    fn log_ratio(&self, row: usize, stats: &RowStats) -> f64 {
        self.inputs.old_logp.map_or(0.0, |old| stats.logp.unwrap_or(0.0) - old[row] as f64)
    }

    /// One unmasked row, given its log importance weight; the gradient through `log_w` is
    /// returned separately (already weighted) so a sequence can share it.
    fn row_with(&self, row: usize, stats: &RowStats, ctx: &BatchContext, log_w: f64) -> (RowOutcome, f64, f64) {
        let t = self.token_terms(row, stats, ctx, log_w);
        let w = self.weight(row);
        let bonus = self.mean_bonus(stats.entropy, ctx);
        let outcome = RowOutcome {
            loss: t.loss,
            weighted_loss: w * t.loss + bonus * stats.entropy,
            kl: t.kl,
            clipped: t.clipped,
            grad: RowGradient::ZERO,
        };
        (outcome, w * t.d_logp, w * t.d_log_w)
    }

    /// A row's gradient scalars from its `d total / d logp` (already weighted); its entropy terms
    /// are weighted here, times `upstream`.
    fn gradient(&self, row: usize, stats: &RowStats, ctx: &BatchContext, d_logp: f64, upstream: f64) -> RowGradient {
        let mut terms = GradTerms::default();
        terms.logp(d_logp);
        let token_bonus = if self.options.entropy_bonus == EntropyBonus::Token {
            -self.options.entropy_coef * self.weight(row)
        } else {
            0.0
        };
        terms.entropy((token_bonus + self.mean_bonus(stats.entropy, ctx)) * upstream, stats.entropy);
        terms.finish(stats, self.options.temperature)
    }

    /// Row-local objectives only.
    pub fn row(&self, row: usize, stats: &RowStats) -> RowOutcome {
        self.row_times(row, stats, 1.0)
    }

    /// [`row`](Self::row), the row's gradient times `upstream`.
    fn row_times(&self, row: usize, stats: &RowStats, upstream: f64) -> RowOutcome {
        let ctx = self.fixed.as_ref().expect("row() is for row-local objectives");
        let (mut outcome, d_logp, d_log_w) = self.row_with(row, stats, ctx, self.log_ratio(row, stats));
        outcome.grad = self.gradient(row, stats, ctx, (d_logp + d_log_w) * upstream, upstream);
        outcome
    }

    /// Every row. At sequence level (GSPO) the log-weight is the masked mean of the sequence's
    /// log-ratios, and its gradient is shared evenly by the sequence's unmasked rows.
    ///
    /// With `upstream`, the gradients are those of the reduced loss with each row's weight times
    /// `upstream[i]` (a per-token loss back-propagated with a per-token upstream gradient): each
    /// row's own terms times its upstream, and at sequence level the shared `d/dlog_w` the
    /// upstream-weighted sum of the sequence's rows' (as Liger-Kernel's sequence-level backward,
    /// whose policy term takes the sum of a sequence's upstream and its bias-corrected KL the
    /// upstream-weighted sum of the KL). Not for `geo_mean`, whose rows share one sequence term
    /// ([`super::check_upstream`] refuses it).
    pub fn all(&self, active: &[bool], stats: &[RowStats], upstream: Option<&[f32]>) -> Vec<RowOutcome> {
        let up = |i: usize| upstream.map_or(1.0, |u| u[i] as f64);
        if self.is_row_local() {
            return each_active_row(active, |i| self.row_times(i, &stats[i], up(i)));
        }
        let ctx = self.context(active, Some(stats));
        if self.options.loss_type == LossType::GeoMean {
            debug_assert!(upstream.is_none(), "geo_mean's rows share one sequence term");
            return self.geo_mean(active, stats, &ctx);
        }
        let t_len = self.rows.seq_len;
        let mut outcomes = vec![RowOutcome::ZERO; stats.len()];
        if t_len == 0 {
            return outcomes;
        }
        // One sequence's rows depend on each other (its shared d/dlog_w), sequences do not.
        let sequences = outcomes.par_chunks_mut(t_len).enumerate().with_min_len(sequences_per_task(t_len));
        sequences.for_each(|(b, sequence)| {
            let first = b * t_len;
            let on: Vec<usize> = (first..first + t_len).filter(|&i| active[i]).collect();
            let seq_log_w = ctx.sequences[b].log_w;
            let parts: Vec<(usize, RowOutcome, f64, f64)> = on
                .iter()
                .map(|&i| {
                    let log_w = seq_log_w.unwrap_or_else(|| self.log_ratio(i, &stats[i]));
                    let (o, d_logp, d_log_w) = self.row_with(i, &stats[i], &ctx, log_w);
                    (i, o, d_logp * up(i), d_log_w * up(i))
                })
                .collect();
            // At token level each row keeps its own d/dlog_w; at sequence level it is shared.
            let shared = seq_log_w.map(|_| ordered_sum(parts.iter().map(|p| p.3)) / self.counts[b]);
            for (i, mut o, d_logp, d_log_w) in parts {
                o.grad = self.gradient(i, &stats[i], &ctx, d_logp + shared.unwrap_or(d_log_w), up(i));
                sequence[i - first] = o;
            }
        });
        outcomes
    }

    /// verl's `geo_mean` (GMPO): one term per sequence, `-A * exp(sum_t x_t / (n + 1e-8))` with
    /// `x_t = sgn(A) * min(sgn(A) * l_t, sgn(A) * clamp(l_t, -epsilon_low, epsilon_high))` and
    /// `l_t = logp_t - old_t`, over the `n` tokens the policy term trains on, averaged over the
    /// batch's sequences; the KL and the entropy bonus stay per token.
    fn geo_mean(&self, active: &[bool], stats: &[RowStats], ctx: &BatchContext) -> Vec<RowOutcome> {
        let o = self.options;
        let (t_len, batch) = (self.rows.seq_len, self.norm.batch);
        let mut outcomes = vec![RowOutcome::ZERO; stats.len()];
        for b in 0..self.rows.batch {
            let on: Vec<usize> = (b * t_len..(b + 1) * t_len).filter(|&i| active[i]).collect();
            let trained: Vec<usize> =
                on.iter().copied().filter(|&i| trains(ctx.entropy_threshold, stats[i].entropy)).collect();
            let seq = &ctx.sequences[b];
            let advantage = self.inputs.advantages[b] as f64;
            let sgn = if advantage > 0.0 {
                1.0
            } else if advantage < 0.0 {
                -1.0
            } else {
                0.0
            };
            let denom = trained.len() as f64 + 1e-8;
            // Each token's pessimistic log-ratio and its derivative, and whether the clamp won.
            let terms: Vec<(f64, f64, bool)> = trained
                .iter()
                .map(|&i| {
                    let l = self.log_ratio(i, &stats[i]);
                    let clamped = l.clamp(-o.epsilon_low, o.epsilon_high());
                    let passes = if (-o.epsilon_low..=o.epsilon_high()).contains(&l) { 1.0 } else { 0.0 };
                    let (u, v) = (sgn * l, sgn * clamped);
                    // verl's clip fraction: the clamp is active on a row with a signal.
                    (sgn * u.min(v), sgn * tie_split(u, v, sgn, sgn * passes), clamped != l && sgn != 0.0)
                })
                .collect();
            let ratio = (ordered_sum(terms.iter().map(|t| t.0)) / denom).exp();
            let mean_advantage = advantage * trained.len() as f64 / denom;
            let log_weights =
                trained.iter().map(|&i| (self.policy_weight(i, stats[i].logp.unwrap_or(0.0), seq) + 1e-10).ln());
            let is_weight = if self.inputs.is_ratio.is_some() || self.rollout_correction().is_some() {
                (ordered_sum(log_weights) / denom).exp()
            } else {
                1.0
            };
            let scale = seq.keep * is_weight;
            let loss = -mean_advantage * ratio * scale;
            let d_x = -mean_advantage * ratio * scale / denom / batch;
            let mut d_seq = vec![(0.0, false); t_len];
            for (&i, t) in trained.iter().zip(&terms) {
                d_seq[i - b * t_len] = (d_x * t.1, t.2);
            }
            for &i in &on {
                let (mut outcome, d_logp, d_log_w) = self.row_with(i, &stats[i], ctx, self.log_ratio(i, &stats[i]));
                let (d_policy, clipped) = d_seq[i - b * t_len];
                outcome.loss += loss;
                outcome.weighted_loss += loss / (batch * on.len() as f64);
                outcome.clipped = clipped;
                outcome.grad = self.gradient(i, &stats[i], ctx, d_logp + d_log_w + d_policy, 1.0);
                outcomes[i] = outcome;
            }
        }
        outcomes
    }
}

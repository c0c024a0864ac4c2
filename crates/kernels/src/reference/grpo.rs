//! The GRPO family in the reference: TRL's `compute_loss` (and verl's policy losses) written one
//! sequence at a time, generic over [`Real`] so that forward mode gives each row's derivatives.
//! A sequence's rows only interact through its own sums and the batch's detached quantities
//! (the entropy threshold, the bonus's row count, the covariance selection).

use super::dual::{clamp, torch_abs, torch_min, Real};
use super::{derivatives_of, ReferenceOutput, RowDerivatives, RowQ};
use crate::engine::LossSpec;
use crate::inputs::{IsRatio, Normalisers, PolicyInputs, Rows};
use crate::objective::trains;
use crate::options::{Aggregation, EntropyBonus, ImportanceSamplingLevel, KlEstimator, LossOptions, LossType};

/// The GRPO arm of the reference's `derive`: the loss, the per-token loss, `kl` and `is_clipped`
/// into `out`, and each active row's derivatives of the loss (each row's terms times
/// `upstream[i]`), from the rows' quantities `q`.
pub(super) fn derive(
    spec: LossSpec<'_>,
    inputs: &PolicyInputs,
    active: &[bool],
    q: &[RowQ<f64>],
    norm: Normalisers,
    upstream: Option<&[f32]>,
    out: &mut ReferenceOutput,
) -> Vec<RowDerivatives> {
    let (n, rows, options) = (q.len(), spec.rows, spec.options);
    let (entropy_threshold, bonus_rows) = Grpo::batch_quantities(options, spec.batch_shard, active, q, &norm);
    let selected = Grpo::covariance_selected(inputs, options, &rows, active, q);
    let g = Grpo { inputs, options, rows, active, norm, entropy_threshold, bonus_rows, selected, upstream };
    let (mut per_token, mut kl, mut clipped) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    let mut d = vec![RowDerivatives::default(); n];
    let unweighted = Grpo { upstream: None, ..g.clone() };
    for b in 0..rows.batch {
        let seq: Vec<RowQ<f64>> = q[b * rows.seq_len..(b + 1) * rows.seq_len].to_vec();
        let s = unweighted.sequence(b, &seq);
        out.loss += s.total;
        for t in 0..rows.seq_len {
            let i = b * rows.seq_len + t;
            per_token[i] = s.per_token[t];
            kl[i] = s.kl[t];
            clipped[i] = if s.clipped[t] { 1.0 } else { 0.0 };
            if active[i] {
                d[i] = derivatives_of(&seq, t, |x| g.sequence(b, x).total);
            }
        }
    }
    out.per_token_loss = per_token;
    out.kl = Some(kl);
    out.is_clipped = Some(clipped);
    d
}

struct SequenceResult<S> {
    total: S,
    per_token: Vec<f64>,
    kl: Vec<f64>,
    clipped: Vec<bool>,
}

/// GRPO, one sequence at a time.
#[derive(Clone)]
struct Grpo<'a> {
    inputs: &'a PolicyInputs<'a>,
    options: &'a LossOptions,
    rows: Rows<'a>,
    active: &'a [bool],
    norm: Normalisers,
    /// `top_entropy_quantile < 1`: `torch.quantile` of the batch's unmasked entropies.
    entropy_threshold: Option<f64>,
    /// The masked-mean entropy bonus's divisor.
    bonus_rows: f64,
    /// `kl_cov` / `clip_cov`: the rows verl's covariance selection picks (detached).
    selected: Vec<bool>,
    /// Each row's term in the reduction times this ([`super::evaluate_with_upstream`]).
    upstream: Option<&'a [f32]>,
}

impl Grpo<'_> {
    /// The batch's detached quantities, as TRL computes them.
    fn batch_quantities(
        options: &LossOptions,
        shard: Option<crate::inputs::BatchShard>,
        active: &[bool],
        q: &[RowQ<f64>],
        norm: &Normalisers,
    ) -> (Option<f64>, f64) {
        crate::objective::high_entropy_counts(options, shard, active, norm.valid_rows, |i| q[i].entropy)
    }

    /// verl's covariance selection on the detached log-probabilities and log-ratios.
    fn covariance_selected(
        inputs: &PolicyInputs,
        options: &LossOptions,
        rows: &Rows,
        active: &[bool],
        q: &[RowQ<f64>],
    ) -> Vec<bool> {
        if !matches!(options.loss_type, LossType::KlCov | LossType::ClipCov) {
            return vec![false; active.len()];
        }
        let t_len = rows.seq_len;
        let logp: Vec<f64> = q.iter().map(|r| r.logp).collect();
        let log_ratio = |i: usize| inputs.old_logp.map_or(0.0, |old| logp[i] - old[i] as f64);
        let log_w: Vec<f64> = (0..q.len())
            .map(|i| match options.importance_sampling_level {
                ImportanceSamplingLevel::Token => log_ratio(i),
                ImportanceSamplingLevel::Sequence => {
                    let b = i / t_len;
                    let on: Vec<usize> = (b * t_len..(b + 1) * t_len).filter(|&j| active[j]).collect();
                    on.iter().map(|&j| log_ratio(j)).sum::<f64>() / (on.len() as f64).max(1.0)
                }
            })
            .collect();
        crate::objective::covariance_selection(options, t_len, active, inputs.advantages, &logp, &log_w)
    }

    /// Sequence `b`'s contribution to the loss, TRL's `compute_loss` restricted to one sequence:
    /// its tokens' terms, verl's geometric-mean sequence term, the reduction, the masked-mean
    /// entropy bonus.
    fn sequence<S: Real>(&self, b: usize, q: &[RowQ<S>]) -> SequenceResult<S> {
        let c = S::constant;
        let seq = Sequence::new(self, b, q);
        let mut result = SequenceResult {
            total: c(0.0),
            per_token: vec![0.0; q.len()],
            kl: vec![0.0; q.len()],
            clipped: vec![false; q.len()],
        };
        let (mut sum, mut bonus) = (c(0.0), c(0.0));
        for &t in &seq.on {
            let per_token = seq.token_loss(t, &mut result);
            if self.options.entropy_bonus == EntropyBonus::MaskedMean && seq.trained(t) {
                bonus = bonus + q[t].entropy * c(seq.up(t));
            }
            result.per_token[t] = per_token.value();
            sum = sum + per_token * c(seq.up(t));
        }
        if self.options.loss_type == LossType::GeoMean {
            result.total = seq.geo_mean(&mut result);
        }
        result.total = result.total + seq.reduced(sum) - c(self.options.entropy_coef) * bonus / c(self.bonus_rows);
        result
    }
}

/// One sequence's view for [`Grpo::sequence`]: its rows that take part, its mean log-ratio (which
/// carries derivatives) and its detached per-sequence quantities (rollout correction, off-policy
/// mask, vespo's phi).
struct Sequence<'g, 'q, S> {
    g: &'g Grpo<'g>,
    b: usize,
    q: &'q [RowQ<S>],
    /// The positions that take part.
    on: Vec<usize>,
    /// Their number, at least 1.
    count: f64,
    advantage: f64,
    /// The mean log-ratio (sequence-level importance sampling).
    seq_log_w: S,
    /// Whether vLLM's importance-sampling correction applies.
    correction: bool,
    /// The bounded per-sequence rollout correction.
    seq_rollout: f64,
    /// The off-policy mask: 0 or 1.
    keep: f64,
    /// vespo's `phi`.
    phi: f64,
}

impl<'g, 'q, S: Real> Sequence<'g, 'q, S> {
    fn new(g: &'g Grpo<'g>, b: usize, q: &'q [RowQ<S>]) -> Self {
        let t_len = g.rows.seq_len;
        let on: Vec<usize> = (0..t_len).filter(|&t| g.active[b * t_len + t]).collect();
        let count = (on.len() as f64).max(1.0);
        let o = g.options;
        let correction = g.inputs.sampling_logp.is_some() && o.vllm_importance_sampling_correction;
        let mut seq = Self {
            g,
            b,
            q,
            count,
            advantage: g.inputs.advantages[b] as f64,
            seq_log_w: S::constant(0.0),
            correction,
            seq_rollout: 0.0,
            keep: 1.0,
            phi: 0.0,
            on,
        };
        seq.seq_log_w = seq.on.iter().fold(S::constant(0.0), |acc, &t| acc + seq.log_ratio(t)) / S::constant(count);
        seq.seq_rollout = seq.bound(seq.on.iter().map(|&t| seq.rollout_diff(t)).sum::<f64>().exp());
        seq.keep = seq.off_policy_keep();
        seq.phi = seq.vespo_phi();
        seq
    }

    fn idx(&self, t: usize) -> usize {
        self.b * self.g.rows.seq_len + t
    }

    fn up(&self, t: usize) -> f64 {
        self.g.upstream.map_or(1.0, |u| u[self.idx(t)] as f64)
    }

    fn old(&self, t: usize) -> S {
        self.g.inputs.old_logp.map_or(self.q[t].logp.detach(), |old| S::constant(old[self.idx(t)] as f64))
    }

    fn log_ratio(&self, t: usize) -> S {
        self.q[t].logp - self.old(t)
    }

    fn log_w(&self, t: usize) -> S {
        match self.g.options.importance_sampling_level {
            ImportanceSamplingLevel::Token => self.log_ratio(t),
            ImportanceSamplingLevel::Sequence => self.seq_log_w,
        }
    }

    fn sampling(&self, t: usize) -> Option<f64> {
        self.g.inputs.sampling_logp.map(|s| s[self.idx(t)] as f64)
    }

    fn rollout_diff(&self, t: usize) -> f64 {
        nan_to_zero(self.old(t).value() - self.sampling(t).unwrap_or(f64::NAN))
    }

    fn bound(&self, r: f64) -> f64 {
        crate::objective::bound_ratio(self.g.options, r)
    }

    /// The importance-sampling weight of token `t` (given, or vLLM's correction, else 1).
    fn is_weight(&self, t: usize) -> f64 {
        let o = self.g.options;
        if let Some(is_ratio) = self.g.inputs.is_ratio {
            is_ratio.at(self.idx(t), self.g.rows.seq_len) as f64
        } else if self.correction && o.vllm_importance_sampling_mode.per_sequence() {
            self.seq_rollout
        } else if self.correction {
            self.bound(self.rollout_diff(t).exp())
        } else {
            1.0
        }
    }

    /// The off-policy mask: 0 for a sequence with a negative advantage whose mean KL to the
    /// sampler (to the old log-probabilities without `sampling_logp`) is above the threshold.
    fn off_policy_keep(&self) -> f64 {
        self.g.options.off_policy_mask_threshold.map_or(1.0, |threshold| {
            let kl = |t: usize| nan_to_zero(self.sampling(t).unwrap_or(self.old(t).value()) - self.q[t].logp.value());
            let mean = self.on.iter().map(|&t| kl(t)).sum::<f64>() / self.count;
            if self.advantage >= 0.0 || mean <= threshold {
                1.0
            } else {
                0.0
            }
        })
    }

    fn vespo_phi(&self) -> f64 {
        let log_is = |x: f64| x.ln().clamp(1e-8f64.ln(), 20.0);
        let log_ratios: f64 = self.on.iter().map(|&t| self.log_ratio(t).value().clamp(-20.0, 20.0)).sum();
        let log_is_ratios = match (self.g.inputs.is_ratio, self.correction) {
            (Some(IsRatio::PerSequence(v)), _) => log_is(v[self.b] as f64),
            (Some(IsRatio::PerToken(_)), _) | (None, true) => self.on.iter().map(|&t| log_is(self.is_weight(t))).sum(),
            (None, false) => 0.0,
        };
        crate::objective::vespo_phi(self.g.options, log_ratios + log_is_ratios, self.advantage)
    }

    /// Whether token `t`'s entropy is at or above the entropy threshold (always, without one): the
    /// policy term trains on it.
    fn trained(&self, t: usize) -> bool {
        trains(self.g.entropy_threshold, self.q[t].entropy.value())
    }

    /// Token `t`'s loss: the policy term, masked and weighted, the KL penalty and the per-token
    /// entropy bonus; its `kl` and `clipped` go to `result`.
    fn token_loss(&self, t: usize, result: &mut SequenceResult<S>) -> S {
        let (c, o, q) = (S::constant, self.g.options, self.q);
        let coef_1 = self.log_w(t).exp();
        let mut per_token = self.policy_term(t, coef_1);
        result.clipped[t] = self.clipped(t, coef_1.value());
        per_token = per_token * c(self.keep) * c(if self.trained(t) { 1.0 } else { 0.0 });
        if o.loss_type != LossType::Vespo {
            per_token = per_token * c(self.is_weight(t));
        }
        if let Some(ref_logp) = self.g.inputs.ref_logp {
            let mut kl = kl_estimator(o.kl_loss_type, q[t].logp, c(ref_logp[self.idx(t)] as f64));
            if o.use_bias_correction_kl {
                kl = kl * coef_1;
            }
            result.kl[t] = kl.value();
            if o.beta != 0.0 {
                per_token = per_token + c(o.beta) * kl;
            }
        }
        if o.entropy_bonus == EntropyBonus::Token {
            per_token = per_token - c(o.entropy_coef) * q[t].entropy;
        }
        per_token
    }

    /// The loss type's policy term of token `t`, with `coef_1` its importance ratio.
    fn policy_term(&self, t: usize, coef_1: S) -> S {
        let (c, o, q) = (S::constant, self.g.options, self.q);
        let a = c(self.advantage);
        let selected = self.g.selected[self.idx(t)];
        match o.loss_type {
            LossType::Cispo => -clamp(coef_1, None, Some(o.epsilon_high())).detach() * a * q[t].logp,
            LossType::Sapo => {
                let tau = if self.advantage > 0.0 { o.sapo_temperature_pos } else { o.sapo_temperature_neg };
                -((c(tau) * (coef_1 - c(1.0))).sigmoid() * c(4.0 / tau)) * a
            }
            LossType::Vespo => -c(self.phi) * a * q[t].logp,
            LossType::KlCov => {
                let pg = -coef_1 * a;
                if selected {
                    pg + c(o.ppo_kl_coef) * torch_abs(self.log_w(t))
                } else {
                    pg
                }
            }
            LossType::Gpg => -a * q[t].logp,
            // The sequence's term is added after the tokens' loop (`Self::geo_mean`).
            LossType::GeoMean => c(0.0),
            _ => {
                let coef_2 = clamp(coef_1, Some(1.0 - o.epsilon_low), Some(1.0 + o.epsilon_high()));
                let coef_1 = clamp(coef_1, None, o.delta);
                let loss = -torch_min(coef_1 * a, coef_2 * a);
                let loss = match o.clip_ratio_c {
                    Some(cc) if self.advantage < 0.0 => torch_min(loss, c(-self.advantage * cc)),
                    _ => loss,
                };
                // verl's clip_cov: `corr` is 0 on the selected rows.
                if o.loss_type == LossType::ClipCov && selected {
                    loss * c(0.0)
                } else {
                    loss
                }
            }
        }
    }

    /// Whether token `t`, of importance ratio `r`, counts as clipped for its loss type.
    fn clipped(&self, t: usize, r: f64) -> bool {
        let o = self.g.options;
        let (lo, hi) = (1.0 - o.epsilon_low, 1.0 + o.epsilon_high());
        match o.loss_type {
            LossType::Cispo => r > o.epsilon_high() && self.advantage > 0.0,
            LossType::KlCov | LossType::ClipCov => self.g.selected[self.idx(t)],
            LossType::Vespo | LossType::Gpg | LossType::GeoMean => false,
            _ => (r < lo && self.advantage < 0.0) || (r > hi && self.advantage > 0.0),
        }
    }

    /// verl's `compute_policy_loss_geo_mean`, over the tokens the policy term trains on: the
    /// sequence's term divided by the batch. The whole (undivided) term is added to the per-token
    /// loss of every token that takes part, and the trained tokens' clipping goes to `result`.
    fn geo_mean(&self, result: &mut SequenceResult<S>) -> S {
        let (c, o) = (S::constant, self.g.options);
        let trained: Vec<usize> = self.on.iter().copied().filter(|&t| self.trained(t)).collect();
        let denom = trained.len() as f64 + 1e-8;
        let sgn = c(if self.advantage > 0.0 {
            1.0
        } else if self.advantage < 0.0 {
            -1.0
        } else {
            0.0
        });
        let mut sum_min = c(0.0);
        for &t in &trained {
            let l = self.log_ratio(t);
            let l_clamp = clamp(l, Some(-o.epsilon_low), Some(o.epsilon_high()));
            let (u, v) = (sgn * l, sgn * l_clamp);
            result.clipped[t] = l.value() != l_clamp.value() && self.advantage != 0.0;
            sum_min = sum_min + sgn * torch_min(u, v);
        }
        let ratio = (sum_min / c(denom)).exp();
        let mean_advantage = c(self.advantage * trained.len() as f64 / denom);
        let mut seq_loss = -mean_advantage * ratio * c(self.keep);
        if self.g.inputs.is_ratio.is_some() || self.correction {
            let log_w: f64 = trained.iter().map(|&t| (self.is_weight(t) + 1e-10).ln()).sum();
            seq_loss = seq_loss * c((log_w / denom).exp());
        }
        for &t in &self.on {
            result.per_token[t] += seq_loss.value();
        }
        seq_loss / c(self.g.norm.batch)
    }

    /// The sequence's summed token terms under the loss type's reduction.
    fn reduced(&self, sum: S) -> S {
        let (c, n) = (S::constant, &self.g.norm);
        match self.g.options.aggregation() {
            Aggregation::SequenceMean => sum / c(self.count) / c(n.batch),
            Aggregation::SequenceSum => sum / c(n.batch),
            Aggregation::BatchTimesLength => sum / c(n.batch * n.max_completion_length),
            Aggregation::TokenMean => sum / c(n.valid_rows.max(1.0)),
            Aggregation::NumItems => sum / c(n.num_items.max(1.0)),
            // verl's agg_loss: empty sequences are excluded from the mean (their sum is 0 anyway).
            Aggregation::SeqMeanTokenMean => sum / c(self.on.len() as f64 + 1e-8) / c(n.sequences_with_tokens.max(1.0)),
            Aggregation::SeqMeanTokenSum => sum / c(n.sequences_with_tokens.max(1.0)),
            Aggregation::SeqMeanTokenSumNorm => sum / c(n.max_completion_length),
            Aggregation::TokenSum => sum,
        }
    }
}

fn nan_to_zero(x: f64) -> f64 {
    if x.is_nan() {
        0.0
    } else {
        x
    }
}

/// The KL estimators, in verl's code shape (`kl_penalty_forward`), with `kl = ref - logp`.
fn kl_estimator<S: Real>(estimator: KlEstimator, logp: S, ref_logp: S) -> S {
    let c = S::constant;
    match estimator {
        KlEstimator::K3 => (ref_logp - logp).exp() - (ref_logp - logp) - c(1.0),
        KlEstimator::LowVarKl => {
            let kl = clamp(ref_logp - logp, Some(-20.0), Some(20.0));
            let kld = kl.exp() - kl - c(1.0);
            clamp(kld, Some(-10.0), Some(10.0))
        }
        KlEstimator::K1 => logp - ref_logp,
        KlEstimator::K2 => c(0.5) * (logp - ref_logp) * (logp - ref_logp),
        KlEstimator::Abs => torch_abs(logp - ref_logp),
    }
}

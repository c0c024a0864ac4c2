//! One options type for every loss, with the names and defaults of `spec/LOSSES.md`.
//!
//! Liger-Kernel spreads its options over 20+ positional arguments whose defaults differ between
//! layers; here there is one struct, one set of defaults, and one `validate` that every entry
//! point calls, so a bad value is rejected the same way whether it came from YAML, the command
//! line or Rust code.

use serde::{Deserialize, Serialize};

use crate::error::LossError;

/// How the per-token GRPO losses are reduced to one number, and which policy objective is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LossType {
    /// Mean over each sequence's tokens, then mean over sequences.
    Grpo,
    /// Sum over all tokens divided by the number of unmasked tokens.
    Bnpo,
    /// Sum over all tokens divided by `B * max_completion_length`.
    DrGrpo,
    /// Sum over all tokens divided by `num_items` (default: the number of unmasked tokens).
    #[default]
    Dapo,
    /// Clipped-importance-sampling policy gradient (MiniMax-M1), reduced like `dapo`.
    Cispo,
    /// Soft adaptive policy optimisation (sigmoid gate instead of a hard clip), reduced like `grpo`.
    Sapo,
    /// Length-unbiased sequence policy optimisation (TRL 1.16): the PPO surrogate, each sequence's
    /// token sum averaged over sequences (verl's `seq-mean-token-sum`).
    Luspo,
    /// Variance-controlled sequence policy optimisation (TRL 1.16): `-phi(w) * A * logp` with a
    /// detached gamma weight `phi` of the sequence's importance ratio, reduced like `dapo`.
    Vespo,
    /// verl's `gpg`: the plain policy gradient `-A * logp` (no ratio, no clip), reduced like `bnpo`.
    Gpg,
    /// verl's `geo_mean` (GMPO): `-A * exp(mean of the sequence's clipped log-ratios)`, one term
    /// per sequence, averaged over sequences.
    #[serde(alias = "gmpo")]
    GeoMean,
    /// verl's `kl_cov`: `-A * r`, plus `ppo_kl_coef * |log r|` on the `kl_cov_ratio` share of the
    /// batch's tokens with the largest covariance between advantage and `logp`; no clip.
    KlCov,
    /// verl's `clip_cov`: the PPO surrogate, with the gradient of a random `clip_cov_ratio` share
    /// of the tokens whose covariance lies in `(clip_cov_lb, clip_cov_ub)` cut.
    ClipCov,
}

impl LossType {
    /// Every accepted name, for error messages.
    pub const NAMES: &'static [&'static str] = &[
        "grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo", "gpg", "geo_mean", "kl_cov", "clip_cov",
    ];

    /// The PPO family shares the clipped surrogate `-min(r*A, clip(r)*A)`.
    pub fn is_ppo_family(self) -> bool {
        matches!(self, Self::Grpo | Self::Bnpo | Self::DrGrpo | Self::Dapo | Self::Luspo | Self::ClipCov)
    }

    /// The reduction each loss type uses unless `loss_agg_mode` overrides it.
    pub fn default_aggregation(self) -> Aggregation {
        match self {
            Self::Grpo | Self::Sapo | Self::GeoMean => Aggregation::SequenceMean,
            Self::Bnpo | Self::Gpg | Self::KlCov | Self::ClipCov => Aggregation::TokenMean,
            Self::DrGrpo => Aggregation::BatchTimesLength,
            Self::Dapo | Self::Cispo | Self::Vespo => Aggregation::NumItems,
            Self::Luspo => Aggregation::SequenceSum,
        }
    }
}

/// How per-token losses are reduced to one number: verl's `loss_agg_mode` values (what the option
/// accepts), TRL's `num_items` normaliser, and the reductions of TRL's loss types, which differ from
/// verl's in how they count sequences (TRL's `.mean()` counts every sequence, empty ones too; verl
/// excludes sequences without a token). Every mode divides by whole-batch counts, so
/// micro-batches and ranks that pass the global normalisers sum to the one-batch loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Aggregation {
    /// verl, and TRL's `bnpo`: sum over the unmasked tokens / their number.
    #[serde(rename = "token-mean")]
    TokenMean,
    /// verl: the token sums of the sequences that have tokens, averaged over those sequences.
    #[serde(rename = "seq-mean-token-sum")]
    SeqMeanTokenSum,
    /// verl: each sequence's token sum / (its tokens + 1e-8), averaged over the sequences that
    /// have tokens.
    #[serde(rename = "seq-mean-token-mean")]
    SeqMeanTokenMean,
    /// verl: the sum over all tokens / `loss_scale_factor` (here `max_completion_length`, default
    /// the batch's `T`); no division by the number of sequences.
    #[serde(rename = "seq-mean-token-sum-norm")]
    SeqMeanTokenSumNorm,
    /// TRL's `dapo` / `cispo` / `vespo`: the sum over all tokens / `max(1, num_items)` (default
    /// the unmasked tokens).
    #[serde(rename = "num-items")]
    NumItems,
    /// flashgrpo's: the plain sum over the unmasked tokens, no normaliser. The gradient is then
    /// that of each token's own loss, which a front end scales by a per-token upstream gradient
    /// (Liger's `triton_grpo_loss(reduce=False)`, whose per-token losses carry gradients).
    #[serde(rename = "token-sum")]
    TokenSum,
    /// TRL's `grpo` / `sapo`: each sequence's token sum / max(1, its tokens), averaged over all `B`.
    #[serde(skip)]
    SequenceMean,
    /// TRL's `luspo`: each sequence's token sum, averaged over all `B`.
    #[serde(skip)]
    SequenceSum,
    /// TRL's `dr_grpo`: the sum over all tokens / (`B` * `max_completion_length`).
    #[serde(skip)]
    BatchTimesLength,
}

/// Rollout correction (TRL's `vllm_importance_sampling_mode`): how the ratio between the training
/// policy's and the sampler's log-probabilities weights the policy term.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RolloutCorrection {
    /// Per token, clamped to `[clip_min, clip_max]`.
    TokenTruncate,
    /// Per token, 0 outside `[clip_min, clip_max]`.
    TokenMask,
    /// Per sequence (the product over its tokens), clamped.
    SequenceTruncate,
    /// Per sequence, 0 outside the bounds (TRL's default).
    #[default]
    SequenceMask,
}

impl RolloutCorrection {
    pub fn per_sequence(self) -> bool {
        matches!(self, Self::SequenceTruncate | Self::SequenceMask)
    }

    pub fn masks(self) -> bool {
        matches!(self, Self::TokenMask | Self::SequenceMask)
    }
}

/// The KL estimator of the `beta` penalty, with `d = ref_logp - logp` (verl's `kl_loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum KlEstimator {
    /// `exp(d) - d - 1`, unclamped (TRL, LOSSES.md).
    #[default]
    K3,
    /// verl's `low_var_kl` (its `k3`): `d` clamped to [-20, 20], the result to [-10, 10].
    LowVarKl,
    /// `logp - ref_logp` (verl's `kl`).
    K1,
    /// `(logp - ref_logp)^2 / 2` (verl's `mse`).
    K2,
    /// `|logp - ref_logp|`.
    Abs,
}

/// Where the entropy bonus sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum EntropyBonus {
    /// `- entropy_coef * H` per token, inside the loss type's reduction (LOSSES.md).
    #[default]
    Token,
    /// `- entropy_coef * (masked mean of H)` outside the loss type's normaliser, over the tokens
    /// the policy term trains on (TRL 1.16).
    MaskedMean,
}

/// Whether the importance ratio is taken per token or per sequence (GSPO).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ImportanceSamplingLevel {
    #[default]
    Token,
    Sequence,
}

/// Cross-entropy reduction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Reduction {
    /// Sum over unmasked rows divided by their count (0 when there are none).
    #[default]
    Mean,
    /// Sum over unmasked rows.
    Sum,
    /// No reduction: the per-token losses are the result; `loss` reports their sum and the
    /// gradient is that of the sum (a per-token upstream gradient of one, as in PyTorch's
    /// `loss.backward(torch.ones_like(loss))`).
    None,
}

/// Options of every loss. Field names, meanings and defaults are those of `spec/LOSSES.md`;
/// options that do not apply to an op are ignored by it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LossOptions {
    /// Logits are divided by this before the softmax (the sampling distribution).
    pub temperature: f64,
    /// Soft cap `c`: the logits become `c tanh(x / c)` before the temperature divides them
    /// (Gemma 2's final logit soft-capping, Liger's `softcap`); `None`: no cap.
    pub softcap: Option<f64>,
    /// Also report each row's predicted token, the first column of its largest logit (after the
    /// soft cap), in [`LossOutput::predicted`](crate::LossOutput::predicted): Liger's
    /// `return_predicted_tokens`, and with the targets its `return_token_accuracy`. Any op.
    pub predicted_tokens: bool,
    /// The entropy op only: also its gradient, of `loss` (the mean entropy over the rows that take
    /// part, or with `reduction` `sum` / `none` their sum; without this option `reduction` does not
    /// apply to the entropy op): verl's `FusedLinearForPPO` and Liger's
    /// fused-linear scaled cross-entropy hand back a differentiable entropy. Default false (the
    /// entropy op is a no-grad diagnostic).
    pub entropy_gradient: bool,
    /// Lower clip: `r_c = clip(r, 1 - epsilon_low, 1 + epsilon_high)`.
    pub epsilon_low: f64,
    /// Upper clip; `None` means equal to `epsilon_low`. For `cispo` it is the raw upper bound on `r`.
    pub epsilon_high: Option<f64>,
    /// Two-sided clipping (INTELLECT-2): the unclipped branch uses `min(r, delta)`.
    pub delta: Option<f64>,
    /// Weight of the k3 KL penalty against `ref_logp`.
    pub beta: f64,
    pub loss_type: LossType,
    pub importance_sampling_level: ImportanceSamplingLevel,
    /// Entropy bonus: the per-token loss gets `- entropy_coef * H`.
    pub entropy_coef: f64,
    /// Multiply the KL term by the (unclipped) importance ratio (DeepSeek-V3.2).
    pub use_bias_correction_kl: bool,
    /// `dr_grpo` normaliser; `None` means the sequence length `T` of the batch.
    pub max_completion_length: Option<usize>,
    /// `dapo` / `cispo` normaliser; `None` means the number of unmasked tokens.
    pub num_items: Option<f64>,
    pub sapo_temperature_pos: f64,
    pub sapo_temperature_neg: f64,
    /// Cross-entropy: rows whose target equals this are masked.
    pub ignore_index: i64,
    pub label_smoothing: f64,
    /// Cross-entropy: weight of `lse^2` (z-loss, PaLM / Liger's `lse_square_scale`).
    pub z_loss: f64,
    /// Cross-entropy: each row's loss and gradient times its own `p_y`, detached (Liger's
    /// `use_token_scaling`, the DFT loss).
    pub token_scaling: bool,
    pub reduction: Reduction,
    /// Overrides the loss type's reduction (verl's `loss_agg_mode`).
    pub loss_agg_mode: Option<Aggregation>,
    /// `vespo`: the gamma weight's shape `k` and rate `lambda` for `A >= 0` and `A < 0`.
    pub vespo_k_pos: f64,
    pub vespo_lambda_pos: f64,
    pub vespo_k_neg: f64,
    pub vespo_lambda_neg: f64,
    /// DeepSeek-V3.2's off-policy sequence mask: a sequence with `A < 0` whose mean
    /// `sampling_logp - logp` exceeds this takes no part in the policy term.
    pub off_policy_mask_threshold: Option<f64>,
    /// Train the policy term only on tokens whose entropy is at or above this quantile from the top
    /// of the batch's (1 = every token; 0.2 keeps the top 20%).
    pub top_entropy_quantile: f64,
    /// Rollout correction from `sampling_logp`, when that tensor is given.
    pub vllm_importance_sampling_correction: bool,
    pub vllm_importance_sampling_mode: RolloutCorrection,
    pub vllm_importance_sampling_clip_min: Option<f64>,
    pub vllm_importance_sampling_clip_max: Option<f64>,
    /// Dual-clip PPO (verl's `clip_ratio_c`): for `A < 0` the surrogate is at most `-c * A`.
    pub clip_ratio_c: Option<f64>,
    pub kl_loss_type: KlEstimator,
    /// `kl_cov`: the share of tokens penalised, and the penalty's weight.
    pub kl_cov_ratio: f64,
    pub ppo_kl_coef: f64,
    /// `clip_cov`: the share of tokens whose gradient is cut, the covariance window they are drawn
    /// from, and the seed of the draw (verl draws with torch's global generator).
    pub clip_cov_ratio: f64,
    pub clip_cov_lb: f64,
    pub clip_cov_ub: f64,
    pub clip_cov_seed: u64,
    pub entropy_bonus: EntropyBonus,
}

impl Default for LossOptions {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            softcap: None,
            predicted_tokens: false,
            entropy_gradient: false,
            epsilon_low: 0.2,
            epsilon_high: None,
            delta: None,
            beta: 0.0,
            loss_type: LossType::Dapo,
            importance_sampling_level: ImportanceSamplingLevel::Token,
            entropy_coef: 0.0,
            use_bias_correction_kl: false,
            max_completion_length: None,
            num_items: None,
            sapo_temperature_pos: 1.0,
            sapo_temperature_neg: 1.05,
            ignore_index: -100,
            label_smoothing: 0.0,
            z_loss: 0.0,
            token_scaling: false,
            reduction: Reduction::Mean,
            loss_agg_mode: None,
            vespo_k_pos: 2.0,
            vespo_lambda_pos: 3.0,
            vespo_k_neg: 3.0,
            vespo_lambda_neg: 2.0,
            off_policy_mask_threshold: None,
            top_entropy_quantile: 1.0,
            vllm_importance_sampling_correction: true,
            vllm_importance_sampling_mode: RolloutCorrection::SequenceMask,
            vllm_importance_sampling_clip_min: None,
            vllm_importance_sampling_clip_max: Some(3.0),
            clip_ratio_c: None,
            kl_loss_type: KlEstimator::K3,
            kl_cov_ratio: 0.0002,
            ppo_kl_coef: 0.1,
            clip_cov_ratio: 0.0002,
            clip_cov_lb: 1.0,
            clip_cov_ub: 5.0,
            clip_cov_seed: 0,
            entropy_bonus: EntropyBonus::Token,
        }
    }
}

impl LossOptions {
    /// The names of all options, in declaration order (for `--set` and config error messages).
    pub const NAMES: &'static [&'static str] = &[
        "temperature",
        "softcap",
        "predicted_tokens",
        "entropy_gradient",
        "epsilon_low",
        "epsilon_high",
        "delta",
        "beta",
        "loss_type",
        "importance_sampling_level",
        "entropy_coef",
        "use_bias_correction_kl",
        "max_completion_length",
        "num_items",
        "sapo_temperature_pos",
        "sapo_temperature_neg",
        "ignore_index",
        "label_smoothing",
        "z_loss",
        "token_scaling",
        "reduction",
        "loss_agg_mode",
        "vespo_k_pos",
        "vespo_lambda_pos",
        "vespo_k_neg",
        "vespo_lambda_neg",
        "off_policy_mask_threshold",
        "top_entropy_quantile",
        "vllm_importance_sampling_correction",
        "vllm_importance_sampling_mode",
        "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_clip_max",
        "clip_ratio_c",
        "kl_loss_type",
        "kl_cov_ratio",
        "ppo_kl_coef",
        "clip_cov_ratio",
        "clip_cov_lb",
        "clip_cov_ub",
        "clip_cov_seed",
        "entropy_bonus",
    ];

    /// `epsilon_high`, or `epsilon_low` when unset.
    pub fn epsilon_high(&self) -> f64 {
        self.epsilon_high.unwrap_or(self.epsilon_low)
    }

    /// The reduction in use: `loss_agg_mode`, or the loss type's own.
    pub fn aggregation(&self) -> Aggregation {
        self.loss_agg_mode.unwrap_or(self.loss_type.default_aggregation())
    }

    /// Rejects values that would silently produce nonsense (NaN losses, sign flips).
    pub fn validate(&self) -> Result<(), LossError> {
        self.validate_ranges()?;
        self.validate_importance_sampling()?;
        self.validate_combinations()
    }

    /// Each number in its own range.
    fn validate_ranges(&self) -> Result<(), LossError> {
        positive("temperature", self.temperature)?;
        if let Some(c) = self.softcap {
            // Applied in f32 (`cpu/softcap.rs`).
            if !(c > 0.0 && (c as f32).is_normal()) {
                return Err(bad("softcap", c, "a number > 0 in f32's normal range (1.2e-38 to 3.4e38)"));
            }
        }
        non_negative("epsilon_low", self.epsilon_low)?;
        if let Some(e) = self.epsilon_high {
            non_negative("epsilon_high", e)?;
        }
        if let Some(d) = self.delta {
            positive("delta", d)?;
        }
        non_negative("beta", self.beta)?;
        if !self.entropy_coef.is_finite() {
            return Err(bad("entropy_coef", self.entropy_coef, "finite"));
        }
        if self.max_completion_length == Some(0) {
            return Err(bad("max_completion_length", 0, "at least 1"));
        }
        if let Some(n) = self.num_items {
            non_negative("num_items", n)?;
        }
        positive("sapo_temperature_pos", self.sapo_temperature_pos)?;
        positive("sapo_temperature_neg", self.sapo_temperature_neg)?;
        if !(0.0..=1.0).contains(&self.label_smoothing) {
            return Err(bad("label_smoothing", self.label_smoothing, "in [0, 1]"));
        }
        non_negative("z_loss", self.z_loss)?;
        non_negative("vespo_k_pos", self.vespo_k_pos)?;
        non_negative("vespo_k_neg", self.vespo_k_neg)?;
        non_negative("vespo_lambda_pos", self.vespo_lambda_pos)?;
        non_negative("vespo_lambda_neg", self.vespo_lambda_neg)?;
        if let Some(t) = self.off_policy_mask_threshold {
            if !t.is_finite() {
                return Err(bad("off_policy_mask_threshold", t, "finite"));
            }
        }
        // TRL's range: 0 keeps only the highest-entropy token(s), 1 every token.
        if !(self.top_entropy_quantile >= 0.0 && self.top_entropy_quantile <= 1.0) {
            return Err(bad("top_entropy_quantile", self.top_entropy_quantile, "in [0, 1]"));
        }
        positive("kl_cov_ratio", self.kl_cov_ratio)?;
        positive("clip_cov_ratio", self.clip_cov_ratio)?;
        non_negative("ppo_kl_coef", self.ppo_kl_coef)?;
        if let Some(c) = self.clip_ratio_c {
            if !(c.is_finite() && c > 1.0) {
                return Err(bad("clip_ratio_c", c, "a finite number > 1 (verl asserts it)"));
            }
        }
        Ok(())
    }

    /// vLLM's importance-sampling correction: its bounds, and a bound where it truncates.
    fn validate_importance_sampling(&self) -> Result<(), LossError> {
        if let Some(v) = self.vllm_importance_sampling_clip_min {
            non_negative("vllm_importance_sampling_clip_min", v)?;
        }
        if let Some(v) = self.vllm_importance_sampling_clip_max {
            positive("vllm_importance_sampling_clip_max", v)?;
        }
        if let (Some(lo), Some(hi)) = (self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max) {
            if lo >= hi {
                return Err(bad("vllm_importance_sampling_clip_min", lo, "< vllm_importance_sampling_clip_max"));
            }
        }
        // As TRL's `GRPOConfig`: a truncating correction with no bound would clamp nothing.
        let truncates = !self.vllm_importance_sampling_mode.masks();
        let unbounded =
            self.vllm_importance_sampling_clip_min.is_none() && self.vllm_importance_sampling_clip_max.is_none();
        if self.vllm_importance_sampling_correction && truncates && unbounded {
            let rule = "set (or vllm_importance_sampling_clip_min) when vllm_importance_sampling_mode is \
                        token_truncate or sequence_truncate";
            return Err(bad("vllm_importance_sampling_clip_max", "None", rule));
        }
        Ok(())
    }

    /// Options checked together: the loss type against the reduction, and `clip_cov`'s bounds as
    /// a pair (each finite, the lower below the upper).
    fn validate_combinations(&self) -> Result<(), LossError> {
        let mixes_tokens = matches!(self.loss_type, LossType::GeoMean | LossType::KlCov | LossType::ClipCov);
        if self.loss_agg_mode == Some(Aggregation::TokenSum) && mixes_tokens {
            let rule =
                "another mode with loss_type geo_mean, kl_cov or clip_cov (their tokens' losses mix within a sequence)";
            return Err(bad("loss_agg_mode", "token-sum", rule));
        }
        if !(self.clip_cov_lb.is_finite() && self.clip_cov_ub.is_finite() && self.clip_cov_lb < self.clip_cov_ub) {
            return Err(bad("clip_cov_lb", self.clip_cov_lb, "finite and < clip_cov_ub"));
        }
        Ok(())
    }
}

/// The error for option `name` of `value`, which must be `rule`.
fn bad(name: &'static str, value: impl std::fmt::Display, rule: &str) -> LossError {
    LossError::InvalidOption { name, message: format!("got {value}, but it must be {rule}") }
}

fn positive(name: &'static str, v: f64) -> Result<(), LossError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(bad(name, v, "a finite number > 0"))
    }
}

fn non_negative(name: &'static str, v: f64) -> Result<(), LossError> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(bad(name, v, "a finite number >= 0"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_spec() {
        let o = LossOptions::default();
        assert_eq!(o.temperature, 1.0);
        assert_eq!(o.epsilon_low, 0.2);
        assert_eq!(o.epsilon_high(), 0.2);
        assert_eq!(o.delta, None);
        assert_eq!(o.beta, 0.0);
        assert_eq!(o.loss_type, LossType::Dapo);
        assert_eq!(o.importance_sampling_level, ImportanceSamplingLevel::Token);
        assert_eq!(o.sapo_temperature_pos, 1.0);
        assert_eq!(o.sapo_temperature_neg, 1.05);
        assert_eq!(o.ignore_index, -100);
        assert_eq!(o.reduction, Reduction::Mean);
        o.validate().unwrap();
    }

    #[test]
    fn names_cover_every_field() {
        let value = serde_saphyr::to_string(&LossOptions::default()).unwrap();
        for name in LossOptions::NAMES {
            assert!(value.contains(&format!("{name}:")), "{name} missing from {value}");
        }
        assert_eq!(value.lines().count(), LossOptions::NAMES.len());
    }

    #[test]
    fn yaml_round_trip_and_unknown_keys() {
        let o: LossOptions =
            serde_saphyr::from_str("beta: 0.04\nloss_type: dr_grpo\nepsilon_high: 0.28\ndelta: null\n").unwrap();
        assert_eq!(o.beta, 0.04);
        assert_eq!(o.loss_type, LossType::DrGrpo);
        assert_eq!(o.epsilon_high(), 0.28);
        let err = serde_saphyr::from_str::<LossOptions>("betta: 0.1\n").unwrap_err().to_string();
        assert!(err.contains("betta"), "{err}");
        let err = serde_saphyr::from_str::<LossOptions>("loss_type: ppo\n").unwrap_err().to_string();
        assert!(err.contains("ppo"), "{err}");
    }

    #[test]
    fn validation_names_the_option() {
        for (name, o) in [
            ("temperature", LossOptions { temperature: -1.0, ..Default::default() }),
            ("temperature", LossOptions { temperature: 0.0, ..Default::default() }),
            ("epsilon_low", LossOptions { epsilon_low: -0.1, ..Default::default() }),
            ("epsilon_high", LossOptions { epsilon_high: Some(f64::NAN), ..Default::default() }),
            ("delta", LossOptions { delta: Some(0.0), ..Default::default() }),
            ("beta", LossOptions { beta: -0.5, ..Default::default() }),
            ("label_smoothing", LossOptions { label_smoothing: 1.5, ..Default::default() }),
            ("sapo_temperature_neg", LossOptions { sapo_temperature_neg: 0.0, ..Default::default() }),
            ("max_completion_length", LossOptions { max_completion_length: Some(0), ..Default::default() }),
            ("top_entropy_quantile", LossOptions { top_entropy_quantile: -0.1, ..Default::default() }),
            ("top_entropy_quantile", LossOptions { top_entropy_quantile: 1.5, ..Default::default() }),
            ("clip_ratio_c", LossOptions { clip_ratio_c: Some(1.0), ..Default::default() }),
            ("kl_cov_ratio", LossOptions { kl_cov_ratio: 0.0, ..Default::default() }),
            ("clip_cov_lb", LossOptions { clip_cov_lb: 5.0, clip_cov_ub: 1.0, ..Default::default() }),
            (
                "vllm_importance_sampling_clip_min",
                LossOptions { vllm_importance_sampling_clip_min: Some(4.0), ..Default::default() },
            ),
            (
                "vllm_importance_sampling_clip_min",
                LossOptions { vllm_importance_sampling_clip_min: Some(3.0), ..Default::default() },
            ),
            (
                "vllm_importance_sampling_clip_max",
                LossOptions {
                    vllm_importance_sampling_mode: RolloutCorrection::TokenTruncate,
                    vllm_importance_sampling_clip_max: None,
                    ..Default::default()
                },
            ),
            (
                "loss_agg_mode",
                LossOptions {
                    loss_type: LossType::GeoMean,
                    loss_agg_mode: Some(Aggregation::TokenSum),
                    ..Default::default()
                },
            ),
        ] {
            let err = o.validate().unwrap_err().to_string();
            assert!(err.contains(name), "{err}");
        }
    }
}

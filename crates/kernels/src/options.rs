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
}

impl LossType {
    /// Every accepted name, for error messages.
    pub const NAMES: &'static [&'static str] = &["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"];

    /// The PPO family shares the clipped surrogate `-min(r*A, clip(r)*A)`.
    pub fn is_ppo_family(self) -> bool {
        matches!(self, Self::Grpo | Self::Bnpo | Self::DrGrpo | Self::Dapo)
    }
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
    pub reduction: Reduction,
}

impl Default for LossOptions {
    fn default() -> Self {
        Self {
            temperature: 1.0,
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
            reduction: Reduction::Mean,
        }
    }
}

impl LossOptions {
    /// The names of all options, in declaration order (for `--set` and config error messages).
    pub const NAMES: &'static [&'static str] = &[
        "temperature",
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
        "reduction",
    ];

    /// `epsilon_high`, or `epsilon_low` when unset.
    pub fn epsilon_high(&self) -> f64 {
        self.epsilon_high.unwrap_or(self.epsilon_low)
    }

    /// Rejects values that would silently produce nonsense (NaN losses, sign flips).
    pub fn validate(&self) -> Result<(), LossError> {
        fn bad(name: &'static str, value: impl std::fmt::Display, rule: &str) -> LossError {
            LossError::InvalidOption { name, message: format!("got {value}, but it must be {rule}") }
        }
        let positive = |name: &'static str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(bad(name, v, "a finite number > 0"))
            }
        };
        let non_negative = |name: &'static str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(bad(name, v, "a finite number >= 0"))
            }
        };
        positive("temperature", self.temperature)?;
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
        Ok(())
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
        ] {
            let err = o.validate().unwrap_err().to_string();
            assert!(err.contains(name), "{err}");
        }
    }
}

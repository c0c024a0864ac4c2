//! TRL's adaptive entropy coefficient (`use_adaptive_entropy`): a controller that raises the
//! entropy bonus while the policy's entropy is at or below a target and lowers it above, applying
//! the bonus only while the entropy is at or below the target.

use flashgrpo_kernels::LossOptions;
use serde::{Deserialize, Serialize};

use super::config::GrpoConfig;

/// The controller's state (kept in the checkpoint).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdaptiveEntropy {
    pub coef: f64,
    /// The last step's mean entropy over the completion tokens of every rank (`None` before the
    /// first step: TRL starts from an infinite entropy, so the first step applies no bonus).
    pub last_entropy: Option<f64>,
}

impl AdaptiveEntropy {
    /// The controller at the start of a run: `loss.entropy_coef` as the initial coefficient.
    pub fn start(options: &LossOptions) -> Self {
        Self { coef: options.entropy_coef, last_entropy: None }
    }

    /// The step's loss options: the current coefficient, or none while the entropy is above the
    /// target (TRL's gating by the previous step's entropy).
    pub fn options(&self, options: &LossOptions, config: &GrpoConfig) -> LossOptions {
        let applies = self.last_entropy.is_some_and(|h| h <= config.entropy_target);
        LossOptions { entropy_coef: if applies { self.coef } else { 0.0 }, ..options.clone() }
    }

    /// After a step whose mean entropy was `entropy`: one move of the coefficient.
    pub fn observe(&mut self, entropy: Option<f64>, config: &GrpoConfig) {
        let Some(h) = entropy else { return };
        self.coef = if h <= config.entropy_target {
            (self.coef + config.entropy_coef_delta).min(config.entropy_coef_max)
        } else {
            (self.coef - config.entropy_coef_delta).max(config.entropy_coef_min)
        };
        self.last_entropy = Some(h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moves_towards_the_target_and_gates_the_bonus() {
        let config =
            GrpoConfig { entropy_target: 0.5, entropy_coef_delta: 0.1, entropy_coef_max: 0.25, ..Default::default() };
        let options = LossOptions { entropy_coef: 0.05, ..Default::default() };
        let mut a = AdaptiveEntropy::start(&options);
        assert_eq!(a.options(&options, &config).entropy_coef, 0.0, "no bonus before an entropy is seen");
        a.observe(Some(0.4), &config);
        assert!((a.coef - 0.15).abs() < 1e-12);
        assert_eq!(a.options(&options, &config).entropy_coef, a.coef);
        a.observe(Some(0.3), &config);
        assert_eq!(a.coef, 0.25, "capped at entropy_coef_max");
        a.observe(Some(0.9), &config);
        assert!((a.coef - 0.15).abs() < 1e-12);
        assert_eq!(a.options(&options, &config).entropy_coef, 0.0, "above the target: no bonus");
        a.observe(None, &config);
        assert!((a.coef - 0.15).abs() < 1e-12);
    }
}

//! The `grpo:` section: rollout, advantages, update and evaluation settings, named as in TRL's
//! `GRPOConfig` where it has the setting. The loss's own options are the `loss:` section.

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};
use crate::model::Sampling;
use crate::optim::OptimConfig;
use crate::rewards::{Aggregation, ScaleRewards, DEFAULT_WEIGHTS, REWARD_NAMES};

/// TRL's names of `grpo:` settings we name otherwise, each with ours (both are accepted; one
/// section holding both is an error).
pub const TRL_NAMES: [(&str, &str); 3] = [
    ("num_iterations", "ppo_epochs"),
    ("max_completion_length", "max_new_tokens"),
    ("num_generations_eval", "eval_samples"),
];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GrpoConfig {
    /// GRPO steps (each: one rollout, `ppo_epochs` optimiser steps).
    pub steps: usize,
    /// Prompts per step.
    pub prompts_per_step: usize,
    /// Completions per prompt (the group, TRL's `num_generations`).
    pub num_generations: usize,
    /// Sequences per forward / backward of the update (micro-batch); the step's micro-batches
    /// accumulate into one optimiser step whose loss is that of the whole batch.
    pub micro_batch_size: usize,
    /// Optimiser steps per rollout (TRL's `num_iterations`); above 1, the rollout policy's
    /// log-probabilities are computed (no-grad fused op) and the ratio is clipped against them.
    #[serde(alias = "num_iterations")]
    pub ppo_epochs: usize,
    pub temperature: f64,
    /// 0: off.
    pub top_k: usize,
    pub top_p: f64,
    /// TRL's `min_p` (0 or null: off): tokens less than `min_p` times as likely as the most
    /// likely one are not drawn.
    #[serde(deserialize_with = "null_is_zero")]
    pub min_p: f64,
    /// TRL's `repetition_penalty` (1: off), Hugging Face's: on the logits of the prompt's and the
    /// completion's tokens before the temperature. Sampling only: the loss and the recorded
    /// log-probabilities are the policy's own.
    pub repetition_penalty: f64,
    /// TRL's `max_completion_length`.
    #[serde(alias = "max_completion_length")]
    pub max_new_tokens: usize,
    pub scale_rewards: ScaleRewards,
    /// TRL's `multi_objective_aggregation`: `sum_then_normalize` (the weighted reward, scaled as
    /// `scale_rewards` says) or `normalize_then_sum` (each reward standardised within its group,
    /// their weighted sum standardised over the batch).
    pub multi_objective_aggregation: Aggregation,
    /// DAPO's dynamic sampling: drop groups whose rewards are all equal (they carry no signal) and
    /// draw more prompts in their place, up to `max_rollout_rounds` generations per step.
    pub dynamic_sampling: bool,
    /// Generations per step at most, with `dynamic_sampling`.
    pub max_rollout_rounds: usize,
    /// Added to the standard deviation in the advantages.
    pub advantage_eps: f64,
    /// Weights of correctness, strict format and tag count.
    pub reward_weights: Vec<f64>,
    /// Held-out accuracy every this many steps (and before the first step and after the last);
    /// 0: only before and after.
    pub eval_every_steps: usize,
    /// Sampling temperature of the evaluation (0: greedy). The default (null) is `temperature`:
    /// it samples as the rollouts do (TRL evaluates with the training generation settings), the
    /// accuracy of the policy being trained. With a temperature, greedy accuracy is also logged
    /// before the first and after the last step (`eval/accuracy_greedy`).
    pub eval_temperature: Option<f64>,
    /// Completions per held-out prompt when the evaluation samples (the accuracy is their mean:
    /// less noise than one draw per prompt); TRL's `num_generations_eval`.
    #[serde(alias = "num_generations_eval")]
    pub eval_samples: usize,
    /// Sequences per generation batch in the evaluation.
    pub eval_batch_size: usize,
    /// Save model, optimiser, RNG and step every this many steps to `out/checkpoint` (0: never).
    pub checkpoint_every: usize,
    pub optim: OptimConfig,
    /// Hand the log-probabilities the sampler recorded to the loss as `sampling_logp` (TRL with
    /// vLLM): rollout correction (`loss.vllm_importance_sampling_*`) and the off-policy mask then
    /// compare against the sampler. Off: the update is on-policy as before.
    pub sampling_logp: bool,
    /// Batch-invariant products: each row's matrix products (and so its logits) are the same
    /// bits whatever the number of rows computed with it, so the log-probabilities the sampler
    /// records equal the update's bit for bit (`train/rollout_logp_max_abs_diff` = 0). Costs
    /// nothing at the trainer's batch sizes; off, decode steps of a few rows run faster on
    /// AVX-512 machines (on AVX2 ones the forward products are batch-invariant anyway:
    /// `flashgrpo_kernels::matmul::weight_rows`).
    pub batch_invariant: bool,
    /// TRL's `mask_truncated_completions`: completions that reached `max_new_tokens` without an
    /// end-of-sequence token take no part in the loss.
    pub mask_truncated_completions: bool,
    /// TRL's `log_completions`: every step's trained-on completions, with their rewards and
    /// advantages, in `completions.jsonl` of the run directory.
    pub log_completions: bool,
    /// With `log_completions`, the first this many of each step (null: all).
    pub num_completions_to_print: Option<usize>,
    /// TRL's `sync_ref_model` (TR-DPO): every `ref_model_sync_steps` optimizer steps the
    /// reference moves to `ref_model_mixup_alpha * policy + (1 - alpha) * reference`. Needs a
    /// reference (`loss.beta != 0`).
    pub sync_ref_model: bool,
    pub ref_model_mixup_alpha: f64,
    pub ref_model_sync_steps: usize,
    /// TRL's adaptive entropy coefficient: after each step, `loss.entropy_coef` moves by
    /// `entropy_coef_delta` towards more bonus when the step's entropy is at or below
    /// `entropy_target` and towards less otherwise (within `[entropy_coef_min, entropy_coef_max]`),
    /// and the bonus applies only while the entropy is at or below the target.
    pub use_adaptive_entropy: bool,
    pub entropy_coef_min: f64,
    pub entropy_coef_max: f64,
    pub entropy_coef_delta: f64,
    pub entropy_target: f64,
}

impl Default for GrpoConfig {
    fn default() -> Self {
        Self {
            steps: 500,
            prompts_per_step: 8,
            num_generations: 16,
            micro_batch_size: 64,
            ppo_epochs: 1,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            max_new_tokens: 32,
            scale_rewards: ScaleRewards::Group,
            multi_objective_aggregation: Aggregation::SumThenNormalize,
            dynamic_sampling: false,
            max_rollout_rounds: 3,
            advantage_eps: 1e-4,
            reward_weights: DEFAULT_WEIGHTS.to_vec(),
            eval_every_steps: 100,
            eval_temperature: None,
            eval_samples: 4,
            eval_batch_size: 128,
            checkpoint_every: 50,
            optim: OptimConfig { lr: 1e-4, warmup_steps: 5, min_lr_ratio: 1.0, ..OptimConfig::default() },
            sampling_logp: false,
            batch_invariant: true,
            mask_truncated_completions: false,
            sync_ref_model: false,
            ref_model_mixup_alpha: 0.6,
            ref_model_sync_steps: 512,
            log_completions: false,
            num_completions_to_print: None,
            use_adaptive_entropy: false,
            entropy_coef_min: 0.0,
            entropy_coef_max: 1.0,
            entropy_coef_delta: 0.005,
            entropy_target: 0.2,
        }
    }
}

/// TRL's `min_p: null` (its default) as 0, off.
fn null_is_zero<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(0.0))
}

impl GrpoConfig {
    /// Checks that each of `ranks` data-parallel ranks gets whole groups.
    pub fn check_ranks(&self, ranks: usize) -> Result<()> {
        if !self.prompts_per_step.is_multiple_of(ranks) {
            return Err(TrainError::Config {
                origin: "grpo.prompts_per_step".into(),
                why: format!(
                    "{} prompts per step cannot be split into whole groups over {ranks} data-parallel ranks; use a multiple of {ranks}",
                    self.prompts_per_step
                ),
            });
        }
        Ok(())
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(TrainError::Config { origin: "grpo".into(), why });
        for (name, v) in [
            ("steps", self.steps),
            ("prompts_per_step", self.prompts_per_step),
            ("micro_batch_size", self.micro_batch_size),
            ("ppo_epochs", self.ppo_epochs),
            ("max_new_tokens", self.max_new_tokens),
            ("eval_batch_size", self.eval_batch_size),
            ("eval_samples", self.eval_samples),
            ("max_rollout_rounds", self.max_rollout_rounds),
        ] {
            if v == 0 {
                return bad(format!("grpo.{name} must be positive"));
            }
        }
        if self.num_generations < 2 {
            return bad(format!(
                "grpo.num_generations must be at least 2 (advantages compare completions of one prompt), got {}",
                self.num_generations
            ));
        }
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            return bad(format!("grpo.temperature must be positive, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("grpo.top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.ref_model_mixup_alpha) || self.ref_model_sync_steps == 0 {
            return bad(format!(
                "grpo.ref_model_mixup_alpha must be in [0, 1] and grpo.ref_model_sync_steps positive, got {} and {}",
                self.ref_model_mixup_alpha, self.ref_model_sync_steps
            ));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("grpo.min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad(format!("grpo.repetition_penalty must be positive (1: off), got {}", self.repetition_penalty));
        }
        if !(self.eval_temperature() >= 0.0 && self.eval_temperature().is_finite()) {
            return bad(format!("grpo.eval_temperature must be >= 0, got {}", self.eval_temperature()));
        }
        let (lo, hi) = (self.entropy_coef_min, self.entropy_coef_max);
        if !(lo.is_finite() && hi.is_finite() && lo <= hi && self.entropy_coef_delta >= 0.0) {
            return bad(format!(
                "grpo.entropy_coef_min ({lo}) <= grpo.entropy_coef_max ({hi}) and grpo.entropy_coef_delta ({}) >= 0 are required",
                self.entropy_coef_delta
            ));
        }
        if self.advantage_eps.is_nan() || self.advantage_eps < 0.0 {
            return bad(format!("grpo.advantage_eps must be >= 0, got {}", self.advantage_eps));
        }
        if self.reward_weights.len() != REWARD_NAMES.len() || self.reward_weights.iter().any(|w| !w.is_finite()) {
            return bad(format!(
                "grpo.reward_weights must be {} finite numbers ({}), got {:?}",
                REWARD_NAMES.len(),
                REWARD_NAMES.join(", "),
                self.reward_weights
            ));
        }
        self.optim.validate("grpo.optim")
    }

    /// The rollout's sampling.
    pub fn sampling(&self) -> Sampling {
        Sampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            max_new_tokens: self.max_new_tokens,
        }
    }

    /// The evaluation's temperature: `eval_temperature`, else the rollouts' own.
    pub fn eval_temperature(&self) -> f64 {
        self.eval_temperature.unwrap_or(self.temperature)
    }

    /// The evaluation's sampling.
    pub fn eval_sampling(&self) -> Sampling {
        Sampling { temperature: self.eval_temperature(), ..self.sampling() }
    }
}

//! A GRPO step's rollout: draw prompts, generate `G` completions of each, score them, and turn
//! the rewards into group advantages. With DAPO's dynamic sampling (`grpo.dynamic_sampling`), a
//! group whose rewards are all equal (all right, or all wrong) has zero advantages and teaches
//! nothing, so it is dropped and more prompts are drawn, up to `grpo.max_rollout_rounds`
//! generations per step, until `prompts_per_step` groups carry a signal (or the rounds run out:
//! the step then trains on the groups it has, or, with none, on the last round's, as without
//! dynamic sampling).

use std::time::Instant;

use flashgrpo_kernels::synthetic::Rng;
use tokenizers::Tokenizer;

use super::config::GrpoConfig;
use super::trainer::Prompt;
use crate::error::Result;
use crate::model::Qwen2;
use crate::rewards::{advantages, score};
use crate::rollout::Rollout;
use crate::tokenizer::decode;

/// What a step's rollout produced.
#[derive(Debug, Default)]
pub struct Groups {
    /// The sequences the update trains on, group after group: prompt ids, completions (at least
    /// one token each), advantages.
    pub prompts: Vec<Vec<u32>>,
    pub completions: Vec<Vec<u32>>,
    pub advantages: Vec<f64>,
    /// Every completion generated in the step, kept or not (the policy's own statistics): the
    /// three rewards, the weighted reward, the length.
    pub scores: Vec<[f64; 3]>,
    pub rewards: Vec<f64>,
    pub lengths: Vec<usize>,
    /// Generations run (1 without dynamic sampling).
    pub rounds: usize,
    /// Of the groups generated, those whose rewards were all equal.
    pub flat_groups: usize,
    pub generated_groups: usize,
    pub rollout_s: f64,
    pub reward_s: f64,
}

/// Everything a rollout reads besides the model.
pub struct RolloutSetup<'a> {
    pub config: &'a GrpoConfig,
    pub train: &'a [Prompt],
    pub tokenizer: &'a Tokenizer,
    pub eos: &'a [u32],
}

impl RolloutSetup<'_> {
    /// One step's groups, prompts drawn from `rng`.
    pub fn run(&self, model: &Qwen2, rollout: &mut Rollout, rng: &mut Rng) -> Result<Groups> {
        let c = self.config;
        let g = c.num_generations;
        let mut out = Groups::default();
        let mut kept_rewards = Vec::new();
        let mut last_round = (Vec::new(), Vec::new(), Vec::new());
        let rounds = if c.dynamic_sampling { c.max_rollout_rounds.max(1) } else { 1 };
        while out.rounds < rounds && out.prompts.len() < c.prompts_per_step * g {
            out.rounds += 1;
            let started = Instant::now();
            let chosen: Vec<&Prompt> =
                (0..c.prompts_per_step).map(|_| &self.train[rng.below(self.train.len())]).collect();
            let prompts: Vec<Vec<u32>> = chosen.iter().flat_map(|p| std::iter::repeat_n(p.ids.clone(), g)).collect();
            let generated = rollout.generate(model, &prompts, &c.sampling(), self.eos, rng)?;
            // Every completion has a token: `max_new_tokens >= 1` (validated).
            let completions = generated.completions;
            out.rollout_s += started.elapsed().as_secs_f64();

            let started = Instant::now();
            let scores: Vec<[f64; 3]> = completions
                .iter()
                .enumerate()
                .map(|(i, t)| Ok(score(&decode(self.tokenizer, t)?, &chosen[i / g].answer)))
                .collect::<Result<_>>()?;
            let rewards: Vec<f64> =
                scores.iter().map(|s| s.iter().zip(&c.reward_weights).map(|(r, w)| r * w).sum()).collect();
            for (k, group) in rewards.chunks(g).enumerate() {
                out.generated_groups += 1;
                let flat = group.iter().all(|r| *r == group[0]);
                out.flat_groups += usize::from(flat);
                if (flat && c.dynamic_sampling) || out.prompts.len() >= c.prompts_per_step * g {
                    continue;
                }
                let range = k * g..(k + 1) * g;
                out.prompts.extend_from_slice(&prompts[range.clone()]);
                out.completions.extend_from_slice(&completions[range]);
                kept_rewards.extend_from_slice(group);
            }
            out.lengths.extend(completions.iter().map(Vec::len));
            out.scores.extend(scores);
            out.rewards.extend_from_slice(&rewards);
            out.reward_s += started.elapsed().as_secs_f64();
            last_round = (prompts, completions, rewards);
        }
        if out.prompts.is_empty() {
            (out.prompts, out.completions, kept_rewards) = last_round;
        }
        out.advantages = advantages(&kept_rewards, g, c.scale_rewards, c.advantage_eps);
        Ok(out)
    }
}

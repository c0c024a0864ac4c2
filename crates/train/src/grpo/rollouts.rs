//! A GRPO step's rollout: draw prompts, generate `G` completions of each, score them, and turn
//! the rewards into group advantages. With DAPO's dynamic sampling (`grpo.dynamic_sampling`), a
//! group whose rewards are all equal (all right, or all wrong) has zero advantages and teaches
//! nothing, so it is dropped and more prompts are drawn, up to `grpo.max_rollout_rounds`
//! generations per step, until `prompts_per_step` groups carry a signal (or the rounds run out:
//! the step then trains on the groups it has, or, with none, on the last round's, as without
//! dynamic sampling).
//!
//! Data-parallel: every rank draws the same prompts (the step's generator is the same on every
//! rank), generates the whole groups of its share, and the ranks exchange what all of them need
//! (which groups are flat, every completion's scores): the kept groups, counts and metrics are
//! those of one process, each rank trains on its own kept groups. Each row samples from its own
//! stream keyed by its global index ([`RowStreams`]), so the completions do not depend on the
//! number of ranks.

use std::time::Instant;

use flashgrpo_collective::{share, Collective};
use flashgrpo_kernels::synthetic::Rng;
use tokenizers::Tokenizer;

use super::config::GrpoConfig;
use super::trainer::Prompt;
use crate::error::Result;
use crate::model::Qwen2;
use crate::rewards::{advantages, advantages_normalize_then_sum, sample_std, score, weighted, Aggregation};
use crate::rollout::{Rollout, RowStreams};
use crate::tokenizer::decode;

/// What a step's rollout produced.
#[derive(Debug, Default)]
pub struct Groups {
    /// The sequences this rank's update trains on, group after group: prompt ids, completions (at
    /// least one token each), advantages.
    pub prompts: Vec<Vec<u32>>,
    pub completions: Vec<Vec<u32>>,
    pub advantages: Vec<f64>,
    /// The three rewards of each of those completions.
    pub kept_scores: Vec<[f64; 3]>,
    /// Per kept completion, what the sampler recorded: `log p` of each token and the sampling
    /// distribution's entropy ([`crate::model::Generated`]), and whether it stopped at
    /// `max_new_tokens` rather than at end-of-sequence.
    pub sampling_logp: Vec<Vec<f32>>,
    pub sampling_entropy: Vec<Vec<f32>>,
    pub truncated: Vec<bool>,
    /// Every completion generated in the step by any rank, kept or not (the policy's own
    /// statistics): the three rewards, the weighted reward, the length.
    pub scores: Vec<[f64; 3]>,
    pub rewards: Vec<f64>,
    pub lengths: Vec<usize>,
    /// Generations run (1 without dynamic sampling).
    pub rounds: usize,
    /// Groups kept for the update, over all ranks.
    pub kept_groups: usize,
    /// The standard deviation of every rank's advantages.
    pub advantage_std: f64,
    /// Of the groups generated, those whose rewards were all equal.
    pub flat_groups: usize,
    pub generated_groups: usize,
    pub rollout_s: f64,
    pub reward_s: f64,
}

/// What the sampler recorded of one generation's completions.
#[derive(Debug, Default)]
struct Recorded {
    logp: Vec<Vec<f32>>,
    entropy: Vec<Vec<f32>>,
    truncated: Vec<bool>,
}

impl Recorded {
    fn append_to(&self, out: &mut Groups, rows: std::ops::Range<usize>) {
        // Greedy generation records no log-probabilities.
        if !self.logp.is_empty() {
            out.sampling_logp.extend_from_slice(&self.logp[rows.clone()]);
            out.sampling_entropy.extend_from_slice(&self.entropy[rows.clone()]);
        }
        out.truncated.extend_from_slice(&self.truncated[rows]);
    }
}

/// Everything a rollout reads besides the model.
pub struct RolloutSetup<'a> {
    pub config: &'a GrpoConfig,
    pub train: &'a [Prompt],
    pub tokenizer: &'a Tokenizer,
    pub eos: &'a [u32],
    /// The data-parallel ranks (one process: [`flashgrpo_collective::SingleProcess`]).
    pub comm: &'a dyn Collective,
}

/// One generation's prompts (the step's draw, every rank's) and this rank's share of it.
#[derive(Default)]
struct Round<'p> {
    chosen: Vec<&'p Prompt>,
    /// This rank's rows: each chosen prompt of its share `G` times, and their completions.
    prompts: Vec<Vec<u32>>,
    completions: Vec<Vec<u32>>,
    recorded: Recorded,
}

/// The kept groups over every rank: their scores in global order (advantages scaled over the
/// batch, `scale_rewards: batch` and `normalize_then_sum`, need the whole batch), and which of
/// them are this rank's.
#[derive(Default)]
struct Kept {
    scores: Vec<[f64; 3]>,
    here: Vec<bool>,
}

impl<'a> RolloutSetup<'a> {
    /// One step's groups, prompts drawn from `rng`: generations until enough groups carry a
    /// signal (one without dynamic sampling), then their advantages.
    pub fn run(&self, model: &Qwen2, rollout: &mut Rollout, rng: &mut Rng) -> Result<Groups> {
        let c = self.config;
        let target = c.prompts_per_step;
        let mine = share(target, self.comm.size(), self.comm.rank());
        let mut out = Groups::default();
        let mut kept = Kept::default();
        let mut last_round = None;
        let rounds = if c.dynamic_sampling { c.max_rollout_rounds.max(1) } else { 1 };
        while out.rounds < rounds && out.kept_groups < target {
            out.rounds += 1;
            let started = Instant::now();
            let round = self.generate(model, rollout, rng, &mine)?;
            out.rollout_s += started.elapsed().as_secs_f64();

            let started = Instant::now();
            let scores = self.scores(&round, &mine)?;
            let rewards: Vec<f64> = scores.iter().map(|s| weighted(s, &c.reward_weights)).collect();
            self.keep_groups(&round, &scores, &rewards, &mine, &mut kept, &mut out);
            out.lengths.extend(self.gather_lengths(&round.completions)?);
            out.scores.extend_from_slice(&scores);
            out.rewards.extend_from_slice(&rewards);
            out.reward_s += started.elapsed().as_secs_f64();
            last_round = Some((round, scores));
        }
        if out.kept_groups == 0 {
            let (round, scores) = last_round.unwrap_or_default();
            self.keep_every_group(round, scores, &mine, &mut kept, &mut out);
        }
        self.set_advantages(&kept, &mut out);
        Ok(out)
    }

    /// Draws the round's prompts (the same on every rank) and generates this rank's share of
    /// their groups.
    fn generate(
        &self,
        model: &Qwen2,
        rollout: &mut Rollout,
        rng: &mut Rng,
        mine: &std::ops::Range<usize>,
    ) -> Result<Round<'a>> {
        let c = self.config;
        let (g, target) = (c.num_generations, c.prompts_per_step);
        let chosen: Vec<&Prompt> = (0..target).map(|_| &self.train[rng.below(self.train.len())]).collect();
        let mut streams = RowStreams::new(rng.next_u64(), mine.start * g..mine.end * g);
        let prompts: Vec<Vec<u32>> =
            chosen[mine.clone()].iter().flat_map(|p| std::iter::repeat_n(p.ids.clone(), g)).collect();
        let generated = rollout.generate_rows(model, &prompts, &c.sampling(), self.eos, &mut streams)?;
        // Every completion has a token: `max_new_tokens >= 1` (validated).
        let recorded = Recorded {
            logp: generated.logp,
            entropy: generated.entropy,
            truncated: generated.finished.iter().map(|f| !f).collect(),
        };
        Ok(Round { chosen, prompts, completions: generated.completions, recorded })
    }

    /// Every rank's completions' three rewards, in global row order.
    fn scores(&self, round: &Round, mine: &std::ops::Range<usize>) -> Result<Vec<[f64; 3]>> {
        let g = self.config.num_generations;
        let scores: Vec<[f64; 3]> = round
            .completions
            .iter()
            .enumerate()
            .map(|(i, t)| Ok(score(&decode(self.tokenizer, t)?, &round.chosen[mine.start + i / g].answer)))
            .collect::<Result<_>>()?;
        self.gather_scores(&scores)
    }

    /// Counts the round's groups and keeps those with a signal (every group without dynamic
    /// sampling), up to the step's target: their scores to `kept`, this rank's sequences to `out`.
    fn keep_groups(
        &self,
        round: &Round,
        scores: &[[f64; 3]],
        rewards: &[f64],
        mine: &std::ops::Range<usize>,
        kept: &mut Kept,
        out: &mut Groups,
    ) {
        let c = self.config;
        let g = c.num_generations;
        for (k, group) in rewards.chunks(g).enumerate() {
            out.generated_groups += 1;
            // No signal: equal rewards, or with normalize_then_sum equal scores in every
            // reward (a flat weighted sum can hide rewards that differ).
            let flat = match c.multi_objective_aggregation {
                Aggregation::SumThenNormalize => group.iter().all(|r| *r == group[0]),
                Aggregation::NormalizeThenSum => {
                    let s = &scores[k * g..(k + 1) * g];
                    s.iter().all(|x| *x == s[0])
                }
            };
            out.flat_groups += usize::from(flat);
            if (flat && c.dynamic_sampling) || out.kept_groups >= c.prompts_per_step {
                continue;
            }
            out.kept_groups += 1;
            kept.here.push(mine.contains(&k));
            kept.scores.extend_from_slice(&scores[k * g..(k + 1) * g]);
            if !mine.contains(&k) {
                continue;
            }
            let local = (k - mine.start) * g..(k - mine.start + 1) * g;
            out.prompts.extend_from_slice(&round.prompts[local.clone()]);
            out.completions.extend_from_slice(&round.completions[local.clone()]);
            out.kept_scores.extend_from_slice(&scores[k * g..(k + 1) * g]);
            round.recorded.append_to(out, local);
        }
    }

    /// No group kept once the rounds have run out (or none ran: `prompts_per_step` 0): the step
    /// trains on the last round's groups, as without dynamic sampling.
    fn keep_every_group(
        &self,
        round: Round,
        scores: Vec<[f64; 3]>,
        mine: &std::ops::Range<usize>,
        kept: &mut Kept,
        out: &mut Groups,
    ) {
        let (g, target) = (self.config.num_generations, self.config.prompts_per_step);
        (out.prompts, out.completions, kept.scores) = (round.prompts, round.completions, scores);
        let rows = 0..out.completions.len();
        round.recorded.append_to(out, rows);
        kept.here = (0..target).map(|k| mine.contains(&k)).collect();
        out.kept_scores = kept.scores[mine.start * g..mine.end * g].to_vec();
        out.kept_groups = target;
    }

    /// The kept groups' advantages over every rank's, this rank's to `out`, and the spread of
    /// every rank's.
    fn set_advantages(&self, kept: &Kept, out: &mut Groups) {
        let c = self.config;
        let g = c.num_generations;
        let all = match c.multi_objective_aggregation {
            Aggregation::SumThenNormalize => {
                let kept_rewards: Vec<f64> = kept.scores.iter().map(|s| weighted(s, &c.reward_weights)).collect();
                advantages(&kept_rewards, g, c.scale_rewards, c.advantage_eps)
            }
            Aggregation::NormalizeThenSum => {
                advantages_normalize_then_sum(&kept.scores, &c.reward_weights, g, c.advantage_eps)
            }
        };
        out.advantage_std = sample_std(&all);
        out.advantages =
            all.chunks(g).zip(&kept.here).filter(|(_, &here)| here).flat_map(|(a, _)| a.to_vec()).collect();
    }

    /// Every rank's completion scores, in global row order.
    fn gather_scores(&self, local: &[[f64; 3]]) -> Result<Vec<[f64; 3]>> {
        let flat: Vec<f64> = local.iter().flatten().copied().collect();
        let mut all = vec![0.0; flat.len() * self.comm.size()];
        self.comm.all_gather_f64(&flat, &mut all)?;
        Ok(all.chunks(3).map(|s| [s[0], s[1], s[2]]).collect())
    }

    /// Every rank's completion lengths, in global row order.
    fn gather_lengths(&self, completions: &[Vec<u32>]) -> Result<Vec<usize>> {
        let local: Vec<u64> = completions.iter().map(|c| c.len() as u64).collect();
        let mut all = vec![0u64; local.len() * self.comm.size()];
        self.comm.all_gather_u64(&local, &mut all)?;
        Ok(all.into_iter().map(|l| l as usize).collect())
    }
}

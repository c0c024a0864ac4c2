//! The GRPO loop. Per step: draw prompts, sample `G` completions of each with the KV cache,
//! score them, turn rewards into group advantages, compute the rollout policy's log-probabilities
//! (when `ppo_epochs > 1`) and the reference model's (when `beta != 0`) with the no-grad fused
//! logprob op, then update the policy over micro-batches whose losses sum to the whole batch's
//! (the kernels' `BatchShard` normalisers), with clipping, AdamW, metrics, evaluation and
//! checkpoints.
//!
//! Data-parallel over a [`Collective`]: every rank holds the whole model, generates and trains
//! on its share of the step's groups, and the gradients are summed over the ranks before the
//! optimiser step, with the whole batch's normalisers (LOSSES.md, Sharding): the same update as
//! one process on the global batch. Rank 0 writes the metrics and checkpoints; every
//! `parallel.check_weights_every` steps the ranks compare a hash of their weights.

use std::path::Path;
use std::time::Instant;

use flashgrpo_collective::{share, Collective};
use flashgrpo_kernels::synthetic::Rng;
use flashgrpo_kernels::LossOptions;
use serde_json::json;
use tokenizers::Tokenizer;

use super::adaptive_entropy::AdaptiveEntropy;
use super::checkpoint::{checkpoint_dir, save_checkpoint, Resume, TrainerState};
use super::completions_log;
use super::config::GrpoConfig;
use super::ref_sync;
use super::rollouts::{Groups, RolloutSetup};
use super::update::{update, EngineBuffers, Objective, TokenSums, UpdateBatch, UpdateInputs};
use crate::error::{Result, TrainError};
use crate::head_loss::LossConfig;
use crate::metrics::{self, record, HeapProbe, MetricsLog, Record};
use crate::model::{Params, Qwen2, Sampling};
use crate::optim::{StepReport, Updater};
use crate::parallel::{check_weights, Mesh};
use crate::progress::Progress;
use crate::rewards::{correctness, sample_std, REWARD_NAMES};
use crate::rollout::{Rollout, RowStreams};
use crate::tokenizer::{decode, SideFiles};

/// A tokenised prompt and its gold answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    pub ids: Vec<u32>,
    pub answer: String,
}

/// Everything a run needs besides the model.
pub struct GrpoRun<'a> {
    pub config: &'a GrpoConfig,
    pub loss: &'a LossConfig,
    pub train: &'a [Prompt],
    pub eval: &'a [Prompt],
    pub tokenizer: &'a Tokenizer,
    /// The ids that end a completion.
    pub eos: &'a [u32],
    pub pad: u32,
    /// The source's files saved with every checkpoint's model.
    pub side_files: &'a SideFiles,
    /// The frozen reference policy (needed when `loss.beta != 0`).
    pub reference: Option<&'a Qwen2>,
    pub seed: u64,
    /// Where checkpoints go (`out/checkpoint`).
    pub out: &'a Path,
    pub log: &'a mut MetricsLog,
    pub progress: bool,
    /// Continue from this checkpoint's state (the model and optimiser come from it too).
    pub resume: Option<&'a Resume>,
    /// Stop after this step as if killed (tests of `--resume`).
    pub stop_after: Option<usize>,
    /// Called after every step, outside all timed regions.
    pub after_step: Option<&'a StepHook>,
    /// The processes: data-parallel groups, vocabulary groups ([`Mesh::single`] for one).
    pub mesh: &'a Mesh<'a>,
    /// Compare the ranks' weights every this many steps (0: never).
    pub check_weights_every: usize,
}

/// A callback after every GRPO step, outside all timed regions: `flashgrpo ab` hands the machine
/// to the other arm here, so that the two arms alternate step by step and share the machine's
/// drift (on a shared VM, speed wanders by 10% over minutes) instead of one arm getting the fast
/// minutes.
#[derive(Clone)]
pub struct StepHook(pub std::sync::Arc<dyn Fn(usize) + Send + Sync>);

impl std::fmt::Debug for StepHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepHook")
    }
}

/// What a GRPO run did.
#[derive(Debug, Clone, PartialEq)]
pub struct GrpoSummary {
    pub steps: usize,
    pub eval_before: Option<f64>,
    pub eval_after: Option<f64>,
    /// Greedy held-out accuracy before the first and after the last step, when the evaluation
    /// samples (`eval_temperature > 0`).
    pub eval_greedy_before: Option<f64>,
    pub eval_greedy_after: Option<f64>,
    pub reward_first: f64,
    pub reward_last10: f64,
    pub reward_mean: f64,
    pub step_avg_last10_s: f64,
    pub update_s_mean: f64,
    pub peak_rss_bytes: u64,
    pub update_peak_heap_bytes: Option<usize>,
    pub skipped_steps: usize,
}

/// How held-out accuracy is measured: one completion per prompt (greedy by default), scored by
/// correctness.
#[derive(Clone, Copy)]
pub struct Evaluation<'a> {
    pub sampling: Sampling,
    /// Completions per prompt (their mean correctness is the prompt's score); 1 when greedy.
    pub samples: usize,
    pub batch_size: usize,
    pub tokenizer: &'a Tokenizer,
    pub eos: &'a [u32],
    pub pad: u32,
    /// The ranks that share the evaluation (each its share of the prompts).
    pub comm: &'a dyn Collective,
}

impl Evaluation<'_> {
    /// The share of `prompts` answered correctly; `seed` drives sampling when it is not greedy
    /// (each completion from its own stream, so the figure does not depend on the batch size or
    /// the number of ranks).
    pub fn accuracy(&self, model: &Qwen2, prompts: &[Prompt], seed: u64) -> Result<f64> {
        if prompts.is_empty() {
            return Ok(f64::NAN);
        }
        let stream_seed = Rng::new(seed).next_u64();
        let k = if self.sampling.temperature == 0.0 { 1 } else { self.samples.max(1) };
        let mine = share(prompts.len(), self.comm.size(), self.comm.rank());
        let rows: Vec<(usize, &Prompt)> = mine.flat_map(|i| (0..k).map(move |j| (i * k + j, &prompts[i]))).collect();
        let mut correct = 0.0;
        let mut rollout = Rollout::default();
        for chunk in rows.chunks(self.batch_size.max(1)) {
            let ids: Vec<Vec<u32>> = chunk.iter().map(|(_, p)| p.ids.clone()).collect();
            let mut streams = RowStreams::new(stream_seed, chunk[0].0..chunk[0].0 + chunk.len());
            let generated = rollout.generate_rows(model, &ids, &self.sampling, self.eos, &mut streams)?;
            for ((_, p), completion) in chunk.iter().zip(&generated.completions) {
                correct += correctness(&decode(self.tokenizer, completion)?, &p.answer);
            }
        }
        let mut total = [correct];
        self.comm.all_reduce_f64(&mut total, flashgrpo_collective::ReduceOp::Sum)?;
        Ok(total[0] / k as f64 / prompts.len() as f64)
    }
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        f64::NAN
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// Trains `model` in place: the run's setup (checks, the optimiser, the held-out accuracy
/// before), then each step as a few named parts — rollout, the log-probabilities the loss
/// compares against, the update, the step's record, evaluation, logging — then the summary.
pub fn train_grpo(model: &Qwen2, run: GrpoRun<'_>) -> Result<GrpoSummary> {
    let mut t = Trainer::start(model, run)?;
    while t.state.step < t.run.config.steps {
        let started = Instant::now();
        let groups = t.rollouts().run(model, &mut t.engine.rollout, &mut t.rng)?;
        let mut scored = t.score(model, &groups)?;
        let updated = t.update(model, &groups, &mut scored)?;
        let step_s = t.advance(started, &updated);
        let step = t.state.step;
        let mut r = t.record(&groups, &scored, &updated, step_s);
        t.evaluate(model, step, &mut r)?;
        t.write_step(model, &groups, &r, updated.seconds)?;
        if t.run.stop_after == Some(step) {
            break;
        }
        if let Some(hook) = t.run.after_step {
            (hook.0)(step);
        }
    }
    Ok(t.finish())
}

/// A GRPO run in progress: what [`train_grpo`] keeps from step to step.
struct Trainer<'a> {
    run: GrpoRun<'a>,
    /// The `loss:` section's options, `max_completion_length` filled from the config.
    options: LossOptions,
    updater: Updater,
    state: TrainerState,
    held_out: HeldOut<'a>,
    rng: Rng,
    adaptive: Option<AdaptiveEntropy>,
    bar: Progress,
    probe: Option<&'static HeapProbe>,
    engine: EngineBuffers,
    /// `completions.jsonl` (`log_completions`, rank 0).
    completions: Option<MetricsLog>,
    rewards_per_step: Vec<f64>,
    update_times: Vec<f64>,
    update_peak: Option<usize>,
    eval_after: Option<f64>,
    eval_greedy_after: Option<f64>,
}

/// A step's micro-batches and the log-probabilities its loss compares against.
struct Scored {
    batch: UpdateBatch,
    /// The loss options of this step (the adaptive entropy coefficient's, where it adapts).
    options: LossOptions,
    /// Per micro-batch, `[S * C]` (each taken by the update): the rollout policy's
    /// log-probabilities (`ppo_epochs > 1`).
    old_logp: Option<Vec<Vec<f32>>>,
    /// The reference model's (`beta != 0`).
    ref_logp: Option<Vec<Vec<f32>>>,
    /// The sampler's, as the loss takes them (`grpo.sampling_logp`).
    sampling_logp: Option<Vec<Vec<f32>>>,
    /// The sampler's as it recorded them (compared with the update's own).
    recorded_logp: Option<Vec<Vec<f32>>>,
    valid_tokens: usize,
    seconds: f64,
}

/// What a step's update did.
struct Updated {
    losses: Vec<f64>,
    sums: TokenSums,
    report: StepReport,
    /// Mixes of the policy into the reference model (TRL's `sync_ref_model`).
    mixes: usize,
    /// The heap the update took above what was live before it (with a heap probe installed).
    heap: Option<usize>,
    seconds: f64,
}

impl<'a> Trainer<'a> {
    /// Checks the run, builds (or restores) the optimiser and the trainer's state, and measures
    /// the held-out accuracy before the first step (not on a resumed run: its checkpoint has it).
    fn start(model: &Qwen2, run: GrpoRun<'a>) -> Result<Self> {
        let (config, world) = (run.config, run.mesh.world);
        config.validate()?;
        config.check_ranks(run.mesh.data().size())?;
        flashgrpo_kernels::matmul::set_batch_invariant(config.batch_invariant);
        check_run(&run)?;
        let mut options: LossOptions = run.loss.options.clone();
        if options.max_completion_length.is_none() {
            options.max_completion_length = Some(config.max_new_tokens);
        }
        let (updater, mut state) = optimiser_and_state(&model.params, &run)?;
        let held_out = HeldOut::of(&run);
        if run.resume.is_none() {
            (state.eval_before, state.eval_greedy_before) = held_out.before(model, run.log, world)?;
        }
        let adaptive = config
            .use_adaptive_entropy
            .then(|| state.adaptive_entropy.unwrap_or_else(|| AdaptiveEntropy::start(&options)));
        let bar = Progress::new("grpo", config.steps, state.step, run.progress && world.is_root(), world.is_root());
        let probe = metrics::heap_probe();
        metrics::reset_peak_rss();
        let resumed_at = run.resume.map(|r| r.state.step);
        let completions = (config.log_completions && world.is_root())
            .then(|| completions_log::open(run.out, resumed_at))
            .transpose()?;
        Ok(Self {
            rng: Rng::from_state(state.rng),
            eval_after: state.eval_before,
            eval_greedy_after: state.eval_greedy_before,
            run,
            options,
            updater,
            state,
            held_out,
            adaptive,
            bar,
            probe,
            engine: EngineBuffers::default(),
            completions,
            rewards_per_step: Vec::new(),
            update_times: Vec::new(),
            update_peak: None,
        })
    }

    fn rollouts(&self) -> RolloutSetup<'a> {
        let run = &self.run;
        RolloutSetup {
            config: run.config,
            train: run.train,
            tokenizer: run.tokenizer,
            eos: run.eos,
            comm: run.mesh.data(),
        }
    }

    /// The step's micro-batches, and the log-probabilities the loss compares against: the
    /// rollout policy's (`ppo_epochs > 1`), the reference model's (`beta != 0`), the sampler's.
    fn score(&mut self, model: &Qwen2, groups: &Groups) -> Result<Scored> {
        let started = Instant::now();
        let (config, loss, comm) = (self.run.config, self.run.loss, self.run.mesh.data());
        let mut batch = UpdateBatch::new(&groups.prompts, &groups.completions, config.micro_batch_size, self.run.pad)?;
        if config.mask_truncated_completions {
            batch.mask_sequences(&groups.truncated);
        }
        batch.share_normalisers(comm)?;
        // GRPO samples (temperature > 0), so the sampler recorded every kept completion; a rank
        // that kept none still takes part in the collectives.
        if self.options.top_entropy_quantile < 1.0 {
            batch.share_entropy_threshold(&groups.sampling_entropy, self.options.top_entropy_quantile, comm)?;
        }
        let recorded = groups.sampling_logp.len() == groups.completions.len();
        let recorded_logp = recorded.then(|| batch.per_micro_batch(&groups.sampling_logp));
        let sampling_logp = if config.sampling_logp { recorded_logp.clone() } else { None };
        let options = self.adaptive.map_or_else(|| self.options.clone(), |a| a.options(&self.options, config));
        let old_logp = (config.ppo_epochs > 1)
            .then(|| batch.logprobs(model, &mut self.engine.score, &self.options, loss))
            .transpose()?;
        let ref_logp = match (self.options.beta != 0.0, self.run.reference) {
            (true, Some(r)) => Some(batch.logprobs(r, &mut self.engine.score, &self.options, loss)?),
            _ => None,
        };
        let valid_tokens = batch.valid_tokens();
        let seconds = started.elapsed().as_secs_f64();
        Ok(Scored { batch, options, old_logp, ref_logp, sampling_logp, recorded_logp, valid_tokens, seconds })
    }

    /// The update over the step's micro-batches (`ppo_epochs` passes), then as many mixes of the
    /// policy into the reference model as this step's optimiser steps make due.
    fn update(&mut self, model: &Qwen2, groups: &Groups, scored: &mut Scored) -> Result<Updated> {
        let started = Instant::now();
        let live_before = self.probe.map(|p| {
            (p.reset_peak)();
            (p.live)()
        });
        let objective = Objective::Grpo {
            advantages: &groups.advantages,
            old_logp: scored.old_logp.take(),
            ref_logp: scored.ref_logp.take(),
            sampling_logp: scored.sampling_logp.take(),
        };
        let inputs = UpdateInputs {
            batch: &scored.batch,
            objective,
            options: &scored.options,
            loss: self.run.loss,
            recorded_logp: scored.recorded_logp.take(),
        };
        let (config, steps_before) = (self.run.config, self.updater.steps);
        let (losses, sums, report) =
            update(model, &inputs, config.ppo_epochs, &mut self.updater, &mut self.engine, self.run.mesh)?;
        let seconds = started.elapsed().as_secs_f64();
        // TRL's sync_ref_model: as many mixes as this step's optimizer steps are due.
        let mixes = if config.sync_ref_model {
            ref_sync::due(steps_before, self.updater.steps, config.ref_model_sync_steps)
        } else {
            0
        };
        if let Some(r) = self.run.reference {
            for _ in 0..mixes {
                ref_sync::mix_into(r, model, config.ref_model_mixup_alpha)?;
            }
        }
        let heap = self.probe.map(|p| (p.peak)()).zip(live_before).map(|(p, l)| p.saturating_sub(l));
        self.update_peak = self.update_peak.max(heap);
        Ok(Updated { losses, sums, report, mixes, heap, seconds })
    }

    /// Moves the state to the step just taken; returns its time.
    fn advance(&mut self, started: Instant, updated: &Updated) -> f64 {
        let step_s = started.elapsed().as_secs_f64();
        let state = &mut self.state;
        state.step += 1;
        state.rng = self.rng.state();
        state.optimizer_steps = self.updater.steps;
        state.skipped_steps = self.updater.skipped;
        state.recent_step_s.push(step_s);
        if state.recent_step_s.len() > 10 {
            state.recent_step_s.remove(0);
        }
        if updated.report.skipped {
            let step = state.step;
            self.bar.warn(&format!(
                "warning: step {step} skipped (non-finite loss or gradient); the weights are unchanged"
            ));
        }
        step_s
    }

    /// The step's metrics; the adaptive entropy coefficient observes the step's entropy here.
    fn record(&mut self, groups: &Groups, scored: &Scored, updated: &Updated, step_s: f64) -> Record {
        let (config, step, sums) = (self.run.config, self.state.step, &updated.sums);
        let (scores, rewards) = (&groups.scores, &groups.rewards);
        let correct: Vec<f64> = scores.iter().map(|s| s[0]).collect();
        let completion_len = mean(&groups.lengths.iter().map(|&l| l as f64).collect::<Vec<_>>());
        let mut r = record(json!({
            "step": step,
            "train/loss": mean(&updated.losses),
            "train/reward_mean": mean(rewards),
            "train/reward_std": sample_std(rewards),
        }));
        for (i, name) in REWARD_NAMES.iter().enumerate() {
            r.insert(format!("train/rewards/{name}"), json!(mean(&scores.iter().map(|s| s[i]).collect::<Vec<_>>())));
        }
        let per_token = |have: bool, sum: f64| have.then(|| sum / sums.tokens.max(1.0));
        let mut put = |key: &str, v: serde_json::Value| {
            r.insert(key.into(), v);
        };
        put("train/accuracy", json!(mean(&correct)));
        put("train/advantage_std", json!(groups.advantage_std));
        put("train/frac_reward_zero_std", json!(groups.flat_groups as f64 / groups.generated_groups.max(1) as f64));
        if config.dynamic_sampling {
            put("train/rollout_rounds", json!(groups.rounds));
            put("train/groups_kept", json!(groups.kept_groups));
        }
        if let Some(e) = per_token(sums.have_entropy, sums.entropy) {
            put("train/entropy", json!(e));
        }
        if let Some(k) = per_token(sums.have_kl, sums.kl) {
            put("train/kl", json!(k));
        }
        if let Some(c) = per_token(sums.have_clip, sums.clipped) {
            put("train/clip_ratio", json!(c));
        }
        if updated.mixes > 0 {
            put("train/ref_model_synced", json!(updated.mixes));
        }
        if let Some(d) = sums.rollout_logp_max_abs_diff {
            put("train/rollout_logp_max_abs_diff", json!(d));
        }
        if let Some(a) = self.adaptive.as_mut() {
            put("train/entropy_coef", json!(a.coef));
            a.observe(per_token(sums.have_entropy, sums.entropy), config);
            self.state.adaptive_entropy = Some(*a);
        }
        let report = &updated.report;
        put("train/completion_len_mean", json!(completion_len));
        put("train/grad_norm", json!(report.grad_norm));
        put("train/lr", json!(report.lr));
        put("train/skipped_steps", json!(self.updater.skipped));
        put("time/rollout_s", json!(groups.rollout_s));
        put("time/reward_s", json!(groups.reward_s));
        put("time/logprob_s", json!(scored.seconds));
        put("time/update_s", json!(updated.seconds));
        let ranks = self.run.mesh.world.size();
        if ranks > 1 {
            put("time/comm_s", json!(report.comm_s));
            put("parallel/ranks", json!(ranks));
        }
        put("time/step_s", json!(step_s));
        put("time/step_avg_last10_s", json!(mean(&self.state.recent_step_s)));
        put("throughput/valid_tokens_per_s", json!(scored.valid_tokens as f64 / step_s));
        put("mem/peak_rss_bytes", json!(metrics::peak_rss_bytes()));
        if let Some(h) = updated.heap {
            put("mem/update_peak_heap_bytes", json!(h));
        }
        r
    }

    /// The held-out accuracy every `eval_every_steps` steps and after the last (greedy too, after
    /// the last), into the step's record.
    fn evaluate(&mut self, model: &Qwen2, step: usize, r: &mut Record) -> Result<()> {
        let config = self.run.config;
        let due = config.eval_every_steps > 0 && step.is_multiple_of(config.eval_every_steps);
        if !(due || step == config.steps) {
            return Ok(());
        }
        self.eval_after = self.held_out.sampled(model, step)?;
        if let Some(a) = self.eval_after {
            r.insert("eval/accuracy".into(), json!(a));
        }
        if step == config.steps {
            self.eval_greedy_after = self.held_out.greedy(model)?;
            if let Some(g) = self.eval_greedy_after {
                r.insert("eval/accuracy_greedy".into(), json!(g));
            }
        }
        Ok(())
    }

    /// The ranks' weights compared where due (a mismatch ends the run before the step is
    /// logged), the step's record to the log (rank 0), its completions, a checkpoint where due,
    /// the progress bar.
    fn write_step(&mut self, model: &Qwen2, groups: &Groups, r: &Record, update_s: f64) -> Result<()> {
        let (run, step) = (&mut self.run, self.state.step);
        let (config, world) = (run.config, run.mesh.world);
        if run.check_weights_every > 0 && world.size() > 1 && step % run.check_weights_every == 0 {
            check_weights(&model.params, world, step)?;
        }
        if world.is_root() {
            run.log.write(r)?;
        }
        if let Some(c) = self.completions.as_mut() {
            completions_log::write(
                c,
                step,
                groups,
                &config.reward_weights,
                run.tokenizer,
                config.num_completions_to_print,
            )?;
        }
        self.rewards_per_step.push(mean(&groups.rewards));
        self.update_times.push(update_s);
        let due = config.checkpoint_every > 0 && (step % config.checkpoint_every == 0 || step == config.steps);
        if world.is_root() && due {
            let ckpt = checkpoint_dir(run.out);
            save_checkpoint(&ckpt, model, run.reference, run.tokenizer, run.side_files, &self.updater, &self.state)?;
        }
        let shown = [("train/reward_mean", "reward"), ("train/accuracy", "acc"), ("eval/accuracy", "eval")];
        self.bar.set_message(metrics::summary_line(r, &shown));
        self.bar.inc();
        Ok(())
    }

    fn finish(mut self) -> GrpoSummary {
        self.bar.finish();
        let rewards = &self.rewards_per_step;
        GrpoSummary {
            steps: self.state.step,
            eval_before: self.state.eval_before,
            eval_after: self.eval_after,
            eval_greedy_before: self.state.eval_greedy_before,
            eval_greedy_after: self.eval_greedy_after,
            reward_first: rewards.first().copied().unwrap_or(f64::NAN),
            reward_last10: mean(&rewards[rewards.len().saturating_sub(10)..]),
            reward_mean: mean(rewards),
            step_avg_last10_s: mean(&self.state.recent_step_s),
            update_s_mean: mean(&self.update_times),
            peak_rss_bytes: metrics::peak_rss_bytes(),
            update_peak_heap_bytes: self.update_peak,
            skipped_steps: self.updater.skipped,
        }
    }
}

/// The run against its inputs: the ranks against a resumed checkpoint's, the prompts, a
/// reference model where the KL needs one.
fn check_run(run: &GrpoRun<'_>) -> Result<()> {
    let ranks = run.mesh.world.size();
    if let Some(r) = run.resume {
        if r.state.world_size != ranks {
            return Err(TrainError::Other(format!(
                "the checkpoint was written by {} data-parallel ranks and this run has {ranks}: resume with `mpirun -np {}`",
                r.state.world_size, r.state.world_size
            )));
        }
    }
    if run.train.is_empty() {
        return Err(TrainError::Other("GRPO: no training prompts".into()));
    }
    if run.loss.options.beta != 0.0 && run.reference.is_none() {
        return Err(TrainError::Other("loss.beta != 0 needs a reference model".into()));
    }
    Ok(())
}

/// The optimiser and the trainer's state: new, or restored from the checkpoint resumed.
fn optimiser_and_state(params: &Params, run: &GrpoRun<'_>) -> Result<(Updater, TrainerState)> {
    let config = run.config;
    let total_optimizer_steps = config.steps * config.ppo_epochs;
    if let Some(c) = run.resume {
        let (steps, skipped) = (c.state.optimizer_steps, c.state.skipped_steps);
        let updater = Updater::restore(params, config.optim, total_optimizer_steps, &c.optimizer, steps, skipped)?;
        return Ok((updater, c.state.clone()));
    }
    let state = TrainerState {
        step: 0,
        rng: Rng::new(run.seed ^ 0x6E90).state(),
        optimizer_steps: 0,
        skipped_steps: 0,
        eval_before: None,
        eval_greedy_before: None,
        recent_step_s: Vec::new(),
        world_size: run.mesh.world.size(),
        adaptive_entropy: None,
    };
    Ok((Updater::new(params, config.optim, total_optimizer_steps)?, state))
}

/// The held-out evaluation of a run: sampled as the config says, and greedy where that samples.
struct HeldOut<'a> {
    evaluation: Evaluation<'a>,
    prompts: &'a [Prompt],
    seed: u64,
}

impl<'a> HeldOut<'a> {
    fn of(run: &GrpoRun<'a>) -> Self {
        let config = run.config;
        let evaluation = Evaluation {
            sampling: config.eval_sampling(),
            samples: config.eval_samples,
            batch_size: config.eval_batch_size,
            tokenizer: run.tokenizer,
            eos: run.eos,
            pad: run.pad,
            comm: run.mesh.data(),
        };
        Self { evaluation, prompts: run.eval, seed: run.seed }
    }

    /// The accuracy with the evaluation's sampling (`None` without held-out prompts).
    fn sampled(&self, model: &Qwen2, step: usize) -> Result<Option<f64>> {
        if self.prompts.is_empty() {
            return Ok(None);
        }
        Ok(Some(self.evaluation.accuracy(model, self.prompts, self.seed ^ 0xE7A1 ^ step as u64)?))
    }

    /// The greedy accuracy, where the evaluation samples (else [`HeldOut::sampled`] is greedy).
    fn greedy(&self, model: &Qwen2) -> Result<Option<f64>> {
        if self.prompts.is_empty() || self.evaluation.sampling.temperature == 0.0 {
            return Ok(None);
        }
        let sampling = Sampling { temperature: 0.0, ..self.evaluation.sampling };
        Ok(Some(Evaluation { sampling, ..self.evaluation }.accuracy(model, self.prompts, 0)?))
    }

    /// Both before the first step, logged (rank 0) as step 0.
    fn before(
        &self,
        model: &Qwen2,
        log: &mut MetricsLog,
        world: &dyn Collective,
    ) -> Result<(Option<f64>, Option<f64>)> {
        let (sampled, greedy) = (self.sampled(model, 0)?, self.greedy(model)?);
        if let (Some(a), true) = (sampled, world.is_root()) {
            let mut r = record(json!({"step": 0, "eval/accuracy": a}));
            if let Some(g) = greedy {
                r.insert("eval/accuracy_greedy".into(), json!(g));
            }
            log.write(&r)?;
        }
        Ok((sampled, greedy))
    }
}

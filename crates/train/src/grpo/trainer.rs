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
use super::rollouts::RolloutSetup;
use super::update::{update, EngineBuffers, Objective, UpdateBatch, UpdateInputs};
use crate::error::{Result, TrainError};
use crate::head_loss::LossConfig;
use crate::metrics::{self, record, MetricsLog};
use crate::model::{Qwen2, Sampling};
use crate::optim::Updater;
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

/// Trains `model` in place.
pub fn train_grpo(model: &Qwen2, run: GrpoRun<'_>) -> Result<GrpoSummary> {
    let GrpoRun {
        config,
        loss,
        train,
        eval,
        tokenizer,
        eos,
        pad,
        side_files,
        reference,
        seed,
        out,
        log,
        progress,
        resume,
        stop_after,
        after_step,
        mesh,
        check_weights_every,
    } = run;
    let (comm, world) = (mesh.data(), mesh.world);
    config.validate()?;
    config.check_ranks(comm.size())?;
    flashgrpo_kernels::matmul::set_batch_invariant(config.batch_invariant);
    let ranks = world.size();
    if let Some(r) = resume {
        if r.state.world_size != ranks {
            return Err(TrainError::Other(format!(
                "the checkpoint was written by {} data-parallel ranks and this run has {ranks}: resume with `mpirun -np {}`",
                r.state.world_size, r.state.world_size
            )));
        }
    }
    let progress = progress && world.is_root();
    if train.is_empty() {
        return Err(TrainError::Other("GRPO: no training prompts".into()));
    }
    let mut options: LossOptions = loss.options.clone();
    if options.max_completion_length.is_none() {
        options.max_completion_length = Some(config.max_new_tokens);
    }
    let beta = options.beta;
    if beta != 0.0 && reference.is_none() {
        return Err(TrainError::Other("loss.beta != 0 needs a reference model".into()));
    }
    let params = &model.params;
    let total_optimizer_steps = config.steps * config.ppo_epochs;
    let (mut updater, mut state) = match resume {
        Some(c) => (
            Updater::restore(
                params,
                config.optim,
                total_optimizer_steps,
                &c.optimizer,
                c.state.optimizer_steps,
                c.state.skipped_steps,
            )?,
            c.state.clone(),
        ),
        None => (
            Updater::new(params, config.optim, total_optimizer_steps)?,
            TrainerState {
                step: 0,
                rng: Rng::new(seed ^ 0x6E90).state(),
                optimizer_steps: 0,
                skipped_steps: 0,
                eval_before: None,
                eval_greedy_before: None,
                recent_step_s: Vec::new(),
                world_size: ranks,
                adaptive_entropy: None,
            },
        ),
    };
    let evaluation = Evaluation {
        sampling: config.eval_sampling(),
        samples: config.eval_samples,
        batch_size: config.eval_batch_size,
        tokenizer,
        eos,
        pad,
        comm,
    };
    let greedy = Evaluation { sampling: Sampling { temperature: 0.0, ..evaluation.sampling }, ..evaluation };
    let greedy_at = |model: &Qwen2| -> Result<Option<f64>> {
        if eval.is_empty() || config.eval_temperature() == 0.0 {
            return Ok(None);
        }
        Ok(Some(greedy.accuracy(model, eval, 0)?))
    };
    let eval_at = |model: &Qwen2, step: usize| -> Result<Option<f64>> {
        if eval.is_empty() {
            return Ok(None);
        }
        Ok(Some(evaluation.accuracy(model, eval, seed ^ 0xE7A1 ^ step as u64)?))
    };
    if resume.is_none() {
        state.eval_before = eval_at(model, 0)?;
        state.eval_greedy_before = greedy_at(model)?;
        if let Some(a) = state.eval_before {
            let mut r = record(json!({"step": 0, "eval/accuracy": a}));
            if let Some(g) = state.eval_greedy_before {
                r.insert("eval/accuracy_greedy".into(), json!(g));
            }
            if world.is_root() {
                log.write(&r)?;
            }
        }
    }
    let mut rng = Rng::from_state(state.rng);
    let mut adaptive =
        config.use_adaptive_entropy.then(|| state.adaptive_entropy.unwrap_or_else(|| AdaptiveEntropy::start(&options)));
    let rollouts = RolloutSetup { config, train, tokenizer, eos, comm };
    let mut bar = Progress::new("grpo", config.steps, state.step, progress, world.is_root());
    let probe = metrics::heap_probe();
    metrics::reset_peak_rss();
    let (mut rewards_per_step, mut update_times) = (Vec::new(), Vec::new());
    let mut update_peak: Option<usize> = None;
    let mut eval_after = state.eval_before;
    let mut eval_greedy_after = state.eval_greedy_before;
    let ckpt = checkpoint_dir(out);
    let mut engine = EngineBuffers::default();
    let resumed_at = resume.map(|r| r.state.step);
    let mut completions =
        (config.log_completions && world.is_root()).then(|| completions_log::open(out, resumed_at)).transpose()?;
    while state.step < config.steps {
        let step = state.step + 1;
        let started = Instant::now();

        // Rollout, rewards and advantages.
        let groups = rollouts.run(model, &mut engine.rollout, &mut rng)?;
        let (rollout_s, reward_s) = (groups.rollout_s, groups.reward_s);

        // Micro-batches, and the log-probabilities the loss compares against.
        let logprob_started = Instant::now();
        let mut batch = UpdateBatch::new(&groups.prompts, &groups.completions, config.micro_batch_size, pad)?;
        if config.mask_truncated_completions {
            batch.mask_sequences(&groups.truncated);
        }
        batch.share_normalisers(comm)?;
        // GRPO samples (temperature > 0), so the sampler recorded every kept completion; a rank
        // that kept none still takes part in the collectives.
        if options.top_entropy_quantile < 1.0 {
            batch.share_entropy_threshold(&groups.sampling_entropy, options.top_entropy_quantile, comm)?;
        }
        let recorded = groups.sampling_logp.len() == groups.completions.len();
        let recorded_logp = recorded.then(|| batch.per_micro_batch(&groups.sampling_logp));
        let sampling_logp = if config.sampling_logp { recorded_logp.clone() } else { None };
        let step_options = adaptive.map_or_else(|| options.clone(), |a| a.options(&options, config));
        let valid_tokens = batch.valid_tokens();
        let old_logp =
            (config.ppo_epochs > 1).then(|| batch.logprobs(model, &mut engine.score, &options, loss)).transpose()?;
        let ref_logp = match (beta != 0.0, reference) {
            (true, Some(r)) => Some(batch.logprobs(r, &mut engine.score, &options, loss)?),
            _ => None,
        };
        let logprob_s = logprob_started.elapsed().as_secs_f64();

        // Update.
        let update_started = Instant::now();
        let live_before = probe.map(|p| {
            (p.reset_peak)();
            (p.live)()
        });
        let objective = Objective::Grpo { advantages: &groups.advantages, old_logp, ref_logp, sampling_logp };
        let inputs = UpdateInputs { batch: &batch, objective, options: &step_options, loss, recorded_logp };
        let steps_before = updater.steps;
        let (losses, sums, report) = update(model, &inputs, config.ppo_epochs, &mut updater, &mut engine, mesh)?;
        let update_s = update_started.elapsed().as_secs_f64();
        // TRL's sync_ref_model: as many mixes as this step's optimizer steps are due.
        let mixes = if config.sync_ref_model {
            ref_sync::due(steps_before, updater.steps, config.ref_model_sync_steps)
        } else {
            0
        };
        if let Some(r) = reference {
            for _ in 0..mixes {
                ref_sync::mix_into(r, model, config.ref_model_mixup_alpha)?;
            }
        }
        let step_peak = probe.map(|p| (p.peak)());
        let update_heap = step_peak.zip(live_before).map(|(p, l)| p.saturating_sub(l));
        update_peak = update_peak.max(update_heap);
        let step_s = started.elapsed().as_secs_f64();
        state.step = step;
        state.rng = rng.state();
        state.optimizer_steps = updater.steps;
        state.skipped_steps = updater.skipped;
        state.recent_step_s.push(step_s);
        if state.recent_step_s.len() > 10 {
            state.recent_step_s.remove(0);
        }
        if report.skipped {
            bar.warn(&format!("warning: step {step} skipped (non-finite loss or gradient); the weights are unchanged"));
        }

        // Metrics.
        let (scores, rewards) = (&groups.scores, &groups.rewards);
        let correct: Vec<f64> = scores.iter().map(|s| s[0]).collect();
        let completion_len = mean(&groups.lengths.iter().map(|&l| l as f64).collect::<Vec<_>>());
        let mut r = record(json!({
            "step": step,
            "train/loss": mean(&losses),
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
        if mixes > 0 {
            put("train/ref_model_synced", json!(mixes));
        }
        if let Some(d) = sums.rollout_logp_max_abs_diff {
            put("train/rollout_logp_max_abs_diff", json!(d));
        }
        if let Some(a) = adaptive.as_mut() {
            put("train/entropy_coef", json!(a.coef));
            a.observe(per_token(sums.have_entropy, sums.entropy), config);
            state.adaptive_entropy = Some(*a);
        }
        put("train/completion_len_mean", json!(completion_len));
        put("train/grad_norm", json!(report.grad_norm));
        put("train/lr", json!(report.lr));
        put("train/skipped_steps", json!(updater.skipped));
        put("time/rollout_s", json!(rollout_s));
        put("time/reward_s", json!(reward_s));
        put("time/logprob_s", json!(logprob_s));
        put("time/update_s", json!(update_s));
        if ranks > 1 {
            put("time/comm_s", json!(report.comm_s));
            put("parallel/ranks", json!(ranks));
        }
        put("time/step_s", json!(step_s));
        put("time/step_avg_last10_s", json!(mean(&state.recent_step_s)));
        put("throughput/valid_tokens_per_s", json!(valid_tokens as f64 / step_s));
        put("mem/peak_rss_bytes", json!(metrics::peak_rss_bytes()));
        if let Some(h) = update_heap {
            put("mem/update_peak_heap_bytes", json!(h));
        }
        let eval_now = config.eval_every_steps > 0 && step % config.eval_every_steps == 0 || step == config.steps;
        if eval_now {
            eval_after = eval_at(model, step)?;
            if let Some(a) = eval_after {
                put("eval/accuracy", json!(a));
            }
            if step == config.steps {
                eval_greedy_after = greedy_at(model)?;
                if let Some(g) = eval_greedy_after {
                    put("eval/accuracy_greedy", json!(g));
                }
            }
        }
        if check_weights_every > 0 && ranks > 1 && step % check_weights_every == 0 {
            check_weights(&model.params, world, step)?;
        }
        if world.is_root() {
            log.write(&r)?;
        }
        if let Some(c) = completions.as_mut() {
            completions_log::write(
                c,
                step,
                &groups,
                &config.reward_weights,
                tokenizer,
                config.num_completions_to_print,
            )?;
        }
        rewards_per_step.push(mean(rewards));
        update_times.push(update_s);
        if world.is_root()
            && config.checkpoint_every > 0
            && (step % config.checkpoint_every == 0 || step == config.steps)
        {
            save_checkpoint(&ckpt, model, reference, tokenizer, side_files, &updater, &state)?;
        }
        bar.set_message(metrics::summary_line(
            &r,
            &[("train/reward_mean", "reward"), ("train/accuracy", "acc"), ("eval/accuracy", "eval")],
        ));
        bar.inc();
        if stop_after == Some(step) {
            break;
        }
        if let Some(hook) = after_step {
            (hook.0)(step);
        }
    }
    bar.finish();
    let tail = &rewards_per_step[rewards_per_step.len().saturating_sub(10)..];
    Ok(GrpoSummary {
        steps: state.step,
        eval_before: state.eval_before,
        eval_after,
        eval_greedy_before: state.eval_greedy_before,
        eval_greedy_after,
        reward_first: rewards_per_step.first().copied().unwrap_or(f64::NAN),
        reward_last10: mean(tail),
        reward_mean: mean(&rewards_per_step),
        step_avg_last10_s: mean(&state.recent_step_s),
        update_s_mean: mean(&update_times),
        peak_rss_bytes: metrics::peak_rss_bytes(),
        update_peak_heap_bytes: update_peak,
        skipped_steps: updater.skipped,
    })
}

//! Supervised fine-tuning: prompt + completion pairs, the loss on the completion tokens only
//! (cross-entropy at the head, `loss.impl` choosing how), averaged over every completion token of
//! an accumulation window (TRL's `num_items_in_batch`: micro-batches of different lengths weigh by
//! their tokens, so accumulating gives the loss of one large batch).

use std::time::Instant;

use flashgrpo_collective::{share, Collective, ReduceOp, SingleProcess};
use flashgrpo_kernels::synthetic::Rng;
use flashgrpo_kernels::Reduction;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokenizers::Tokenizer;

use crate::engine::Workspace;
use crate::error::{Result, TrainError};
use crate::grpo::update::{batch_loss, update, EngineBuffers, UpdateBatch, UpdateInputs};
use crate::head_loss::LossConfig;
use crate::metrics::{self, record, MetricsLog, Record};
use crate::model::Qwen2;
use crate::optim::{OptimConfig, StepReport, Updater};
use crate::progress::Progress;
use crate::tokenizer::encode;

/// The `sft:` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SftConfig {
    /// Optimiser steps.
    pub steps: usize,
    /// Sequences per micro-batch.
    pub batch_size: usize,
    /// Micro-batches per optimiser step.
    pub grad_accum: usize,
    /// Sequences are cut to this many tokens (prompt + completion + end of text).
    pub max_len: usize,
    /// Held-out loss every this many steps (and before the first and after the last); 0: only
    /// before and after.
    pub eval_every: usize,
    pub optim: OptimConfig,
}

impl Default for SftConfig {
    fn default() -> Self {
        Self {
            steps: 2000,
            batch_size: 16,
            grad_accum: 1,
            max_len: 384,
            eval_every: 0,
            optim: OptimConfig { lr: 2e-3, warmup_steps: 20, min_lr_ratio: 0.1, ..OptimConfig::default() },
        }
    }
}

impl SftConfig {
    pub fn validate(&self, loss: &LossConfig) -> Result<()> {
        let bad = |why: &str| Err(TrainError::Config { origin: "sft".into(), why: why.into() });
        if self.steps == 0 || self.batch_size == 0 || self.grad_accum == 0 {
            return bad("sft.steps, sft.batch_size and sft.grad_accum must be positive");
        }
        if self.max_len < 2 {
            return bad("sft.max_len must be at least 2");
        }
        if loss.options.reduction != Reduction::Mean {
            return bad(
                "SFT averages over the completion tokens of each accumulation window; leave loss.reduction at mean",
            );
        }
        self.optim.validate("sft.optim")
    }
}

/// A training example: the model sees `prompt + completion`, and learns the completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub prompt: String,
    pub completion: String,
}

/// A tokenised example: `ids` (completion ending with end of text), of which the first
/// `prompt_len` are prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Encoded {
    pub ids: Vec<u32>,
    pub prompt_len: usize,
}

impl Encoded {
    /// Positions whose next token is a completion token: what the loss counts.
    pub fn targets(&self) -> usize {
        self.ids.len().saturating_sub(self.prompt_len.max(1))
    }
}

/// Tokenises examples, appending `eos` to each completion and cutting to `max_len` tokens; an
/// example left without completion tokens is dropped (the count is returned).
pub fn encode_examples(
    tokenizer: &Tokenizer,
    examples: &[Example],
    eos: u32,
    max_len: usize,
) -> Result<(Vec<Encoded>, usize)> {
    let mut out = Vec::with_capacity(examples.len());
    let mut dropped = 0;
    for e in examples {
        let mut ids = encode(tokenizer, &e.prompt)?;
        let prompt_len = ids.len();
        ids.extend(encode(tokenizer, &e.completion)?);
        ids.push(eos);
        ids.truncate(max_len);
        let encoded = Encoded { ids, prompt_len };
        if encoded.targets() == 0 {
            dropped += 1;
        } else {
            out.push(encoded);
        }
    }
    Ok((out, dropped))
}

/// Examples as the engine's update lays them out: the prompt (at least one token) and the rest,
/// whose tokens are the targets, in micro-batches of `batch_size` whose losses are each a share
/// of the whole batch's mean over its completion tokens (TRL's `num_items_in_batch`).
fn update_batch(examples: &[&Encoded], batch_size: usize, pad: u32) -> Result<UpdateBatch> {
    let (prompts, completions): (Vec<Vec<u32>>, Vec<Vec<u32>>) = examples
        .iter()
        .map(|e| {
            let p = e.prompt_len.max(1);
            (e.ids[..p].to_vec(), e.ids[p..].to_vec())
        })
        .unzip();
    UpdateBatch::new(&prompts, &completions, batch_size, pad)
}

/// The mean completion-token loss over `data` (no gradient).
pub fn evaluate(model: &Qwen2, data: &[Encoded], batch_size: usize, loss: &LossConfig, pad: u32) -> Result<f64> {
    evaluate_shared(model, data, batch_size, loss, pad, &SingleProcess)
}

/// [`evaluate`] with the examples shared among the ranks of `comm`.
pub fn evaluate_shared(
    model: &Qwen2,
    data: &[Encoded],
    batch_size: usize,
    loss: &LossConfig,
    pad: u32,
    comm: &dyn Collective,
) -> Result<f64> {
    let refs: Vec<&Encoded> = data[share(data.len(), comm.size(), comm.rank())].iter().collect();
    let mut batch = update_batch(&refs, batch_size, pad)?;
    batch.share_normalisers(comm)?;
    let inputs = UpdateInputs::cross_entropy(&batch, loss);
    let mut total = [batch_loss(model, &inputs, &mut Workspace::default())?];
    comm.all_reduce_f64(&mut total, ReduceOp::Sum)?;
    Ok(total[0])
}

/// What an SFT run did.
#[derive(Debug, Clone, PartialEq)]
pub struct SftSummary {
    pub first_loss: f64,
    /// Mean of the last (up to) 10 steps.
    pub last_loss: f64,
    pub eval_before: Option<f64>,
    pub eval_after: Option<f64>,
    /// Mean step time, first step excluded when there are several.
    pub step_s_mean: f64,
    pub peak_rss_bytes: u64,
    /// Resident memory when the steps began (model, optimiser state, data).
    pub rss_before_steps: u64,
    /// With a heap probe installed: the live heap when the steps began, and its highest point
    /// during any step.
    pub heap_before_steps: Option<usize>,
    pub peak_heap_bytes: Option<usize>,
    pub skipped_steps: usize,
}

/// Everything a run needs besides the model.
pub struct SftRun<'a> {
    pub config: &'a SftConfig,
    pub loss: &'a LossConfig,
    pub train: &'a [Encoded],
    pub eval: &'a [Encoded],
    pub pad: u32,
    pub seed: u64,
    pub log: Option<&'a mut MetricsLog>,
    /// Progress on stderr (`crate::progress`): a bar on a terminal, plain lines elsewhere.
    pub progress: bool,
    /// The processes: each data group trains on its share of every step's examples, the
    /// gradients summed; rank 0 writes the log.
    pub mesh: &'a crate::parallel::Mesh<'a>,
    /// Compare the ranks' weights every this many steps (0: never).
    pub check_weights_every: usize,
}

/// The training examples in a new random order for each pass over them.
struct Shuffled {
    rng: Rng,
    order: Vec<usize>,
}

impl Shuffled {
    fn new(seed: u64) -> Self {
        Self { rng: Rng::new(seed), order: Vec::new() }
    }

    /// The next of `len` examples (a Fisher-Yates shuffle of `0..len` once the last pass is used).
    fn next(&mut self, len: usize) -> usize {
        if self.order.is_empty() {
            self.order = (0..len).collect();
            for i in (1..len).rev() {
                self.order.swap(i, self.rng.below(i + 1));
            }
        }
        self.order.pop().expect("refilled")
    }
}

/// One optimiser step on `batch` (this rank's share of the step's examples): the normalisers
/// shared over the ranks, cross-entropy of the completion tokens. Returns the step's loss, its
/// completion tokens over every rank (`train/tokens`) and the optimiser's report.
fn sft_update(
    model: &Qwen2,
    mut batch: UpdateBatch,
    loss: &LossConfig,
    updater: &mut Updater,
    engine: &mut EngineBuffers,
    mesh: &crate::parallel::Mesh<'_>,
) -> Result<(f64, usize, StepReport)> {
    batch.share_normalisers(mesh.data())?;
    let tokens = batch.valid_tokens();
    let inputs = UpdateInputs::cross_entropy(&batch, loss);
    let (losses, _, report) = update(model, &inputs, 1, updater, engine, mesh)?;
    Ok((losses[0], tokens, report))
}

/// A step's metrics.
fn step_record(
    step: usize,
    loss: f64,
    report: &StepReport,
    tokens: usize,
    skipped: usize,
    step_s: f64,
    heap: Option<usize>,
) -> Record {
    let mut r = record(json!({
        "step": step,
        "train/loss": loss,
        "train/lr": report.lr,
        "train/grad_norm": report.grad_norm,
        "train/tokens": tokens,
        "train/skipped_steps": skipped,
        "time/step_s": step_s,
        "throughput/tokens_per_s": tokens as f64 / step_s,
        "mem/peak_rss_bytes": metrics::peak_rss_bytes(),
    }));
    if let Some(h) = heap {
        r.insert("mem/peak_heap_bytes".into(), json!(h));
    }
    r
}

/// Trains `model` in place: per step, draw the examples, update, record, evaluate where due,
/// compare the ranks' weights where due, log.
pub fn train_sft(model: &Qwen2, run: SftRun<'_>) -> Result<SftSummary> {
    let SftRun { config, loss, train, eval, pad, seed, mut log, progress, mesh, check_weights_every } = run;
    let (comm, world) = (mesh.data(), mesh.world);
    let progress = progress && world.is_root();
    if !world.is_root() {
        log = None;
    }
    config.validate(loss)?;
    if train.is_empty() {
        return Err(TrainError::Other("SFT: no training examples".into()));
    }
    let params = &model.params;
    let mut updater = Updater::new(params, config.optim, config.steps)?;
    let mut order = Shuffled::new(seed ^ 0x5F7);
    let eval_loss = |model: &Qwen2| -> Result<Option<f64>> {
        (!eval.is_empty()).then(|| evaluate_shared(model, eval, config.batch_size, loss, pad, comm)).transpose()
    };
    let eval_before = eval_loss(model)?;
    let mut write = |record: &Record| -> Result<()> { log.as_deref_mut().map_or(Ok(()), |l| l.write(record)) };
    if let Some(e) = eval_before {
        write(&record(json!({"step": 0, "eval/loss": e})))?;
    }
    let mut bar = Progress::new("sft", config.steps, 0, progress, world.is_root());
    let (mut losses, mut times) = (Vec::new(), Vec::new());
    let mut eval_after = eval_before;
    metrics::reset_peak_rss();
    let rss_before_steps = metrics::rss_bytes();
    let probe = metrics::heap_probe();
    let heap_before_steps = probe.map(|p| (p.live)());
    let mut peak_heap: Option<usize> = None;
    let mut engine = EngineBuffers::default();
    for step in 1..=config.steps {
        if let Some(p) = probe {
            (p.reset_peak)();
        }
        let started = Instant::now();
        let examples: Vec<&Encoded> =
            (0..config.grad_accum * config.batch_size).map(|_| &train[order.next(train.len())]).collect();
        let mine = share(examples.len(), comm.size(), comm.rank());
        let batch = update_batch(&examples[mine], config.batch_size, pad)?;
        let (total, window, report) = sft_update(model, batch, loss, &mut updater, &mut engine, mesh)?;
        let step_s = started.elapsed().as_secs_f64();
        let step_heap = probe.map(|p| (p.peak)());
        peak_heap = peak_heap.max(step_heap);
        losses.push(total);
        times.push(step_s);
        if report.skipped {
            bar.warn(&format!("warning: step {step} skipped (non-finite loss or gradient)"));
        }
        let mut r = step_record(step, total, &report, window, updater.skipped, step_s, step_heap);
        if config.eval_every > 0 && step % config.eval_every == 0 || step == config.steps {
            eval_after = eval_loss(model)?;
            if let Some(e) = eval_after {
                r.insert("eval/loss".into(), json!(e));
            }
        }
        if check_weights_every > 0 && world.size() > 1 && step % check_weights_every == 0 {
            crate::parallel::check_weights(&model.params, world, step)?;
        }
        write(&r)?;
        bar.set_message(metrics::summary_line(
            &r,
            &[("train/loss", "loss"), ("train/lr", "lr"), ("eval/loss", "eval")],
        ));
        bar.inc();
    }
    bar.finish();
    let tail = &losses[losses.len().saturating_sub(10)..];
    let timed = if times.len() > 1 { &times[1..] } else { &times[..] };
    Ok(SftSummary {
        first_loss: losses[0],
        last_loss: tail.iter().sum::<f64>() / tail.len() as f64,
        eval_before,
        eval_after,
        step_s_mean: timed.iter().sum::<f64>() / timed.len() as f64,
        peak_rss_bytes: metrics::peak_rss_bytes(),
        rss_before_steps,
        heap_before_steps,
        peak_heap_bytes: peak_heap,
        skipped_steps: updater.skipped,
    })
}

//! `flashgrpo train` (GRPO): the task's problems, the model and tokenizer (a Hugging Face
//! directory, or new: a Qwen2 from the config and a BPE trained on the task's text), an optional
//! SFT warm start on the worked solutions (fused-linear cross-entropy, saved as `warm_start/`, a
//! Hugging Face directory any tool can start from), GRPO, and what a user reads afterwards:
//! `metrics.jsonl`, `sft_metrics.jsonl`, `config.json`, `summary.json`, the trained `model/`, PNG
//! plots, and `checkpoint/` to resume from.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use flashgrpo_collective::{Collective, SingleProcess};

use serde_json::json;
use tokenizers::Tokenizer;

use crate::data::sloppy_teacher::sloppy_answers;
use crate::data::Gsm8kProblem;
use crate::error::{io, Result, TrainError};
use crate::grpo::{train_grpo, Checkpoint, GrpoRun, GrpoSummary, Prompt, Resume, StepHook};
use crate::head_loss::{LossConfig, LossImpl};
use crate::metrics::MetricsLog;
use crate::model::{load_tokenizer, save_model, Qwen2};
use crate::parallel::{broadcast_weights, Mesh};
use crate::plot::plot_metrics;
use crate::prompt::PromptFormat;
use crate::rewards::formatted;
use crate::setup::{setup, tokenizer_dir, Setup};
use crate::sft::{encode_examples, train_sft, Example, SftRun, SftSummary};
use crate::special_tokens::{special_ids, SpecialIds};
use crate::tokenizer::{encode, save_tokenizer, SideFiles, CHATML_TEMPLATE, END_OF_TEXT};
use crate::train_config::TrainConfig;

/// How a job runs besides its config.
#[derive(Clone)]
pub struct JobOptions {
    /// Continue from this checkpoint directory (`OUT/checkpoint`).
    pub resume: Option<PathBuf>,
    /// Stop after this GRPO step, as if killed (tests).
    pub stop_after: Option<usize>,
    /// Called after every GRPO step, outside all timed regions (`flashgrpo ab` alternates its arms).
    pub after_step: Option<StepHook>,
    /// The processes of the job (`mpirun -np K`): data-parallel ranks; one process by default.
    pub comm: Arc<dyn Collective>,
}

impl Default for JobOptions {
    fn default() -> Self {
        Self { resume: None, stop_after: None, after_step: None, comm: Arc::new(SingleProcess) }
    }
}

impl std::fmt::Debug for JobOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobOptions")
            .field("resume", &self.resume)
            .field("stop_after", &self.stop_after)
            .field("ranks", &self.comm.size())
            .finish()
    }
}

/// What the job did.
#[derive(Debug, Clone)]
pub struct GrpoJobSummary {
    pub warm_start: Option<SftSummary>,
    pub grpo: GrpoSummary,
    pub out: PathBuf,
}

/// The prompt format of a run: the chat template of the tokenizer's directory when it has one
/// (a trained tokenizer gets ChatML, which `save_tokenizer` also writes), plain text otherwise.
pub fn prompt_format(config: &TrainConfig, trained_tokenizer: bool) -> Result<PromptFormat> {
    let system = config.task.system_prompt();
    if trained_tokenizer {
        return Ok(PromptFormat {
            chat_template: Some(CHATML_TEMPLATE.into()),
            eos_token: Some(END_OF_TEXT.into()),
            system_prompt: system,
            ..Default::default()
        });
    }
    match tokenizer_dir(config) {
        Some(d) => PromptFormat::from_tokenizer_dir(&d, system),
        None => Ok(PromptFormat { system_prompt: system, ..Default::default() }),
    }
}

/// The SFT examples of problems: the prompt, and the worked solution in the rewarded format.
pub fn warm_start_examples(format: &PromptFormat, problems: &[Gsm8kProblem]) -> Result<Vec<Example>> {
    problems
        .iter()
        .map(|p| Ok(Example { prompt: format.render(&p.question)?, completion: formatted(&p.reasoning, &p.answer) }))
        .collect()
}

/// Tokenised prompts that leave room for `max_new_tokens` within the model's positions (longer
/// ones are dropped, and counted).
pub fn encode_prompts(
    tokenizer: &Tokenizer,
    format: &PromptFormat,
    problems: &[Gsm8kProblem],
    room: usize,
) -> Result<(Vec<Prompt>, usize)> {
    let mut out = Vec::with_capacity(problems.len());
    let mut dropped = 0;
    for p in problems {
        let ids = encode(tokenizer, &format.render(&p.question)?)?;
        if ids.is_empty() || ids.len() > room {
            dropped += 1;
        } else {
            out.push(Prompt { ids, answer: p.answer.clone() });
        }
    }
    Ok((out, dropped))
}

fn write_json(path: &Path, value: &impl serde::Serialize) -> Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(value).expect("json")).map_err(io(path))
}

/// Runs GRPO as the config says, in `config.out`, with the bf16 products `model.bf16_products`
/// names (the layers' and the head's).
pub fn run_grpo_job(config: &TrainConfig, options: &JobOptions) -> Result<GrpoJobSummary> {
    config.model.bf16_products.run(|| grpo_job(config, options))
}

fn grpo_job(config: &TrainConfig, options: &JobOptions) -> Result<GrpoJobSummary> {
    config.validate()?;
    let comm = options.comm.as_ref();
    let mesh = Mesh::new(comm, &config.parallel)?;
    config.grpo.check_ranks(mesh.data().size())?;
    let (out, root) = (config.out.clone(), comm.is_root());
    if root {
        for warning in config.warnings() {
            eprintln!("warning: {warning}");
        }
        std::fs::create_dir_all(&out).map_err(io(&out))?;
        write_json(&out.join("config.json"), config)?;
    }
    let (train_problems, eval_problems) = config.task.load(&config.data, config.seed)?;

    let checkpoint = options.resume.as_deref().map(Checkpoint::load).transpose()?;
    let (setup, reference, warm_start, resume) = match checkpoint {
        Some(checkpoint) => {
            let (setup, reference, resume) = resumed_setup(config, checkpoint, comm)?;
            (setup, reference, None, Some(resume))
        }
        None => {
            let (setup, warm_start) = fresh_start(config, &train_problems, &eval_problems, &out, &mesh)?;
            let reference = (config.loss.options.beta != 0.0).then(|| setup.model.frozen_copy()).transpose()?;
            (setup, reference, warm_start, None)
        }
    };
    let format = prompt_format(config, setup.trained_tokenizer)?;
    let room = setup.model.max_positions().saturating_sub(config.grpo.max_new_tokens);
    let (train, dropped) = encode_prompts(&setup.tokenizer, &format, &train_problems, room)?;
    if train.is_empty() {
        return Err(TrainError::Other(format!(
            "no training prompt fits in the model's {} positions with grpo.max_new_tokens = {} ({dropped} dropped)",
            setup.model.max_positions(),
            config.grpo.max_new_tokens
        )));
    }
    let (eval, _) = encode_prompts(&setup.tokenizer, &format, &eval_problems, room)?;
    let mut log = match &resume {
        _ if !root => MetricsLog::discard(),
        Some(r) => MetricsLog::resume(&out, r.state.step)?,
        None => MetricsLog::open(&out, false)?,
    }
    .with_tensorboard(&out.join("tensorboard/grpo"))?;
    let grpo = train_grpo(
        &setup.model,
        GrpoRun {
            config: &config.grpo,
            loss: &config.loss,
            train: &train,
            eval: &eval,
            tokenizer: &setup.tokenizer,
            eos: &setup.stop,
            pad: setup.pad,
            side_files: &setup.side_files,
            reference: reference.as_ref(),
            seed: config.seed,
            out: &out,
            log: &mut log,
            progress: config.progress,
            resume: resume.as_ref(),
            stop_after: options.stop_after,
            after_step: options.after_step.as_ref(),
            mesh: &mesh,
            check_weights_every: config.parallel.check_weights_every,
        },
    )?;
    if !root {
        comm.barrier()?;
        return Ok(GrpoJobSummary { warm_start, grpo, out });
    }
    let model_dir = out.join("model");
    save_model(&setup.model, &model_dir, None)?;
    save_tokenizer(&setup.tokenizer, &model_dir, &setup.side_files)?;
    write_json(&out.join("summary.json"), &job_summary(config.sft.steps, warm_start.as_ref(), &grpo))?;
    plot_metrics(log.path(), &out.join("plots"))?;
    comm.barrier()?;
    Ok(GrpoJobSummary { warm_start, grpo, out })
}

/// The model, tokenizer, reference model and trainer state of a run that resumes from
/// `checkpoint`.
fn resumed_setup(
    config: &TrainConfig,
    checkpoint: Checkpoint,
    comm: &dyn Collective,
) -> Result<(Setup, Option<Qwen2>, Resume)> {
    let Checkpoint { model, reference, tokenizer_dir: model_dir, resume } = checkpoint;
    let tokenizer = load_tokenizer(&model_dir)?;
    let trained = config.model.path.is_none() && config.tokenizer.path.is_none();
    // Every rank reads the checkpoint (a shared filesystem on several machines): prove they read
    // the same weights.
    crate::parallel::check_weights(&model.params, comm, resume.state.step)?;
    // The checkpoint's model directory holds the side files the run started with.
    let side_files = SideFiles { tokenizer_dir: Some(model_dir.clone()), model_dir: Some(model_dir) };
    let SpecialIds { eos, stop, pad } = special_ids(&model, &tokenizer, &side_files)?;
    let setup = Setup { model, tokenizer, eos, stop, pad, trained_tokenizer: trained, side_files };
    Ok((setup, reference, resume))
}

/// `summary.json`: the warm start's figures (`sft_steps` of them, where there was one) and the
/// GRPO run's.
fn job_summary(sft_steps: usize, warm_start: Option<&SftSummary>, grpo: &GrpoSummary) -> serde_json::Value {
    json!({
        "warm_start": warm_start.map(|w| json!({
            "steps": sft_steps, "first_loss": w.first_loss, "last_loss": w.last_loss,
            "eval_loss_before": w.eval_before, "eval_loss_after": w.eval_after, "step_s_mean": w.step_s_mean,
        })),
        "grpo": {
            "steps": grpo.steps, "eval_accuracy_before": grpo.eval_before, "eval_accuracy_after": grpo.eval_after,
            "reward_first": grpo.reward_first, "reward_last10": grpo.reward_last10, "reward_mean": grpo.reward_mean,
            "step_avg_last10_s": grpo.step_avg_last10_s, "update_s_mean": grpo.update_s_mean,
            "peak_rss_bytes": grpo.peak_rss_bytes, "update_peak_heap_bytes": grpo.update_peak_heap_bytes,
            "skipped_steps": grpo.skipped_steps,
        },
    })
}

/// The tokenizer and model of a run that does not resume, after its SFT warm start (saved in
/// `warm_start/` when there is one).
fn fresh_start(
    config: &TrainConfig,
    train_problems: &[Gsm8kProblem],
    eval_problems: &[Gsm8kProblem],
    out: &Path,
    mesh: &Mesh<'_>,
) -> Result<(Setup, Option<SftSummary>)> {
    let comm = mesh.world;
    let corpus_format = prompt_format(config, true)?;
    let corpus: Vec<String> = train_problems
        .iter()
        .map(|p| Ok(format!("{}{}", corpus_format.render(&p.question)?, formatted(&p.reasoning, &p.answer))))
        .collect::<Result<_>>()?;
    let setup = setup(config, corpus.iter())?;
    broadcast_weights(&setup.model.params, comm)?;
    if config.sft.steps == 0 {
        return Ok((setup, None));
    }
    let format = prompt_format(config, setup.trained_tokenizer)?;
    let summary = warm_start(config, &setup, &format, train_problems, eval_problems, out, mesh)?;
    if comm.is_root() {
        save_model(&setup.model, &warm_start_dir(out), None)?;
        save_tokenizer(&setup.tokenizer, &warm_start_dir(out), &setup.side_files)?;
    }
    Ok((setup, Some(summary)))
}

/// Only the SFT warm start of `config`, into `config.out/warm_start` (no GRPO): what a peer
/// trainer starts from.
pub fn make_warm_start(config: &TrainConfig) -> Result<PathBuf> {
    config.validate()?;
    if config.sft.steps == 0 {
        return Err(TrainError::Config { origin: "sft.steps".into(), why: "a warm start needs sft.steps > 0".into() });
    }
    std::fs::create_dir_all(&config.out).map_err(io(&config.out))?;
    let (train_problems, eval_problems) = config.task.load(&config.data, config.seed)?;
    fresh_start(config, &train_problems, &eval_problems, &config.out, &Mesh::single())?;
    Ok(warm_start_dir(&config.out))
}

/// Where a run keeps its SFT warm start (a Hugging Face directory: `model.path` of a run that
/// starts GRPO from it, or of a peer such as TRL).
pub fn warm_start_dir(out: &Path) -> PathBuf {
    out.join("warm_start")
}

/// The config of a run that starts GRPO from the warm start in `dir` (no SFT of its own).
pub fn from_warm_start(config: &TrainConfig, dir: &Path) -> TrainConfig {
    let mut c = config.clone();
    c.model.path = Some(dir.to_path_buf());
    c.tokenizer.path = None;
    c.sft.steps = 0;
    c
}

/// A training prompt as a peer trainer takes it: the text after the chat template, its token ids
/// (the peer checks that its tokenizer gives the same), and the gold answer.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RenderedPrompt {
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub answer: String,
}

/// The training prompts of `config` (a run from a warm start: `model.path` set), rendered.
pub fn rendered_prompts(config: &TrainConfig) -> Result<Vec<RenderedPrompt>> {
    let (problems, _) = config.task.load(&config.data, config.seed)?;
    let dir =
        config.model.path.as_deref().ok_or_else(|| TrainError::Other("rendered_prompts needs model.path".into()))?;
    let tokenizer = load_tokenizer(dir)?;
    let format = prompt_format(config, false)?;
    problems
        .iter()
        .map(|p| {
            let prompt = format.render(&p.question)?;
            Ok(RenderedPrompt { prompt_ids: encode(&tokenizer, &prompt)?, prompt, answer: p.answer.clone() })
        })
        .collect()
}

/// The SFT warm start on the task's worked solutions as the (sloppy, `task.sloppy_teacher`)
/// teacher writes them, with the fused-linear cross-entropy (the same for every `loss.impl`, so an
/// A/B's two arms start GRPO from the same weights). The held-out SFT loss is on clean solutions.
fn warm_start(
    config: &TrainConfig,
    s: &Setup,
    format: &PromptFormat,
    train: &[Gsm8kProblem],
    eval: &[Gsm8kProblem],
    out: &Path,
    mesh: &Mesh<'_>,
) -> Result<SftSummary> {
    let loss = LossConfig {
        implementation: LossImpl::FusedLinear,
        chunk_memory_mb: config.loss.chunk_memory_mb,
        ..LossConfig::default()
    };
    let taught = sloppy_answers(train, config.task.sloppy_teacher_share(), config.seed);
    let (train, _) = encode_examples(&s.tokenizer, &warm_start_examples(format, &taught)?, s.eos, config.sft.max_len)?;
    let (eval, _) = encode_examples(&s.tokenizer, &warm_start_examples(format, eval)?, s.eos, config.sft.max_len)?;
    let mut log = if mesh.world.is_root() {
        MetricsLog::open_file(&out.join("sft_metrics.jsonl"), false)?.with_tensorboard(&out.join("tensorboard/sft"))?
    } else {
        MetricsLog::discard()
    };
    train_sft(
        &s.model,
        SftRun {
            config: &config.sft,
            loss: &loss,
            train: &train,
            eval: &eval,
            pad: s.pad,
            seed: config.seed,
            log: Some(&mut log),
            progress: config.progress,
            mesh,
            check_weights_every: config.parallel.check_weights_every,
        },
    )
}

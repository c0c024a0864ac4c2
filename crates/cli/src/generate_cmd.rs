//! `flashgrpo generate`: completions of a saved model (a run's `model/`, `warm_start/` or any
//! Hugging Face Qwen2 directory) by the trainer's own rollout engine and sampler, so that a user
//! can read what a run learnt and check our sampling against transformers' `generate`.
//!
//! Text prompts go through the model directory's chat template (as the trainer renders them) with
//! the system prompt of the run the model came from (its `config.json` beside the model
//! directory), unless `--system` or `--raw` says otherwise. Completions stop at every
//! end-of-sequence id the checkpoint names, as the trainer's rollouts do. One JSON line per
//! completion on stdout (or `--out`).

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use flashgrpo_kernels::synthetic::Rng;
use flashgrpo_train::model::{load_model, load_tokenizer, Sampling};
use flashgrpo_train::prompt::PromptFormat;
use flashgrpo_train::rollout::Rollout;
use flashgrpo_train::special_tokens::special_ids;
use flashgrpo_train::tokenizer::{decode, encode, SideFiles, Tokenizer};
use flashgrpo_train::TrainConfig;
use serde_json::{json, Value};

/// The most tokens a completion gets when `--max-new-tokens` is not given (fewer where the
/// model's positions leave less room).
const DEFAULT_MAX_NEW_TOKENS: usize = 256;

#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// A model directory: config.json, model.safetensors (or shards) and tokenizer.json.
    #[arg(long)]
    pub model: PathBuf,
    /// A prompt (repeatable).
    #[arg(long)]
    pub prompt: Vec<String>,
    /// A JSONL file of prompts: one object a line with `prompt` (text) or `prompt_ids` (token
    /// ids, used as they are).
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// The system prompt of text prompts ("" for none). Default: the run's (`config.json` beside
    /// the model directory), else none.
    #[arg(long)]
    pub system: Option<String>,
    /// Text prompts as they are, without the chat template or a system prompt.
    #[arg(long)]
    pub raw: bool,
    /// Completions per prompt.
    #[arg(long, default_value_t = 1)]
    pub num_generations: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f64,
    /// Keep the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// Drop tokens less than min_p times as likely as the most likely one (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f64,
    /// Hugging Face's repetition penalty (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f64,
    /// Default: 256, or what the model's positions leave after the longest prompt.
    #[arg(long)]
    pub max_new_tokens: Option<usize>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the JSON lines here instead of stdout.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// One prompt: its text (when given as text) and its token ids.
struct Prompt {
    text: Option<String>,
    ids: Vec<u32>,
}

pub fn main(args: GenerateArgs) -> Result<()> {
    let model = load_model(&args.model, None)?;
    let tokenizer = load_tokenizer(&args.model)?;
    let side = SideFiles { tokenizer_dir: Some(args.model.clone()), model_dir: Some(args.model.clone()) };
    let special = special_ids(&model, &tokenizer, &side)?;
    let format = prompt_format(&args)?;
    let mut prompts = Vec::new();
    for text in &args.prompt {
        prompts.push(text_prompt(&tokenizer, &format, &args, text)?);
    }
    if let Some(path) = &args.prompts {
        prompts.extend(prompts_file(path, &tokenizer, &format, &args, model.config.vocab_size)?);
    }
    if prompts.is_empty() {
        bail!("no prompts: give --prompt TEXT or --prompts FILE.jsonl");
    }
    if let Some(i) = prompts.iter().position(|p| p.ids.is_empty()) {
        bail!("prompt {i} has no tokens");
    }
    let sampling = sampling(&args, &prompts, model.max_positions())?;
    let rows: Vec<Vec<u32>> =
        prompts.iter().flat_map(|p| std::iter::repeat_n(p.ids.clone(), args.num_generations)).collect();
    let generated = Rollout::default().generate(&model, &rows, &sampling, &special.stop, &mut Rng::new(args.seed))?;
    let mut out: Box<dyn Write> = match &args.out {
        Some(path) => {
            Box::new(std::fs::File::create(path).with_context(|| format!("cannot write {}", path.display()))?)
        }
        None => Box::new(std::io::stdout().lock()),
    };
    for (r, (ids, finished)) in generated.completions.iter().zip(&generated.finished).enumerate() {
        let p = &prompts[r / args.num_generations];
        // The text without the end-of-sequence token that closed it.
        let shown = if *finished { &ids[..ids.len() - 1] } else { &ids[..] };
        let line = json!({
            "prompt": p.text,
            "prompt_ids": p.ids,
            "completion": decode(&tokenizer, shown)?,
            "completion_ids": ids,
            "finished": finished,
        });
        writeln!(out, "{line}")?;
    }
    Ok(())
}

/// The chat template of the model directory with the system prompt `--system` or the run's;
/// plain text with `--raw`.
fn prompt_format(args: &GenerateArgs) -> Result<PromptFormat> {
    if args.raw {
        return Ok(PromptFormat::default());
    }
    let system = match &args.system {
        Some(s) if s.is_empty() => None,
        Some(s) => Some(s.clone()),
        None => run_system_prompt(&args.model),
    };
    Ok(PromptFormat::from_tokenizer_dir(&args.model, system)?)
}

/// The system prompt of the run whose `model/` (or `warm_start/`, `checkpoint/model/`) `dir` is:
/// its `config.json` one or two levels up, when that is a run's config.
fn run_system_prompt(dir: &Path) -> Option<String> {
    let dir = dir.canonicalize().ok()?;
    dir.ancestors().skip(1).take(2).find_map(|up| {
        let text = std::fs::read_to_string(up.join("config.json")).ok()?;
        let value: Value = serde_json::from_str(&text).ok()?;
        let config = TrainConfig::from_value(value, "run config").ok()?;
        Some(config.task.system_prompt())
    })?
}

fn text_prompt(tokenizer: &Tokenizer, format: &PromptFormat, args: &GenerateArgs, text: &str) -> Result<Prompt> {
    let rendered = if args.raw { text.to_string() } else { format.render(text)? };
    Ok(Prompt { text: Some(text.to_string()), ids: encode(tokenizer, &rendered)? })
}

/// The prompts of a JSONL file, each line named in errors.
fn prompts_file(
    path: &Path,
    tokenizer: &Tokenizer,
    format: &PromptFormat,
    args: &GenerateArgs,
    vocab: usize,
) -> Result<Vec<Prompt>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let at = || format!("{} line {}", path.display(), n + 1);
        let row: Value = serde_json::from_str(line).with_context(at)?;
        if let Some(text) = row.get("prompt").and_then(Value::as_str) {
            out.push(text_prompt(tokenizer, format, args, text).with_context(at)?);
        } else if let Some(ids) = row.get("prompt_ids").and_then(Value::as_array) {
            let ids = ids
                .iter()
                .map(|v| v.as_u64().filter(|&t| (t as usize) < vocab).map(|t| t as u32))
                .collect::<Option<Vec<u32>>>()
                .with_context(|| format!("{}: prompt_ids must be token ids below the vocabulary size {vocab}", at()))?;
            out.push(Prompt { text: None, ids });
        } else {
            bail!("{}: expected an object with `prompt` (text) or `prompt_ids` (token ids)", at());
        }
    }
    Ok(out)
}

/// The sampling of the flags, checked as the trainer's `grpo:` section checks its own.
fn sampling(args: &GenerateArgs, prompts: &[Prompt], max_positions: usize) -> Result<Sampling> {
    if args.num_generations == 0 {
        bail!("--num-generations must be at least 1");
    }
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        bail!("--temperature must be >= 0 (0: greedy), got {}", args.temperature);
    }
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", args.top_p);
    }
    if !(0.0..=1.0).contains(&args.min_p) {
        bail!("--min-p must be in [0, 1], got {}", args.min_p);
    }
    if !(args.repetition_penalty > 0.0 && args.repetition_penalty.is_finite()) {
        bail!("--repetition-penalty must be positive (1: off), got {}", args.repetition_penalty);
    }
    let longest = prompts.iter().map(|p| p.ids.len()).max().unwrap_or(0);
    let room = max_positions.saturating_sub(longest);
    let max_new_tokens = args.max_new_tokens.unwrap_or(DEFAULT_MAX_NEW_TOKENS.min(room));
    if max_new_tokens == 0 {
        bail!("no room to generate: the longest prompt has {longest} tokens, the model {max_positions} positions");
    }
    Ok(Sampling {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        max_new_tokens,
    })
}

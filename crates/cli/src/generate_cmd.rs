//! `flashgrpo generate`: completions of a saved model (a run's `model/`, `warm_start/` or any
//! Hugging Face Qwen2 directory) by the trainer's own rollout engine and sampler, so that a user
//! can read what a run learnt and check our sampling against transformers' `generate`.
//!
//! Text prompts go through the model directory's chat template (as the trainer renders them) with
//! the system prompt of the run the model came from (its `config.json` beside the model
//! directory), unless `--system` or `--raw` says otherwise. Sampling settings not given take the
//! values of the model's `generation_config.json` as transformers' `generate` reads them (no file,
//! or no `do_sample: true`: greedy). Completions stop at every end-of-sequence id the checkpoint
//! names, as the trainer's rollouts do. One JSON line per completion on stdout (or `--out`).

use std::io::{BufWriter, Write};
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
    #[arg(long, conflicts_with = "system")]
    pub raw: bool,
    /// Completions per prompt.
    #[arg(long, default_value_t = 1)]
    pub num_generations: usize,
    /// Sampling temperature; 0 is greedy. Default (as every sampling setting): the model's
    /// generation_config.json, as transformers reads it; without one, greedy.
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Keep the k most likely tokens (0: all).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Keep the most likely tokens until their probability reaches top_p (1: all).
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Drop tokens less than min_p times as likely as the most likely one (0: off).
    #[arg(long)]
    pub min_p: Option<f64>,
    /// Hugging Face's repetition penalty on the prompt's and the completion's tokens (1: off).
    #[arg(long)]
    pub repetition_penalty: Option<f64>,
    /// Default: 256, or what the model's positions leave after the longest prompt.
    #[arg(long)]
    pub max_new_tokens: Option<usize>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the JSON lines here instead of stdout.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// One prompt: its text (when given as text), its token ids, and where it was given (for errors).
struct Prompt {
    text: Option<String>,
    ids: Vec<u32>,
    origin: String,
}

pub fn main(args: GenerateArgs) -> Result<()> {
    let model = load_model(&args.model, None)?;
    let tokenizer = load_tokenizer(&args.model)?;
    let side = SideFiles { tokenizer_dir: Some(args.model.clone()), model_dir: Some(args.model.clone()) };
    let special = special_ids(&model, &tokenizer, &side)?;
    let format = prompt_format(&args)?;
    let mut prompts = Vec::new();
    for (i, text) in args.prompt.iter().enumerate() {
        prompts.push(text_prompt(&tokenizer, &format, &args, text, format!("--prompt number {}", i + 1))?);
    }
    if let Some(path) = &args.prompts {
        prompts.extend(prompts_file(path, &tokenizer, &format, &args, model.config.vocab_size)?);
    }
    if prompts.is_empty() {
        bail!("no prompts: give --prompt TEXT or --prompts FILE.jsonl");
    }
    if let Some(p) = prompts.iter().find(|p| p.ids.is_empty()) {
        bail!("{}: the prompt has no tokens", p.origin);
    }
    let sampling = sampling(&args, &GenerationDefaults::read(&args.model)?, &prompts, model.max_positions())?;
    let rows: Vec<Vec<u32>> =
        prompts.iter().flat_map(|p| std::iter::repeat_n(p.ids.clone(), args.num_generations)).collect();
    let generated = Rollout::default().generate(&model, &rows, &sampling, &special.stop, &mut Rng::new(args.seed))?;
    let mut out: Box<dyn Write> = match &args.out {
        Some(path) => Box::new(BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("cannot write {}", path.display()))?,
        )),
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
    out.flush()?;
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
/// its `config.json` one or two levels up, when that is a run's config (one that looks like a
/// run's but does not parse is named on stderr, and no system prompt used).
fn run_system_prompt(dir: &Path) -> Option<String> {
    let dir = dir.canonicalize().ok()?;
    dir.ancestors().skip(1).take(2).find_map(|up| {
        let path = up.join("config.json");
        let value: Value = serde_json::from_str(&std::fs::read_to_string(&path).ok()?).ok()?;
        // A run's config has a `grpo` or `sft` section; a model's config.json has neither.
        if value.get("grpo").is_none() && value.get("sft").is_none() {
            return None;
        }
        match TrainConfig::from_value(value, &path.display().to_string()) {
            Ok(config) => Some(config.task.system_prompt()),
            Err(e) => {
                eprintln!("note: no system prompt from the run's config ({e}); give --system to set one");
                Some(None)
            }
        }
    })?
}

fn text_prompt(
    tokenizer: &Tokenizer,
    format: &PromptFormat,
    args: &GenerateArgs,
    text: &str,
    origin: String,
) -> Result<Prompt> {
    let rendered = if args.raw { text.to_string() } else { format.render(text)? };
    Ok(Prompt { text: Some(text.to_string()), ids: encode(tokenizer, &rendered)?, origin })
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
            out.push(text_prompt(tokenizer, format, args, text, at()).with_context(at)?);
        } else if let Some(ids) = row.get("prompt_ids").and_then(Value::as_array) {
            let ids = ids
                .iter()
                .map(|v| v.as_u64().filter(|&t| (t as usize) < vocab).map(|t| t as u32))
                .collect::<Option<Vec<u32>>>()
                .with_context(|| format!("{}: prompt_ids must be token ids below the vocabulary size {vocab}", at()))?;
            out.push(Prompt { text: None, ids, origin: at() });
        } else {
            bail!("{}: expected an object with `prompt` (text) or `prompt_ids` (token ids)", at());
        }
    }
    Ok(out)
}

/// The sampling settings of a model's `generation_config.json`, as transformers' `generate`
/// reads them: a key not in the file takes transformers' default (`do_sample` false: greedy;
/// `top_k` 50); no file: greedy.
#[derive(Debug, Clone, Copy, PartialEq)]
struct GenerationDefaults {
    temperature: f64,
    top_k: usize,
    top_p: f64,
    min_p: f64,
    repetition_penalty: f64,
}

impl GenerationDefaults {
    fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("generation_config.json");
        let greedy = Self { temperature: 0.0, top_k: 50, top_p: 1.0, min_p: 0.0, repetition_penalty: 1.0 };
        if !path.is_file() {
            return Ok(greedy);
        }
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let g: Value = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
        let number = |key: &str, default: f64| g.get(key).and_then(Value::as_f64).unwrap_or(default);
        let sampled = g.get("do_sample").and_then(Value::as_bool).unwrap_or(false);
        Ok(Self {
            temperature: if sampled { number("temperature", 1.0) } else { 0.0 },
            top_k: g.get("top_k").and_then(Value::as_u64).map_or(greedy.top_k, |k| k as usize),
            top_p: number("top_p", greedy.top_p),
            min_p: number("min_p", greedy.min_p),
            repetition_penalty: number("repetition_penalty", greedy.repetition_penalty),
        })
    }
}

/// The sampling of the flags (the model's defaults where not given), checked as the trainer's
/// `grpo:` section checks its own.
fn sampling(
    args: &GenerateArgs,
    defaults: &GenerationDefaults,
    prompts: &[Prompt],
    max_positions: usize,
) -> Result<Sampling> {
    if args.num_generations == 0 {
        bail!("--num-generations must be at least 1");
    }
    let s = Sampling {
        temperature: args.temperature.unwrap_or(defaults.temperature),
        top_k: args.top_k.unwrap_or(defaults.top_k),
        top_p: args.top_p.unwrap_or(defaults.top_p),
        min_p: args.min_p.unwrap_or(defaults.min_p),
        repetition_penalty: args.repetition_penalty.unwrap_or(defaults.repetition_penalty),
        max_new_tokens: 0,
    };
    if !(s.temperature >= 0.0 && s.temperature.is_finite()) {
        bail!("--temperature must be >= 0 (0: greedy), got {}", s.temperature);
    }
    if !(s.top_p > 0.0 && s.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", s.top_p);
    }
    if !(0.0..=1.0).contains(&s.min_p) {
        bail!("--min-p must be in [0, 1], got {}", s.min_p);
    }
    if !(s.repetition_penalty > 0.0 && s.repetition_penalty.is_finite()) {
        bail!("--repetition-penalty must be positive (1: off), got {}", s.repetition_penalty);
    }
    if args.max_new_tokens == Some(0) {
        bail!("--max-new-tokens must be at least 1");
    }
    let longest = prompts.iter().map(|p| p.ids.len()).max().unwrap_or(0);
    let room = max_positions.saturating_sub(longest);
    let max_new_tokens = args.max_new_tokens.unwrap_or(DEFAULT_MAX_NEW_TOKENS.min(room));
    if max_new_tokens == 0 {
        bail!("no room to generate: the longest prompt has {longest} tokens, the model {max_positions} positions");
    }
    Ok(Sampling { max_new_tokens, ..s })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen2.5-Instruct's generation_config.json samples; without `do_sample`, or without the
    /// file, transformers decodes greedily (and its `top_k` is 50 unless the file says otherwise).
    #[test]
    fn generation_defaults_read_as_transformers_does() {
        let dir = std::env::temp_dir().join(format!("flashgrpo-generation-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let greedy =
            GenerationDefaults { temperature: 0.0, top_k: 50, top_p: 1.0, min_p: 0.0, repetition_penalty: 1.0 };
        assert_eq!(GenerationDefaults::read(&dir).unwrap(), greedy);
        let qwen = r#"{"do_sample": true, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                       "eos_token_id": [151645, 151643]}"#;
        std::fs::write(dir.join("generation_config.json"), qwen).unwrap();
        let want = GenerationDefaults { temperature: 0.7, top_k: 20, top_p: 0.8, min_p: 0.0, repetition_penalty: 1.05 };
        assert_eq!(GenerationDefaults::read(&dir).unwrap(), want);
        std::fs::write(dir.join("generation_config.json"), r#"{"temperature": 0.7, "min_p": 0.1}"#).unwrap();
        assert_eq!(GenerationDefaults::read(&dir).unwrap(), GenerationDefaults { min_p: 0.1, ..greedy });
        let _ = std::fs::remove_dir_all(&dir);
    }
}

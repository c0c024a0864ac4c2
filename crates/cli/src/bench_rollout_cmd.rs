//! `flashgrpo bench-rollout`: the rollout engine's generation beside Hugging Face transformers'
//! `generate` (what TRL's GRPOTrainer calls on a machine without vLLM), on the same model
//! directory, prompts, batch and lengths, in one run: tokens per second of each and the ratio.
//!
//! Every row generates exactly `--new-tokens` tokens in both (no end-of-sequence stop), so both
//! produce the same number of tokens. The batch is GRPO's: `--batch / --groups` distinct prompts,
//! each `--groups` times (`--groups 1`: every prompt distinct). The prompts are random token ids of
//! `--prompt-len`, or the first ones of a `prompts.jsonl` (`flashgrpo bench-trainer` writes one).
//! Ours runs before and after the peer; its figure is the median of both sets of calls.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use flashgrpo_kernels::synthetic::Rng;
use flashgrpo_train::model::{load_model, Sampling};
use flashgrpo_train::rollout::Rollout;
use flashgrpo_train::train_config::parameter_dtype;
use serde_json::{json, Value};

use crate::peers::{json_lines, median, python, run_measured, script};

#[derive(Debug, clap::Args)]
pub struct BenchRolloutArgs {
    /// A Hugging Face Qwen2 directory (config.json + model.safetensors).
    #[arg(long)]
    pub model: PathBuf,
    /// Rows generated at once.
    #[arg(long, default_value_t = 128)]
    pub batch: usize,
    /// Rows per distinct prompt (GRPO's num_generations).
    #[arg(long, default_value_t = 16)]
    pub groups: usize,
    /// Tokens per random prompt.
    #[arg(long, default_value_t = 40)]
    pub prompt_len: usize,
    /// Prompts from a prompts.jsonl instead of random ids.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    #[arg(long, default_value_t = 32)]
    pub new_tokens: usize,
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f64,
    /// Sampling filters, as `train`'s `grpo:` keys (both sides use them).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f64,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f64,
    /// Timed calls of each (after one warm-up call).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    #[arg(long, default_value = "runs/bench-rollout")]
    pub out: PathBuf,
    /// Only flashgrpo (no peer).
    #[arg(long)]
    pub no_peer: bool,
    /// The dtype both sides compute in, the parameters cast on load (`model.dtype`'s names:
    /// `f32` or `bf16`): ours on the machine's bf16 products where it has them, else widened;
    /// torch's bf16 kernels on its side.
    #[arg(long, default_value = "f32")]
    pub dtype: flashgrpo_kernels::DType,
}

fn prompts(args: &BenchRolloutArgs, vocab: usize) -> Result<Vec<Vec<u32>>> {
    if args.groups == 0 || !args.batch.is_multiple_of(args.groups) {
        bail!("--batch ({}) must be a multiple of --groups ({})", args.batch, args.groups);
    }
    let distinct = args.batch / args.groups;
    let unique: Vec<Vec<u32>> = match &args.prompts {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
            let rows = json_lines(&text);
            if rows.len() < distinct {
                bail!("{} holds {} prompts, fewer than the {distinct} needed", path.display(), rows.len());
            }
            rows.iter()
                .take(distinct)
                .map(|r| {
                    let ids = r.get("prompt_ids").and_then(Value::as_array).context("a prompt without prompt_ids")?;
                    Ok(ids.iter().map(|v| v.as_u64().unwrap_or(0) as u32).collect())
                })
                .collect::<Result<_>>()?
        }
        None => {
            let mut rng = Rng::new(7);
            (0..distinct).map(|_| (0..args.prompt_len).map(|_| rng.below(vocab) as u32).collect()).collect()
        }
    };
    Ok(unique.iter().flat_map(|p| std::iter::repeat_n(p.clone(), args.groups)).collect())
}

pub fn main(args: BenchRolloutArgs) -> Result<()> {
    crate::train_cmd::prepare_process();
    std::fs::create_dir_all(&args.out)?;
    let model = load_model(&args.model, Some(parameter_dtype(args.dtype)?))?;
    let prompts = prompts(&args, model.config.vocab_size)?;
    let s = Sampling {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        max_new_tokens: args.new_tokens,
    };
    let mut rollout = Rollout::default();
    let mut rng = Rng::new(1);
    let mut calls = |n: usize| -> Result<Vec<f64>> {
        (0..n)
            .map(|_| {
                let started = Instant::now();
                let g = rollout.generate(&model, &prompts, &s, &[], &mut rng)?;
                let tokens: usize = g.completions.iter().map(Vec::len).sum();
                if tokens != prompts.len() * args.new_tokens {
                    bail!("generated {tokens} tokens, expected {}", prompts.len() * args.new_tokens);
                }
                Ok(started.elapsed().as_secs_f64())
            })
            .collect()
    };
    calls(1)?;
    let mut ours = calls(args.repeats)?;
    let peer = if args.no_peer {
        None
    } else {
        let file = args.out.join("prompts.json");
        std::fs::write(&file, serde_json::to_string(&prompts)?)?;
        let measured = run_measured(
            Command::new(python()?)
                .arg(script("hf_generate.py"))
                .arg("--model")
                .arg(&args.model)
                .arg("--prompts")
                .arg(&file)
                .args(["--max-new-tokens", &args.new_tokens.to_string()])
                .args(["--temperature", &args.temperature.to_string()])
                .args(["--top-k", &args.top_k.to_string(), "--top-p", &args.top_p.to_string()])
                .args(["--min-p", &args.min_p.to_string()])
                .args(["--repetition-penalty", &args.repetition_penalty.to_string()])
                .args(["--repeats", &args.repeats.to_string()])
                .args(["--dtype", args.dtype.name()]),
            &args.out.join("bench-rollout.log"),
        )?;
        ours.extend(calls(args.repeats)?);
        Some(json_lines(&measured.stdout).pop().context("hf_generate.py printed nothing")?)
    };
    let tokens = (prompts.len() * args.new_tokens) as f64;
    let ours_s = median(ours.clone());
    let ours_tps = tokens / ours_s;
    let c = &model.config;
    println!(
        "model {} (H={}, layers={}, heads={}/{}, vocab={}), {} rows ({} distinct prompts of {}), {} new tokens, {}, T={} top_k={} top_p={} min_p={} repetition_penalty={}",
        args.model.display(),
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.vocab_size,
        prompts.len(),
        prompts.len() / args.groups,
        prompts.iter().map(Vec::len).max().unwrap_or(0),
        args.new_tokens,
        args.dtype,
        args.temperature,
        args.top_k,
        args.top_p,
        args.min_p,
        args.repetition_penalty
    );
    println!("\n| impl | s per call (median) | tokens/s | / transformers |\n|---|---|---|---|");
    let mut report = json!({"tokens": tokens, "dtype": args.dtype.name(), "flashgrpo": {"seconds_p50": ours_s, "seconds": ours, "tokens_per_s": ours_tps}});
    if let Some(p) = &peer {
        let (ps, ptps) =
            (p["seconds_p50"].as_f64().unwrap_or(f64::NAN), p["tokens_per_s"].as_f64().unwrap_or(f64::NAN));
        println!(
            "| transformers.generate (torch {}) | {ps:.3} | {ptps:.0} | 1.0x |",
            p["torch"].as_str().unwrap_or("?")
        );
        println!("| flashgrpo rollout | {ours_s:.3} | {ours_tps:.0} | {:.1}x |", ours_tps / ptps);
        report["transformers"] = p.clone();
    } else {
        println!("| flashgrpo rollout | {ours_s:.3} | {ours_tps:.0} | |");
    }
    std::fs::write(args.out.join("bench_rollout.json"), serde_json::to_string_pretty(&report)?)?;
    Ok(())
}

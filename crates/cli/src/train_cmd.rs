//! `flashgrpo train`: GRPO (default; with no config, the built-in arithmetic task end to end) or
//! SFT, from a YAML config with `--set` overrides; `--resume` continues a run from its checkpoint.

use std::path::PathBuf;

use anyhow::{bail, Result};
use flashgrpo_train::grpo_job::{run_grpo_job, GrpoJobSummary, JobOptions};
use std::sync::Arc;

use flashgrpo_collective::Collective;
use flashgrpo_train::grpo::config::TRL_NAMES;
use flashgrpo_train::sft::SftSummary;
use flashgrpo_train::sft_job::run_sft_job;
use flashgrpo_train::{Algo, TrainConfig};
use serde_json::Value;

use crate::config::{load_tree, Source};

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum AlgoArg {
    Sft,
    Grpo,
}

#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    /// YAML config (configs/sft-*.yaml); paths in it are relative to the working directory.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override any key, sections dotted: `--set sft.steps=50 --set loss.impl=baseline`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// The algorithm (overrides the config's `algo`).
    #[arg(long, value_enum)]
    pub algo: Option<AlgoArg>,
    /// Output directory (overrides the config's `out`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the resolved config as YAML and exit.
    #[arg(long)]
    pub print_config: bool,
    /// Continue a GRPO run from its checkpoint: the run's output directory (or its
    /// `checkpoint/`). Without `--config`, the run's own `config.json` is the config.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
}

/// The checkpoint directory and the run directory of `--resume DIR`.
fn resume_dirs(dir: &std::path::Path) -> Result<(PathBuf, PathBuf)> {
    if dir.join("trainer_state.json").exists() {
        let run = dir.parent().map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
        return Ok((dir.to_path_buf(), run));
    }
    let checkpoint = flashgrpo_train::grpo::checkpoint_dir(dir);
    if checkpoint.join("trainer_state.json").exists() {
        return Ok((checkpoint, dir.to_path_buf()));
    }
    bail!(
        "--resume {}: no checkpoint there (expected {}/trainer_state.json); checkpoints are written every grpo.checkpoint_every steps",
        dir.display(),
        checkpoint.display()
    )
}

/// The resolved config: file, then `--set`, then the flags.
pub fn resolve(args: &TrainArgs) -> Result<TrainConfig> {
    let run_config = match (&args.resume, &args.config) {
        (Some(dir), None) => Some(resume_dirs(dir)?.1.join("config.json")),
        _ => None,
    };
    let source = match (&args.config, &run_config) {
        (Some(p), _) => Source::File(p),
        (None, Some(p)) => Source::File(p),
        (None, None) => Source::Defaults,
    };
    let sets: Vec<String> = args.sets.iter().map(|s| our_name(s)).collect();
    let (mut map, origin) = load_tree(source, &sets)?;
    // A TRL name in the file for a setting a `--set` gives under our name: the `--set` wins.
    if let Some(Value::Object(grpo)) = map.get_mut("grpo") {
        for (trl, ours) in TRL_NAMES {
            if sets.iter().any(|s| s.starts_with(&format!("grpo.{ours}="))) {
                grpo.remove(trl);
            }
        }
    }
    if let Some(algo) = args.algo {
        map.insert("algo".into(), Value::from(if matches!(algo, AlgoArg::Sft) { "sft" } else { "grpo" }));
    }
    if let Some(out) = &args.out {
        map.insert("out".into(), Value::from(out.display().to_string()));
    }
    Ok(TrainConfig::from_value(Value::Object(map), &origin)?)
}

/// A `--set` of a `grpo:` setting under TRL's name, under ours: it then overrides the setting
/// whichever name the file (or a resumed run's config.json) gives it.
fn our_name(set: &str) -> String {
    for (trl, ours) in TRL_NAMES {
        if let Some(value) = set.strip_prefix(&format!("grpo.{trl}=")) {
            return format!("grpo.{ours}={value}");
        }
    }
    set.to_string()
}

/// What every training command sets up first: the allocator's behaviour and the heap probe.
pub fn prepare_process() {
    crate::memory::keep_freed_memory();
    flashgrpo_train::metrics::install_heap_probe(flashgrpo_train::metrics::HeapProbe {
        live: crate::memory::live_bytes,
        peak: crate::memory::peak_bytes,
        reset_peak: crate::memory::reset_peak,
    });
}

pub fn main(args: TrainArgs) -> Result<()> {
    let config = resolve(&args)?;
    prepare_process();
    if args.print_config {
        print!("{}", serde_saphyr::to_string(&config)?);
        return Ok(());
    }
    let comm: Arc<dyn Collective> = Arc::from(flashgrpo_collective::from_environment(false)?);
    // Every rank runs the job; rank 0 prints.
    let root = comm.is_root();
    if root && comm.size() > 1 {
        let vocab = config.parallel.vocab.max(1);
        eprintln!(
            "flashgrpo train: {}: {} data-parallel x {vocab} vocabulary-parallel",
            comm.describe(),
            comm.size() / vocab
        );
    }
    match config.algo {
        Algo::Sft => {
            let s = run_sft_job(&config, &config.out, comm.as_ref())?;
            if root {
                print_sft_summary(&config, &s);
            }
        }
        Algo::Grpo => {
            let resume = args.resume.as_deref().map(resume_dirs).transpose()?.map(|(c, _)| c);
            let s = run_grpo_job(&config, &JobOptions { resume, comm, ..Default::default() })?;
            if root {
                print_grpo_summary(&config, &s);
            }
        }
    }
    Ok(())
}

fn print_sft_summary(config: &TrainConfig, s: &SftSummary) {
    let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.4}"));
    println!("sft: {} steps, loss.impl = {}", config.sft.steps, config.loss.implementation.name());
    println!("  train/loss first {:.4}, last 10 {:.4}", s.first_loss, s.last_loss);
    println!("  eval/loss  before {}, after {}", opt(s.eval_before), opt(s.eval_after));
    println!("  time/step_s mean {:.4} (first step excluded)", s.step_s_mean);
    println!(
        "  mem/peak_rss_bytes {} ({:.1} MiB above the {:.1} MiB resident when the steps began)",
        s.peak_rss_bytes,
        s.peak_rss_bytes.saturating_sub(s.rss_before_steps) as f64 / 1048576.0,
        s.rss_before_steps as f64 / 1048576.0
    );
    if let (Some(peak), Some(before)) = (s.peak_heap_bytes, s.heap_before_steps) {
        println!(
            "  mem/peak_heap_bytes {peak} ({:.1} MiB above the {:.1} MiB live when the steps began)",
            peak.saturating_sub(before) as f64 / 1048576.0,
            before as f64 / 1048576.0
        );
    }
    if s.skipped_steps > 0 {
        println!("  skipped steps (non-finite): {}", s.skipped_steps);
    }
    println!("  model, tokenizer, metrics.jsonl and config.json in {}", config.out.display());
}

fn print_grpo_summary(config: &TrainConfig, s: &GrpoJobSummary) {
    let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
    let g = &s.grpo;
    println!();
    println!("| {:<34} | {:>14} | {:>14} |", "", "before GRPO", "after GRPO");
    println!("|{:-<36}|{:->16}|{:->16}|", "", "", "");
    println!(
        "| {:<34} | {:>14} | {:>14} |",
        format!("eval/accuracy (held out, T={})", config.grpo.eval_temperature()),
        f(g.eval_before),
        f(g.eval_after)
    );
    if g.eval_greedy_before.is_some() {
        println!(
            "| {:<34} | {:>14} | {:>14} |",
            "eval/accuracy_greedy (held out)",
            f(g.eval_greedy_before),
            f(g.eval_greedy_after)
        );
    }
    println!(
        "| {:<34} | {:>14} | {:>14} |",
        "train/reward_mean (first, last 10)",
        format!("{:.3}", g.reward_first),
        format!("{:.3}", g.reward_last10)
    );
    if let Some(w) = &s.warm_start {
        println!(
            "SFT warm start: {} steps, loss {:.3} -> {:.3}, held-out loss {} -> {}",
            config.sft.steps,
            w.first_loss,
            w.last_loss,
            f(w.eval_before),
            f(w.eval_after)
        );
    }
    println!(
        "GRPO: {} steps, loss.impl = {}, time/step_avg_last10_s {:.3}, time/update_s mean {:.3}, skipped {}",
        g.steps,
        config.loss.implementation.name(),
        g.step_avg_last10_s,
        g.update_s_mean,
        g.skipped_steps
    );
    println!("metrics.jsonl, summary.json, plots/*.png, model/ and checkpoint/ in {}", s.out.display());
}

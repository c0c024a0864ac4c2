//! `flashgrpo train`: SFT now (GRPO in the next step), from a YAML config with `--set` overrides.

use std::path::PathBuf;

use anyhow::{bail, Result};
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
}

/// The resolved config: file, then `--set`, then the flags.
pub fn resolve(args: &TrainArgs) -> Result<TrainConfig> {
    let source = match &args.config {
        Some(p) => Source::File(p),
        None => Source::Defaults,
    };
    let (mut map, origin) = load_tree(source, &args.sets)?;
    if let Some(algo) = args.algo {
        map.insert("algo".into(), Value::from(if matches!(algo, AlgoArg::Sft) { "sft" } else { "grpo" }));
    }
    if let Some(out) = &args.out {
        map.insert("out".into(), Value::from(out.display().to_string()));
    }
    Ok(TrainConfig::from_value(Value::Object(map), &origin)?)
}

/// Keeps freed memory in the heap: training allocates and frees the same activation-sized blocks
/// every step, and glibc would otherwise return each one to the kernel (`munmap`) and fault it in
/// again, zeroed, the next step. Measured: the SFT step of the default config takes half the time
/// (docs/BENCHMARKS.md).
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; it is called before the training allocates.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

pub fn main(args: TrainArgs) -> Result<()> {
    let config = resolve(&args)?;
    keep_freed_memory();
    flashgrpo_train::metrics::install_heap_probe(flashgrpo_train::metrics::HeapProbe {
        live: crate::memory::live_bytes,
        peak: crate::memory::peak_bytes,
        reset_peak: crate::memory::reset_peak,
    });
    if args.print_config {
        print!("{}", serde_saphyr::to_string(&config)?);
        return Ok(());
    }
    match config.algo {
        Algo::Sft => {
            let s = run_sft_job(&config, &config.out)?;
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
            Ok(())
        }
        Algo::Grpo => bail!("GRPO training is not implemented yet; run `flashgrpo train --algo sft`"),
    }
}

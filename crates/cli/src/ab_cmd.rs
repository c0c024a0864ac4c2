//! `flashgrpo ab`: the original system's A/B as one command. The same GRPO run twice from the
//! same seed, `loss.impl = baseline` (materialised logits, candle autograd) and `fused_linear`,
//! then a side-by-side table: rewards, held-out accuracy, how far the losses drift apart, step and
//! update time, peak memory, and the ratio. The table is printed and written to `OUT/ab.md`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use flashgrpo_train::grpo_job::{run_grpo_job, GrpoJobSummary, JobOptions};
use flashgrpo_train::plot::{line_plot, metric_series, Series};
use flashgrpo_train::{LossImpl, TrainConfig};
use serde_json::Value;

use crate::config::{load_tree, Source};

#[derive(Debug, clap::Args)]
pub struct AbArgs {
    /// YAML config (without it: the built-in arithmetic task, as `flashgrpo train`).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override any key: `--set grpo.prompts_per_step=8`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// GRPO steps of each arm (overrides `grpo.steps`).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Output directory: one sub-directory per arm, and `ab.md`.
    #[arg(long, default_value = "runs/ab")]
    pub out: PathBuf,
    /// Steps over which the largest |loss difference| is taken.
    #[arg(long, default_value_t = 10)]
    pub compare_first: usize,
}

fn arm_config(args: &AbArgs, implementation: LossImpl, out: &Path) -> Result<TrainConfig> {
    let source = match &args.config {
        Some(p) => Source::File(p),
        None => Source::Defaults,
    };
    let (mut map, origin) = load_tree(source, &args.sets)?;
    map.insert("out".into(), Value::from(out.display().to_string()));
    map.insert("algo".into(), Value::from("grpo"));
    let mut config = TrainConfig::from_value(Value::Object(map), &origin)?;
    if let Some(steps) = args.steps {
        config.grpo.steps = steps;
    }
    config.loss.implementation = implementation;
    Ok(config)
}

fn mib(bytes: Option<u64>) -> String {
    bytes.map_or("-".into(), |b| format!("{:.1}", b as f64 / 1048576.0))
}

pub fn main(args: AbArgs) -> Result<()> {
    crate::train_cmd::prepare_process();
    let arms = [LossImpl::Baseline, LossImpl::FusedLinear];
    let mut results: Vec<(TrainConfig, GrpoJobSummary)> = Vec::new();
    for implementation in arms {
        let out = args.out.join(implementation.name());
        let config = arm_config(&args, implementation, &out)?;
        eprintln!("== arm loss.impl = {} -> {}", implementation.name(), out.display());
        let summary = run_grpo_job(&config, &JobOptions::default())
            .with_context(|| format!("the {} arm", implementation.name()))?;
        results.push((config, summary));
    }
    let losses: Vec<Vec<(f64, f64)>> = results
        .iter()
        .map(|(_, s)| metric_series(&s.out.join("metrics.jsonl"), "train/loss"))
        .collect::<Result<_, _>>()?;
    let first = args.compare_first.max(1);
    let max_loss_diff =
        losses[0].iter().zip(&losses[1]).take(first).map(|(a, b)| (a.1 - b.1).abs()).fold(0.0f64, f64::max);
    let (base, fused) = (&results[0].1.grpo, &results[1].1.grpo);
    let f3 = |v: f64| format!("{v:.3}");
    let opt = |v: Option<f64>| v.map_or("-".into(), f3);
    let ratio = |a: f64, b: f64| if b > 0.0 { format!("{:.2}x", a / b) } else { "-".into() };
    let rows: Vec<[String; 4]> = vec![
        ["train/reward_mean, last 10 steps".into(), f3(base.reward_last10), f3(fused.reward_last10), String::new()],
        ["train/reward_mean, all steps".into(), f3(base.reward_mean), f3(fused.reward_mean), String::new()],
        ["eval/accuracy before GRPO".into(), opt(base.eval_before), opt(fused.eval_before), String::new()],
        ["eval/accuracy after GRPO".into(), opt(base.eval_after), opt(fused.eval_after), String::new()],
        [
            format!("max abs train/loss difference, first {first} steps"),
            format!("{max_loss_diff:.2e}"),
            String::new(),
            String::new(),
        ],
        [
            "time/step_avg_last10_s".into(),
            f3(base.step_avg_last10_s),
            f3(fused.step_avg_last10_s),
            ratio(base.step_avg_last10_s, fused.step_avg_last10_s),
        ],
        [
            "time/update_s (mean)".into(),
            f3(base.update_s_mean),
            f3(fused.update_s_mean),
            ratio(base.update_s_mean, fused.update_s_mean),
        ],
        [
            "update peak heap above its start (MiB)".into(),
            mib(base.update_peak_heap_bytes.map(|b| b as u64)),
            mib(fused.update_peak_heap_bytes.map(|b| b as u64)),
            match (base.update_peak_heap_bytes, fused.update_peak_heap_bytes) {
                (Some(a), Some(b)) => ratio(a as f64, b as f64),
                _ => "-".into(),
            },
        ],
        [
            "mem/peak_rss_bytes (MiB)".into(),
            mib(Some(base.peak_rss_bytes)),
            mib(Some(fused.peak_rss_bytes)),
            ratio(base.peak_rss_bytes as f64, fused.peak_rss_bytes as f64),
        ],
    ];
    let mut table = format!(
        "| {} GRPO steps, seed {} | baseline | fused_linear | baseline / fused_linear |\n|---|---|---|---|\n",
        results[0].0.grpo.steps, results[0].0.seed
    );
    for r in &rows {
        table.push_str(&format!("| {} | {} | {} | {} |\n", r[0], r[1], r[2], r[3]));
    }
    println!("\n{table}");
    std::fs::create_dir_all(&args.out)?;
    let path = args.out.join("ab.md");
    std::fs::write(&path, &table).with_context(|| format!("cannot write {}", path.display()))?;
    let series = |key: &str| -> Result<Vec<Series>> {
        results
            .iter()
            .map(|(c, s)| {
                Ok(Series {
                    name: c.loss.implementation.name().into(),
                    points: metric_series(&s.out.join("metrics.jsonl"), key)?,
                })
            })
            .collect()
    };
    line_plot(&args.out.join("reward.png"), "reward: baseline vs fused_linear", &series("train/reward_mean")?)?;
    line_plot(&args.out.join("loss.png"), "loss: baseline vs fused_linear", &series("train/loss")?)?;
    line_plot(&args.out.join("update_time.png"), "update time (s)", &series("time/update_s")?)?;
    println!("table in {}; each arm's metrics and plots under {}", path.display(), args.out.display());
    Ok(())
}

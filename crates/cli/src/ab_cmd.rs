//! `flashgrpo ab`: the original system's A/B as one command. The same GRPO run twice from the
//! same seed, `loss.impl = baseline` (materialised logits, candle autograd) and `fused_linear`,
//! then a side-by-side table: rewards, held-out accuracy, how far the losses drift apart, step and
//! update time, peak memory, and the ratio. The table is printed and written to `OUT/ab.md`.
//!
//! The arms run in two threads that take turns step by step ([`Baton`]): one computes while the
//! other waits, so each step is timed alone on the machine, and both arms see the same minutes of
//! a shared machine, whose speed drifts by 10% over a few minutes (run one after the other, the
//! second arm was measured up to 25% slower in the same code, its rollouts included). The waiting
//! arm allocates nothing, so the update's heap peak is the active arm's own.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};

use anyhow::{Context, Result};
use flashgrpo_train::grpo::StepHook;
use flashgrpo_train::grpo_job::{run_grpo_job, GrpoJobSummary, JobOptions};
use flashgrpo_train::plot::{line_plot, metric_series, moving_average, Axes, Series, Style};
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

/// Turns between the two arms: arm `turn` runs, the other waits; an arm that finishes (or fails)
/// leaves the machine to the other for good.
struct Baton {
    state: Mutex<(usize, [bool; 2])>,
    changed: Condvar,
}

impl Baton {
    fn new() -> Self {
        Self { state: Mutex::new((0, [false; 2])), changed: Condvar::new() }
    }

    fn wait_turn(&self, me: usize) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while s.0 != me && !s.1[1 - me] {
            s = self.changed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Hands the machine to the other arm (unless it has finished) and waits for it back.
    fn pass(&self, me: usize) {
        {
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            s.0 = 1 - me;
            self.changed.notify_all();
        }
        self.wait_turn(me);
    }

    fn finish(&self, me: usize) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.1[me] = true;
        s.0 = 1 - me;
        self.changed.notify_all();
    }
}

/// Marks an arm finished however its thread ends (an error or a panic included).
struct Finished<'a>(&'a Baton, usize);

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        self.0.finish(self.1);
    }
}

/// Runs the two arms alternately, step by step (see the module's doc).
fn run_alternating(configs: &[TrainConfig; 2]) -> Result<Vec<GrpoJobSummary>> {
    let baton = Arc::new(Baton::new());
    std::thread::scope(|scope| {
        let handles: Vec<_> = configs
            .iter()
            .enumerate()
            .map(|(me, config)| {
                let baton = baton.clone();
                std::thread::Builder::new()
                    .name(format!("ab-{}", config.loss.implementation.name()))
                    .stack_size(64 << 20)
                    .spawn_scoped(scope, move || -> Result<GrpoJobSummary> {
                        let _finished = Finished(&baton, me);
                        baton.wait_turn(me);
                        let hook_baton = baton.clone();
                        let after_step = StepHook(Arc::new(move |_step| hook_baton.pass(me)));
                        let options = JobOptions { after_step: Some(after_step), ..Default::default() };
                        run_grpo_job(config, &options)
                            .with_context(|| format!("the {} arm", config.loss.implementation.name()))
                    })
                    .expect("spawning an arm's thread")
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| anyhow::bail!("an arm panicked"))).collect()
    })
}

pub fn main(args: AbArgs) -> Result<()> {
    crate::train_cmd::prepare_process();
    let mut configs = Vec::new();
    for (k, implementation) in [LossImpl::Baseline, LossImpl::FusedLinear].into_iter().enumerate() {
        let out = args.out.join(implementation.name());
        let mut config = arm_config(&args, implementation, &out)?;
        // One progress bar: the first arm's (the two advance together).
        config.progress &= k == 0;
        eprintln!("== arm loss.impl = {} -> {}", implementation.name(), out.display());
        configs.push(config);
    }
    eprintln!("(the arms take turns step by step)");
    let configs: [TrainConfig; 2] = configs.try_into().map_err(|_| anyhow::anyhow!("two arms"))?;
    let summaries = run_alternating(&configs)?;
    let results: Vec<(TrainConfig, GrpoJobSummary)> = configs.into_iter().zip(summaries).collect();
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
                let points = metric_series(&s.out.join("metrics.jsonl"), key)?;
                Ok(Series::new(c.loss.implementation.name(), moving_average(&points, 10), Style::Line))
            })
            .collect()
    };
    let plot = |file: &str, title: &str, y: &str, key: &str, from_zero: bool| -> Result<()> {
        let title = format!("{title} (mean of 10 steps)");
        let axes = Axes { title: &title, y_label: y, y_from_zero: from_zero };
        Ok(line_plot(&args.out.join(file), &axes, &series(key)?)?)
    };
    plot("reward.png", "reward: baseline vs fused_linear", "mean reward", "train/reward_mean", false)?;
    plot("loss.png", "loss: baseline vs fused_linear", "loss", "train/loss", false)?;
    plot("update_time.png", "update time: baseline vs fused_linear", "seconds", "time/update_s", true)?;
    println!("table in {}; each arm's metrics and plots under {}", path.display(), args.out.display());
    Ok(())
}

//! `flashgrpo bench-trainer`: flashgrpo's GRPO trainer beside Hugging Face TRL's `GRPOTrainer`
//! (the tool our users would pick instead), on the CPU, from the same warm start, with the same
//! task, prompts, rewards and settings, in one command.
//!
//! 1. The SFT warm start of the config (`OUT/warm_start`, a Hugging Face directory; reused when
//!    it is there, or `--warm-start DIR`).
//! 2. The task's training prompts rendered with the chat template (`OUT/prompts.jsonl`), which
//!    TRL reads as text and checks against our token ids.
//! 3. `--rounds` rounds of: `flashgrpo train` for `--steps` GRPO steps from the warm start, then
//!    `bench/peers/trl_grpo.py` for as many, each in its own process (its peak memory is its own).
//! 4. A table of the medians per step (the first step of each run left out): the step, generation,
//!    scoring (rewards, advantages, log-probabilities) and the update, and each process's peak
//!    RSS; printed, and written to `OUT/bench_trainer.md` and `.json`, with every setting that
//!    differs between the two.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use flashgrpo_train::grpo_job::{from_warm_start, make_warm_start, rendered_prompts, warm_start_dir};
use flashgrpo_train::TrainConfig;
use serde_json::{json, Value};

use crate::config::{load_tree, Source};
use crate::peers::{json_lines, median, python, run_measured, script};

#[derive(Debug, clap::Args)]
pub struct BenchTrainerArgs {
    /// YAML config of the run (without it: the built-in task and model, as `flashgrpo train`).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override any key: `--set grpo.micro_batch_size=32`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// GRPO steps per run.
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Rounds of (flashgrpo, TRL), alternating, so that both see the same minutes of the machine.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Start from this Hugging Face directory instead of the config's warm start.
    #[arg(long)]
    pub warm_start: Option<PathBuf>,
    #[arg(long, default_value = "runs/bench-trainer")]
    pub out: PathBuf,
}

/// Per-step medians of one tool.
#[derive(Debug, Default, Clone)]
struct Times {
    step: Vec<f64>,
    rollout: Vec<f64>,
    score: Vec<f64>,
    update: Vec<f64>,
    peak_rss: Vec<u64>,
    completion_len: Vec<f64>,
    reward_first: Option<f64>,
    reward_last: Option<f64>,
}

impl Times {
    fn json(&self) -> Value {
        json!({
            "step_s_p50": median(self.step.clone()),
            "rollout_s_p50": median(self.rollout.clone()),
            "score_s_p50": median(self.score.clone()),
            "update_s_p50": median(self.update.clone()),
            "peak_rss_bytes": self.peak_rss.iter().max(),
            "steps_timed": self.step.len(),
            "completion_len_mean": self.completion_len.iter().sum::<f64>() / self.completion_len.len().max(1) as f64,
            "reward_first": self.reward_first,
            "reward_last": self.reward_last,
        })
    }
}

fn config_of(args: &BenchTrainerArgs) -> Result<TrainConfig> {
    let source = match &args.config {
        Some(p) => Source::File(p),
        None => Source::Defaults,
    };
    let (mut map, origin) = load_tree(source, &args.sets)?;
    map.insert("algo".into(), Value::from("grpo"));
    Ok(TrainConfig::from_value(Value::Object(map), &origin)?)
}

/// The warm start: given, already in `out`, or made now (setup and SFT only).
fn warm_start(args: &BenchTrainerArgs, config: &TrainConfig) -> Result<PathBuf> {
    if let Some(dir) = &args.warm_start {
        return Ok(dir.clone());
    }
    let dir = warm_start_dir(&args.out);
    if dir.join("model.safetensors").exists() {
        eprintln!("bench-trainer: reusing the warm start in {}", dir.display());
        return Ok(dir);
    }
    if config.sft.steps == 0 {
        bail!("the config has no SFT warm start (sft.steps = 0); give one with --warm-start DIR");
    }
    eprintln!("bench-trainer: making the SFT warm start in {} ({} SFT steps)", dir.display(), config.sft.steps);
    let mut c = config.clone();
    c.out = args.out.clone();
    Ok(make_warm_start(&c)?)
}

/// The config of our arm: GRPO only, from the warm start, no evaluation or checkpoints.
fn our_config(config: &TrainConfig, warm: &Path, steps: usize, out: &Path) -> TrainConfig {
    let mut c = from_warm_start(config, warm);
    c.out = out.to_path_buf();
    c.progress = false;
    c.grpo.steps = steps;
    c.grpo.eval_every_steps = 0;
    c.grpo.checkpoint_every = 0;
    c.data.eval_limit = 0;
    c
}

fn run_ours(config: &TrainConfig, log: &Path) -> Result<Times> {
    std::fs::create_dir_all(&config.out)?;
    let path = config.out.join("bench-config.json");
    std::fs::write(&path, serde_json::to_string_pretty(config)?)?;
    let exe = std::env::current_exe()?;
    let measured = run_measured(Command::new(exe).args(["train", "--config"]).arg(&path), log)?;
    let text = std::fs::read_to_string(config.out.join("metrics.jsonl"))?;
    let records: Vec<Value> = json_lines(&text).into_iter().filter(|r| r.get("time/step_s").is_some()).collect();
    let get = |r: &Value, k: &str| r.get(k).and_then(Value::as_f64).unwrap_or(0.0);
    let mut t = Times { peak_rss: vec![measured.peak_rss_bytes], ..Default::default() };
    t.completion_len = records.iter().map(|r| get(r, "train/completion_len_mean")).collect();
    for r in records.iter().skip(1) {
        t.step.push(get(r, "time/step_s"));
        t.rollout.push(get(r, "time/rollout_s"));
        t.score.push(get(r, "time/reward_s") + get(r, "time/logprob_s"));
        t.update.push(get(r, "time/update_s"));
    }
    t.reward_first = records.first().map(|r| get(r, "train/reward_mean"));
    t.reward_last = records.last().map(|r| get(r, "train/reward_mean"));
    Ok(t)
}

/// TRL's arguments for the same settings.
fn trl_args(c: &TrainConfig, warm: &Path, prompts: &Path, steps: usize, out: &Path) -> Vec<String> {
    let (g, o) = (&c.grpo, &c.loss.options);
    let loss_type = serde_json::to_value(o.loss_type).ok().and_then(|v| v.as_str().map(str::to_string));
    let scale = serde_json::to_value(g.scale_rewards).ok().and_then(|v| v.as_str().map(str::to_string));
    let aggregation =
        serde_json::to_value(g.multi_objective_aggregation).ok().and_then(|v| v.as_str().map(str::to_string));
    let weights: Vec<String> = g.reward_weights.iter().map(f64::to_string).collect();
    [
        ("--model", warm.display().to_string()),
        ("--prompts", prompts.display().to_string()),
        ("--out", out.display().to_string()),
        ("--steps", steps.to_string()),
        ("--prompts-per-step", g.prompts_per_step.to_string()),
        ("--num-generations", g.num_generations.to_string()),
        ("--micro-batch-size", g.micro_batch_size.to_string()),
        ("--max-new-tokens", g.max_new_tokens.to_string()),
        ("--temperature", g.temperature.to_string()),
        ("--top-k", g.top_k.to_string()),
        ("--top-p", g.top_p.to_string()),
        ("--min-p", g.min_p.to_string()),
        ("--repetition-penalty", g.repetition_penalty.to_string()),
        ("--multi-objective-aggregation", aggregation.unwrap_or_else(|| "sum_then_normalize".into())),
        ("--loss-type", loss_type.unwrap_or_else(|| "dapo".into())),
        ("--beta", o.beta.to_string()),
        ("--use-bias-correction-kl", o.use_bias_correction_kl.to_string()),
        ("--epsilon", o.epsilon_low.to_string()),
        ("--epsilon-high", o.epsilon_high().to_string()),
        ("--scale-rewards", scale.unwrap_or_else(|| "group".into())),
        ("--reward-weights", weights.join(",")),
        ("--ppo-epochs", g.ppo_epochs.to_string()),
        ("--lr", g.optim.lr.to_string()),
        ("--warmup-steps", g.optim.warmup_steps.to_string()),
        ("--max-grad-norm", g.optim.max_grad_norm.unwrap_or(0.0).to_string()),
        ("--weight-decay", g.optim.weight_decay.to_string()),
        ("--seed", c.seed.to_string()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_string(), v])
    .collect()
}

fn run_trl(python: &Path, args: &[String], log: &Path) -> Result<(Times, Value)> {
    let measured = run_measured(Command::new(python).arg(script("trl_grpo.py")).args(args), log)?;
    let lines = json_lines(&measured.stdout);
    let summary = lines.iter().find(|l| l.get("summary").is_some()).cloned().context("TRL printed no summary")?;
    let get = |r: &Value, k: &str| r.get(k).and_then(Value::as_f64).unwrap_or(0.0);
    let mut t = Times { peak_rss: vec![measured.peak_rss_bytes], ..Default::default() };
    for r in lines.iter().filter(|l| l.get("step").is_some()).skip(1) {
        t.step.push(get(r, "step_s"));
        t.rollout.push(get(r, "rollout_s"));
        t.score.push(get(r, "score_s"));
        t.update.push(get(r, "update_s"));
    }
    t.completion_len = summary.get("completion_len_mean").and_then(Value::as_f64).into_iter().collect();
    t.reward_first = summary.get("reward_first").and_then(Value::as_f64);
    t.reward_last = summary.get("reward_last").and_then(Value::as_f64);
    Ok((t, summary))
}

fn merge(into: &mut Times, t: Times) {
    into.step.extend(t.step);
    into.rollout.extend(t.rollout);
    into.score.extend(t.score);
    into.update.extend(t.update);
    into.peak_rss.extend(t.peak_rss);
    into.completion_len.extend(t.completion_len);
    into.reward_first = into.reward_first.or(t.reward_first);
    into.reward_last = t.reward_last.or(into.reward_last);
}

/// The settings that are not the same in the two runs.
fn differences(c: &TrainConfig, trl: &Value) -> Vec<String> {
    let mut d = vec![
        "Random streams: flashgrpo draws prompts (with replacement) and tokens from its own generator; TRL's \
         RepeatSampler shuffles the prompts (without replacement) and torch.multinomial draws the tokens. Same \
         distributions, different draws, so the completions (and their lengths) differ step by step."
            .to_string(),
        "Generation: TRL calls transformers' generate on all rows (every prompt's G copies, finished rows kept in \
         the batch, the DynamicCache grown per token); flashgrpo prefills each distinct prompt once and drops \
         finished rows."
            .to_string(),
        "The update: TRL computes each sequence's prompt tokens in every micro-batch; flashgrpo computes a prompt \
         shared by several sequences once (exact: the same loss and gradients)."
            .to_string(),
        format!(
            "Threads: TRL uses torch's {} intra-op threads; flashgrpo rayon's {}.",
            trl.get("threads").and_then(Value::as_u64).unwrap_or(0),
            rayon::current_num_threads()
        ),
    ];
    if c.loss.implementation != flashgrpo_train::LossImpl::FusedLinear {
        d.push(format!(
            "flashgrpo's loss.impl is {} (TRL: its own chunked fused lm_head).",
            c.loss.implementation.name()
        ));
    }
    if let Some(n) = trl.get("prompt_token_mismatches").and_then(Value::as_u64).filter(|&n| n > 0) {
        d.push(format!("{n} of the first 500 prompts tokenize differently in TRL (transformers' tokenizer)."));
    }
    d
}

fn mib(b: u64) -> String {
    format!("{:.0} MB", b as f64 / 1e6)
}

fn table(c: &TrainConfig, ours: &Value, trl: &Value, steps: usize, rounds: usize) -> String {
    let f = |v: &Value, k: &str| v.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
    let model = format!(
        "H={} layers={} heads={}/{} vocab={}",
        c.model.hidden_size,
        c.model.num_layers,
        c.model.num_heads,
        c.model.num_kv_heads,
        c.model.vocab_size.map_or("tokenizer".into(), |v| v.to_string())
    );
    let mut s = format!(
        "{} prompts x {} completions, {} new tokens, {}, beta {}, lr {}, micro-batches of {}, f32; {} GRPO steps x {} \
         round(s) each, medians of steps 2-{} (model: {})\n\n",
        c.grpo.prompts_per_step,
        c.grpo.num_generations,
        c.grpo.max_new_tokens,
        serde_json::to_value(c.loss.options.loss_type)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default(),
        c.loss.options.beta,
        c.grpo.optim.lr,
        c.grpo.micro_batch_size,
        steps,
        rounds,
        steps,
        if c.model.path.is_some() { "from model.path".to_string() } else { model }
    );
    s.push_str("| per GRPO step | TRL GRPOTrainer | flashgrpo train | TRL / flashgrpo |\n|---|---|---|---|\n");
    for (label, key) in [
        ("step", "step_s_p50"),
        ("generation", "rollout_s_p50"),
        ("scoring (rewards, advantages, log-probs)", "score_s_p50"),
        ("update (forward, backward, optimiser)", "update_s_p50"),
    ] {
        let (t, o) = (f(trl, key), f(ours, key));
        s.push_str(&format!("| {label} | {t:.3} s | {o:.3} s | {:.1}x |\n", t / o));
    }
    s.push_str(&format!(
        "| completion length (tokens, mean) | {:.1} | {:.1} | |\n",
        f(trl, "completion_len_mean"),
        f(ours, "completion_len_mean")
    ));
    let rss = |v: &Value| v.get("peak_rss_bytes").and_then(Value::as_u64).unwrap_or(0);
    s.push_str(&format!(
        "| peak RSS (whole process) | {} | {} | {:.1}x |\n",
        mib(rss(trl)),
        mib(rss(ours)),
        rss(trl) as f64 / rss(ours).max(1) as f64
    ));
    s
}

pub fn main(args: BenchTrainerArgs) -> Result<()> {
    crate::train_cmd::prepare_process();
    let config = config_of(&args)?;
    std::fs::create_dir_all(&args.out)?;
    let warm = warm_start(&args, &config)?;
    let base = from_warm_start(&config, &warm);
    let prompts = args.out.join("prompts.jsonl");
    let lines: Vec<String> = rendered_prompts(&base)?.iter().map(|p| serde_json::to_string(p).expect("json")).collect();
    std::fs::write(&prompts, lines.join("\n") + "\n")?;
    let python = python()?;
    let log = args.out.join("bench-trainer.log");
    let (mut ours, mut trl, mut trl_summary) = (Times::default(), Times::default(), Value::Null);
    for round in 0..args.rounds {
        eprintln!("bench-trainer: round {} of {}: flashgrpo ({} steps)", round + 1, args.rounds, args.steps);
        let c = our_config(&config, &warm, args.steps, &args.out.join(format!("flashgrpo-{round}")));
        merge(&mut ours, run_ours(&c, &log)?);
        eprintln!("bench-trainer: round {} of {}: TRL ({} steps)", round + 1, args.rounds, args.steps);
        let targs = trl_args(&c, &warm, &prompts, args.steps, &args.out.join(format!("trl-{round}")));
        let (t, summary) = run_trl(&python, &targs, &log)?;
        merge(&mut trl, t);
        trl_summary = summary;
    }
    let (ours_json, trl_json) = (ours.json(), trl.json());
    let mut text = table(&config, &ours_json, &trl_json, args.steps, args.rounds);
    text.push_str("\nSettings that differ:\n");
    for d in differences(&config, &trl_summary) {
        text.push_str(&format!("- {d}\n"));
    }
    text.push_str(&format!(
        "\nMean reward, first and last step: TRL {:.3} -> {:.3}, flashgrpo {:.3} -> {:.3}.\n",
        trl.reward_first.unwrap_or(f64::NAN),
        trl.reward_last.unwrap_or(f64::NAN),
        ours.reward_first.unwrap_or(f64::NAN),
        ours.reward_last.unwrap_or(f64::NAN)
    ));
    println!("{text}");
    std::fs::write(args.out.join("bench_trainer.md"), &text)?;
    let report = json!({"flashgrpo": ours_json, "trl": trl_json, "trl_summary": trl_summary, "steps": args.steps, "rounds": args.rounds});
    std::fs::write(args.out.join("bench_trainer.json"), serde_json::to_string_pretty(&report)?)?;
    Ok(())
}

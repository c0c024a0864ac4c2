//! The GRPO trainer end to end on tiny models: GSM8K rewards on real answers, the pipeline on
//! GSM8K prompts, micro-batching equal to one batch, the three loss implementations agreeing,
//! and a killed-then-resumed run ending with the metrics of one that never stopped.

mod common;

use std::path::PathBuf;

use common::gsm8k;
use flashgrpo_train::data::{load_gsm8k, TaskName};
use flashgrpo_train::grpo::checkpoint_dir;
use flashgrpo_train::grpo_job::{run_grpo_job, JobOptions};
use flashgrpo_train::rewards::{formatted, score, DEFAULT_WEIGHTS};
use flashgrpo_train::{LossImpl, TrainConfig};
use serde_json::Value;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("flashgrpo-grpo-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A tiny arithmetic run: small model, few prompts, short completions.
fn tiny(name: &str) -> TrainConfig {
    let mut c = TrainConfig { progress: false, ..TrainConfig::default() };
    c.out = scratch(name);
    c.model.hidden_size = 32;
    c.model.num_layers = 1;
    c.model.num_heads = 2;
    c.model.num_kv_heads = 1;
    c.tokenizer.vocab_size = 300;
    c.model.vocab_size = None;
    c.data.limit = Some(300);
    c.data.eval_limit = 8;
    c.sft.steps = 5;
    c.sft.batch_size = 8;
    c.grpo.steps = 3;
    c.grpo.prompts_per_step = 4;
    c.grpo.num_generations = 4;
    c.grpo.micro_batch_size = 16;
    c.grpo.max_new_tokens = 12;
    c.grpo.eval_batch_size = 8;
    c.grpo.eval_every_steps = 2;
    c.grpo.checkpoint_every = 0;
    c
}

fn records(dir: &std::path::Path) -> Vec<serde_json::Map<String, Value>> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap().as_object().unwrap().clone())
        .collect()
}

/// The records without what depends on the clock or the machine.
fn deterministic(records: &[serde_json::Map<String, Value>]) -> Vec<serde_json::Map<String, Value>> {
    records
        .iter()
        .map(|r| {
            r.iter()
                .filter(|(k, _)| !k.starts_with("time/") && !k.starts_with("mem/") && !k.starts_with("throughput/"))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .collect()
}

#[test]
fn gsm8k_rewards_on_real_answers() {
    let problems = load_gsm8k(&gsm8k("test.jsonl"), Some(200)).unwrap();
    for p in &problems {
        let gold = formatted(&p.reasoning, &p.answer);
        assert_eq!(score(&gold, &p.answer), [1.0, 1.0, 1.0], "{gold}");
        let total: f64 = score(&gold, &p.answer).iter().zip(DEFAULT_WEIGHTS).map(|(r, w)| r * w).sum();
        assert_eq!(total, 2.0);
        let wrong_number = p.answer.replace(',', "").parse::<f64>().unwrap() + 1.0;
        let wrong = formatted(&p.reasoning, &wrong_number.to_string());
        assert_eq!(score(&wrong, &p.answer)[0], 0.0, "{wrong}");
        // Thousands separators and decimals compare as numbers.
        let written = formatted("", &format!("{}.0", p.answer.replace(',', "")));
        assert_eq!(score(&written, &p.answer)[0], 1.0, "{written}");
    }
}

#[test]
fn two_grpo_steps_on_gsm8k_prompts() {
    let mut c = tiny("gsm8k");
    c.task.name = TaskName::Gsm8k;
    c.data.path = gsm8k("train.jsonl");
    c.data.eval_path = Some(gsm8k("test.jsonl"));
    c.data.limit = Some(64);
    c.data.eval_limit = 4;
    c.sft.steps = 0;
    c.grpo.steps = 2;
    c.grpo.prompts_per_step = 2;
    c.model.max_positions = 1024;
    let s = run_grpo_job(&c, &JobOptions::default()).unwrap();
    assert_eq!(s.grpo.steps, 2);
    let r = records(&c.out);
    assert_eq!(r[0]["eval/accuracy"], 0.0);
    for key in [
        "train/loss",
        "train/reward_mean",
        "train/reward_std",
        "train/rewards/correctness",
        "train/rewards/strict_format",
        "train/rewards/tag_count",
        "train/accuracy",
        "train/advantage_std",
        "train/entropy",
        "train/clip_ratio",
        "train/completion_len_mean",
        "time/rollout_s",
        "time/reward_s",
        "time/update_s",
        "time/step_s",
        "time/step_avg_last10_s",
        "throughput/valid_tokens_per_s",
        "mem/peak_rss_bytes",
    ] {
        assert!(r[1][key].as_f64().is_some_and(f64::is_finite), "{key}: {:?}", r[1]);
    }
    assert!(r[2].contains_key("eval/accuracy"));
    for file in ["config.json", "summary.json", "model/model.safetensors", "plots/reward.png", "plots/accuracy.png"] {
        assert!(c.out.join(file).exists(), "{file}");
    }
    // The system prompt went through the trained tokenizer's ChatML template.
    let config: Value = serde_json::from_str(&std::fs::read_to_string(c.out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["task"]["name"], "gsm8k");
}

#[test]
fn micro_batches_and_implementations_agree() {
    let run = |name: &str, micro: usize, implementation: LossImpl, beta: f64| {
        let mut c = tiny(name);
        c.grpo.steps = 2;
        c.grpo.micro_batch_size = micro;
        c.grpo.ppo_epochs = 2;
        c.loss.options.beta = beta;
        c.loss.implementation = implementation;
        c.data.eval_limit = 0;
        run_grpo_job(&c, &JobOptions::default()).unwrap();
        records(&c.out)
    };
    let whole = run("whole", 16, LossImpl::FusedLinear, 0.04);
    let micro = run("micro", 5, LossImpl::FusedLinear, 0.04);
    let fused = run("fused", 16, LossImpl::Fused, 0.04);
    let base = run("base", 6, LossImpl::Baseline, 0.04);
    for (name, other) in [("micro", &micro), ("fused", &fused), ("baseline", &base)] {
        // The first step: the same rollout, so the same loss and gradient. (Later steps sample
        // from weights that differ in the last bits, and Adam turns near-zero gradients of
        // different sign into full-size steps: the runs then agree in distribution only.)
        for (a, b) in whole.iter().zip(other.iter()).filter(|(a, _)| a["step"] == 1) {
            for key in ["train/loss", "train/grad_norm", "train/reward_mean", "train/kl"] {
                let (Some(x), Some(y)) = (a.get(key).and_then(Value::as_f64), b.get(key).and_then(Value::as_f64))
                else {
                    continue;
                };
                assert!((x - y).abs() <= 1e-4 * (1.0 + x.abs()), "{name} step {}: {key}: {x} vs {y}", a["step"]);
            }
        }
    }
    assert!(whole[0]["train/kl"].as_f64().is_some());
}

/// A run killed after its last checkpoint resumes to the metrics (and logged completions) of a
/// run never killed.
#[test]
fn a_killed_run_resumes_to_the_same_metrics() {
    let mut c = tiny("straight");
    c.grpo.steps = 4;
    c.grpo.checkpoint_every = 2;
    c.loss.options.beta = 0.04;
    c.grpo.log_completions = true;
    run_grpo_job(&c, &JobOptions::default()).unwrap();
    let straight = deterministic(&records(&c.out));

    let mut k = c.clone();
    k.out = scratch("killed");
    // Killed after step 3: the checkpoint is step 2's, step 3's record must be redone.
    run_grpo_job(&k, &JobOptions { stop_after: Some(3), ..Default::default() }).unwrap();
    assert_eq!(records(&k.out).len(), 4);
    run_grpo_job(&k, &JobOptions { resume: Some(checkpoint_dir(&k.out)), ..Default::default() }).unwrap();
    let resumed = deterministic(&records(&k.out));
    assert_eq!(straight, resumed);
    // TRL's log_completions: step 3's lines, written before the kill, are not there twice.
    let completions = |out: &std::path::Path| std::fs::read_to_string(out.join("completions.jsonl")).unwrap();
    assert_eq!(completions(&c.out), completions(&k.out));
    assert!(completions(&c.out).lines().count() >= 4);
}

/// The update scores exactly what the rollout sampled: under the update's layout (prompts
/// left-padded, completions right-padded, positions from each row's first token), the greedy
/// completion's tokens are the argmax at every completion position.
#[test]
fn the_update_layout_sees_what_generation_saw() {
    use flashgrpo_train::grpo::batch::MicroBatch;
    use flashgrpo_train::model::{generate, Qwen2, Qwen2Config, Sampling};
    let model = Qwen2::random(Qwen2Config::tiny(50, 32, 2, 4, 2), candle_core::DType::F32, 3).unwrap();
    let prompts: Vec<Vec<u32>> = vec![vec![5, 6, 7, 8, 9], vec![10], vec![11, 12, 13]];
    let greedy = Sampling { temperature: 0.0, max_new_tokens: 7, ..Default::default() };
    let mut rng = flashgrpo_kernels::synthetic::Rng::new(1);
    let g = generate(&model, &prompts, &greedy, &[0], 1, &mut rng).unwrap();
    let p: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let c: Vec<&[u32]> = g.completions.iter().map(Vec::as_slice).collect();
    let mb = MicroBatch::new(&p, &c, 1).unwrap();
    let hidden = mb.completion_hidden(&model, false).unwrap();
    let logits: Vec<Vec<Vec<f32>>> = model.logits(&hidden).unwrap().to_vec3().unwrap();
    for (r, completion) in g.completions.iter().enumerate() {
        for (j, &token) in completion.iter().enumerate() {
            let row = &logits[r][j];
            let argmax = (0..row.len()).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap();
            assert_eq!(argmax as u32, token, "row {r} position {j}");
        }
    }
}

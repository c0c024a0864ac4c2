//! SFT: the loss falls on GSM8K with a tiny random model and a BPE trained on the text; the three
//! head-loss implementations train identically; gradient accumulation equals one large batch;
//! bf16 parameters train; bad inputs name the file and line.

mod common;

use std::path::{Path, PathBuf};

use common::gsm8k;
use flashgrpo_train::sft_job::run_sft_job;
use flashgrpo_train::{LossImpl, TrainConfig};
use serde_json::Value;

fn out_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("flashgrpo-sft-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn tiny(steps: usize) -> TrainConfig {
    let mut c = TrainConfig { algo: flashgrpo_train::Algo::Sft, progress: false, ..TrainConfig::default() };
    c.task.name = flashgrpo_train::data::TaskName::Gsm8k;
    c.data.path = gsm8k("train.jsonl");
    c.data.limit = Some(300);
    c.data.eval_path = Some(gsm8k("test.jsonl"));
    c.data.eval_limit = 16;
    c.tokenizer.vocab_size = 512;
    c.model.vocab_size = None;
    c.model.hidden_size = 64;
    c.model.num_layers = 2;
    c.model.num_heads = 4;
    c.model.num_kv_heads = 2;
    c.sft.steps = steps;
    c.sft.batch_size = 4;
    c.sft.max_len = 160;
    c.sft.optim.lr = 3e-3;
    c.sft.optim.warmup_steps = 2;
    c
}

fn metrics(dir: &Path) -> Vec<serde_json::Map<String, Value>> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap().as_object().unwrap().clone())
        .collect()
}

fn series(m: &[serde_json::Map<String, Value>], key: &str) -> Vec<f64> {
    m.iter().filter_map(|r| r.get(key).and_then(Value::as_f64)).collect()
}

#[test]
fn sft_lowers_the_loss_and_saves_a_loadable_model() {
    let out = out_dir("lowers");
    let s = run_sft_job(&tiny(40), &out, &flashgrpo_collective::SingleProcess).unwrap();
    let (before, after) = (s.eval_before.unwrap(), s.eval_after.unwrap());
    assert!(after < before - 1.5, "held-out loss {before} -> {after}");
    assert!(s.last_loss < s.first_loss - 1.0, "train loss {} -> {}", s.first_loss, s.last_loss);
    assert_eq!(s.skipped_steps, 0);
    let m = metrics(&out);
    assert_eq!(series(&m, "train/loss").len(), 40);
    assert!(series(&m, "train/grad_norm").iter().all(|g| g.is_finite() && *g > 0.0));
    // The saved directory is a model directory: it loads, with its tokenizer.
    let model = flashgrpo_train::model::load_model(&out.join("model"), None).unwrap();
    let tokenizer = flashgrpo_train::model::load_tokenizer(&out.join("model")).unwrap();
    assert_eq!(model.config.vocab_size, tokenizer.get_vocab_size(true));
    assert!(out.join("model/tokenizer_config.json").exists() && out.join("config.json").exists());
    let _ = std::fs::remove_dir_all(&out);
}

/// Runs `steps` steps and returns the logged train losses and gradient norms.
fn trace(config: &TrainConfig, name: &str) -> (Vec<f64>, Vec<f64>) {
    let out = out_dir(name);
    run_sft_job(config, &out, &flashgrpo_collective::SingleProcess).unwrap();
    let m = metrics(&out);
    let _ = std::fs::remove_dir_all(&out);
    (series(&m, "train/loss"), series(&m, "train/grad_norm"))
}

fn assert_close(a: &[f64], b: &[f64], rel: f64, what: &str) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= rel * y.abs().max(1e-3), "{what} step {}: {x} vs {y}", i + 1);
    }
}

#[test]
fn the_three_loss_implementations_train_the_same() {
    let mut c = tiny(4);
    c.data.eval_path = None;
    c.loss.options.label_smoothing = 0.1;
    c.loss.options.z_loss = 1e-3;
    let mut traces = Vec::new();
    for implementation in [LossImpl::FusedLinear, LossImpl::Fused, LossImpl::Baseline] {
        c.loss.implementation = implementation;
        if implementation == LossImpl::Baseline {
            // The composed baseline has plain cross-entropy only.
            c.loss.options.label_smoothing = 0.0;
            c.loss.options.z_loss = 0.0;
            let fused = trace(
                &{
                    let mut f = c.clone();
                    f.loss.implementation = LossImpl::FusedLinear;
                    f
                },
                "plain",
            );
            traces.push(("fused_linear (plain)", fused));
        }
        traces.push((implementation.name(), trace(&c, implementation.name())));
    }
    let (fl, fu) = (&traces[0].1, &traces[1].1);
    assert_close(&fu.0, &fl.0, 1e-4, "fused vs fused_linear loss");
    assert_close(&fu.1, &fl.1, 1e-3, "fused vs fused_linear grad norm");
    let (plain, base) = (&traces[2].1, &traces[3].1);
    assert_close(&base.0, &plain.0, 1e-4, "baseline vs fused_linear loss");
    assert_close(&base.1, &plain.1, 1e-3, "baseline vs fused_linear grad norm");
}

#[test]
fn accumulation_equals_one_large_batch() {
    let mut one = tiny(3);
    one.data.eval_path = None;
    one.sft.batch_size = 6;
    let mut accumulated = one.clone();
    accumulated.sft.batch_size = 2;
    accumulated.sft.grad_accum = 3;
    let (a, b) = (trace(&one, "one"), trace(&accumulated, "accum"));
    assert_close(&b.0, &a.0, 1e-4, "loss");
    assert_close(&b.1, &a.1, 1e-3, "grad norm");
}

#[test]
fn bf16_parameters_train() {
    let mut c = tiny(25);
    c.model.dtype = flashgrpo_kernels::DType::BF16;
    let out = out_dir("bf16");
    let s = run_sft_job(&c, &out, &flashgrpo_collective::SingleProcess).unwrap();
    assert!(s.eval_after.unwrap() < s.eval_before.unwrap() - 1.0, "{s:?}");
    let model = flashgrpo_train::model::load_model(&out.join("model"), None).unwrap();
    assert_eq!(model.dtype(), candle_core::DType::BF16);
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn bad_inputs_are_named() {
    let dir = out_dir("bad");
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"question\": \"q\", \"answer\": \"a\\n#### 3\"}\n{\"question\": \"q\", \"answer\": \"no final\"}\n",
    )
    .unwrap();
    let mut c = tiny(1);
    c.data.path = bad.clone();
    let e = run_sft_job(&c, &dir.join("out"), &flashgrpo_collective::SingleProcess).err().unwrap().to_string();
    assert!(e.contains("bad.jsonl line 2") && e.contains("####"), "{e}");
    c.data.path = dir.join("missing.jsonl");
    let e = run_sft_job(&c, &dir.join("out"), &flashgrpo_collective::SingleProcess).err().unwrap().to_string();
    assert!(e.contains("missing.jsonl"), "{e}");
    let mut c = tiny(1);
    c.model.path = Some(dir.clone());
    let e = run_sft_job(&c, &dir.join("out"), &flashgrpo_collective::SingleProcess).err().unwrap().to_string();
    assert!(e.contains("tokenizer.json") || e.contains("config.json"), "{e}");
    let mut c = tiny(1);
    c.loss.options.reduction = flashgrpo_kernels::Reduction::Sum;
    let e = run_sft_job(&c, &dir.join("out"), &flashgrpo_collective::SingleProcess).err().unwrap().to_string();
    assert!(e.contains("loss.reduction"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

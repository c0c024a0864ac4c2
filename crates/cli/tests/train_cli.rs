//! `flashgrpo train --algo sft`: the shipped SFT configs resolve, a short run from the tiny config
//! writes its model, metrics and config, and bad keys are named.

use std::path::PathBuf;
use std::process::{Command, Output};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn train(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flashgrpo")).current_dir(root()).arg("train").args(args).output().unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn every_shipped_sft_config_resolves() {
    for entry in std::fs::read_dir(root().join("configs")).unwrap() {
        let path = entry.unwrap().path();
        if !path.file_name().unwrap().to_string_lossy().starts_with("sft-") {
            continue;
        }
        let o = train(&["--config", path.to_str().unwrap(), "--print-config"]);
        assert!(o.status.success(), "{}: {}", path.display(), text(&o));
        assert!(text(&o).contains("algo: sft"), "{}", text(&o));
    }
}

#[test]
fn a_short_sft_run_writes_model_metrics_and_config() {
    let out = std::env::temp_dir().join(format!("flashgrpo-train-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let o = train(&[
        "--config",
        "configs/sft-gsm8k-tiny.yaml",
        "--set",
        "sft.steps=3",
        "--set",
        "data.limit=200",
        "--set",
        "data.eval_limit=8",
        "--set",
        "model.hidden_size=32",
        "--set",
        "tokenizer.vocab_size=400",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    for needle in ["train/loss first", "eval/loss", "time/step_s", "mem/peak_rss_bytes", "mem/peak_heap_bytes"] {
        assert!(t.contains(needle), "missing {needle}: {t}");
    }
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().filter(|l| l.contains("train/loss")).count(), 3);
    for file in ["config.json", "model/config.json", "model/model.safetensors", "model/tokenizer.json"] {
        assert!(out.join(file).exists(), "{file}");
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn bad_keys_and_values_are_named() {
    let o = train(&["--algo", "sft", "--set", "sft.stepz=3", "--print-config"]);
    assert!(!o.status.success() && text(&o).contains("stepz"), "{}", text(&o));
    let o = train(&["--algo", "sft", "--set", "loss.impl=triton", "--print-config"]);
    assert!(!o.status.success() && text(&o).contains("triton"), "{}", text(&o));
    let o = train(&["--algo", "sft", "--set", "sft.optim.lr=-1", "--print-config"]);
    assert!(!o.status.success() && text(&o).contains("lr"), "{}", text(&o));
    let o = train(&["--algo", "sft", "--set", "model.num_heads=3", "--print-config"]);
    assert!(!o.status.success() && text(&o).contains("num_attention_heads"), "{}", text(&o));
    let o = train(&["--config", "configs/none.yaml"]);
    assert!(!o.status.success() && text(&o).contains("configs/none.yaml"), "{}", text(&o));
}

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
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let algo = if name.starts_with("sft-") {
            "algo: sft"
        } else if name.starts_with("gsm8k-") || name.starts_with("ab-") {
            "algo: grpo"
        } else {
            continue;
        };
        let o = train(&["--config", path.to_str().unwrap(), "--print-config"]);
        assert!(o.status.success(), "{}: {}", path.display(), text(&o));
        assert!(text(&o).contains(algo), "{}", text(&o));
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
    let o = train(&["--algo", "sft", "--set", "model.bf16_products=tpu", "--print-config"]);
    assert!(!o.status.success() && text(&o).contains("bf16_products") && text(&o).contains("widened"), "{}", text(&o));
    let o = train(&["--algo", "sft", "--set", "model.bf16_products=widened", "--print-config"]);
    assert!(o.status.success() && text(&o).contains("bf16_products: widened"), "{}", text(&o));
}

/// Settings that make a GRPO run of the built-in task take seconds.
const TINY_GRPO: [&str; 24] = [
    "--set",
    "model.vocab_size=null",
    "--set",
    "model.hidden_size=32",
    "--set",
    "model.num_layers=1",
    "--set",
    "tokenizer.vocab_size=300",
    "--set",
    "data.limit=200",
    "--set",
    "data.eval_limit=8",
    "--set",
    "sft.steps=3",
    "--set",
    "grpo.prompts_per_step=2",
    "--set",
    "grpo.num_generations=2",
    "--set",
    "grpo.max_new_tokens=8",
    "--set",
    "progress=false",
    "--set",
    "grpo.checkpoint_every=1",
];

#[test]
fn grpo_runs_resumes_and_the_ab_prints_its_table() {
    let out = std::env::temp_dir().join(format!("flashgrpo-grpo-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let run = out.join("run");
    let mut args = vec!["--set", "grpo.steps=2", "--out", run.to_str().unwrap()];
    args.extend(TINY_GRPO);
    let o = train(&args);
    assert!(o.status.success(), "{}", text(&o));
    for needle in ["eval/accuracy (held out", "before GRPO", "after GRPO", "time/step_avg_last10_s"] {
        assert!(text(&o).contains(needle), "missing {needle}: {}", text(&o));
    }
    for file in [
        "plots/reward.png",
        "plots/accuracy.png",
        "plots/loss.png",
        "plots/step_time.png",
        "checkpoint/trainer_state.json",
    ] {
        assert!(run.join(file).exists(), "{file}");
    }
    // Resuming a finished run has nothing left to do, and says so through the same table.
    let o = train(&["--resume", run.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let o = train(&["--resume", out.join("nothing").to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(text(&o).contains("no checkpoint"), "{}", text(&o));

    let ab = out.join("ab");
    let mut args = vec!["ab", "--steps", "2", "--out", ab.to_str().unwrap()];
    args.extend(TINY_GRPO);
    let o = Command::new(env!("CARGO_BIN_EXE_flashgrpo")).current_dir(root()).args(&args).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    for needle in ["| baseline | fused_linear |", "max abs train/loss difference", "time/update_s", "peak"] {
        assert!(text(&o).contains(needle), "missing {needle}: {}", text(&o));
    }
    assert!(ab.join("ab.md").exists() && ab.join("baseline/metrics.jsonl").exists());
}

/// TRL's names of `grpo:` settings (`num_iterations` for `ppo_epochs`): a `--set` under either
/// name overrides a file (or a resumed run's config.json) that gives the other.
#[test]
fn trl_names_and_ours_override_each_other() {
    let dir = std::env::temp_dir().join(format!("flashgrpo-trl-names-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let epochs = |file: &str, set: &str| -> String {
        let path = dir.join("c.yaml");
        std::fs::write(&path, file).unwrap();
        let o = train(&["--config", path.to_str().unwrap(), "--set", set, "--print-config"]);
        assert!(o.status.success(), "{}", text(&o));
        let printed = String::from_utf8_lossy(&o.stdout).to_string();
        printed.lines().find(|l| l.trim_start().starts_with("ppo_epochs:")).unwrap().trim().to_string()
    };
    assert_eq!(epochs("grpo:\n  ppo_epochs: 1\n", "grpo.num_iterations=3"), "ppo_epochs: 3");
    assert_eq!(epochs("grpo:\n  num_iterations: 2\n", "grpo.ppo_epochs=3"), "ppo_epochs: 3");
    assert_eq!(epochs("grpo:\n  num_iterations: 2\n", "grpo.num_iterations=4"), "ppo_epochs: 4");
    assert_eq!(epochs("grpo:\n  num_iterations: 2\n", "grpo.steps=4"), "ppo_epochs: 2");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A tiny run of three GRPO steps with `extra` settings, in a fresh temporary directory.
fn three_grpo_steps(name: &str, extra: &[&str]) -> PathBuf {
    let out = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let mut args = vec!["--set", "grpo.steps=3", "--out", out.to_str().unwrap()];
    args.extend(TINY_GRPO);
    args.extend(extra);
    let o = train(&args);
    assert!(o.status.success(), "{}", text(&o));
    out
}

/// The GRPO steps' records of a run's metrics.jsonl.
fn step_records(run: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r.get("train/loss").is_some())
        .collect()
}

fn flashgrpo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flashgrpo")).current_dir(root()).args(args).output().unwrap()
}

/// `plot` redraws a run's plots; `bench-rollout` (flashgrpo's side only) generates exactly
/// `batch x new_tokens` tokens from the run's warm start; `update-grads` names what is wrong with a
/// malformed batch.
#[test]
fn plot_bench_rollout_and_update_grads_on_a_tiny_run() {
    let out = std::env::temp_dir().join(format!("flashgrpo-tools-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let run = out.join("run");
    let mut args =
        vec!["--set", "grpo.steps=1", "--set", "task.system_prompt=Be brief.", "--out", run.to_str().unwrap()];
    args.extend(TINY_GRPO);
    assert!(train(&args).status.success());

    std::fs::remove_dir_all(run.join("plots")).unwrap();
    let o = flashgrpo(&["plot", run.to_str().unwrap()]);
    assert!(o.status.success() && run.join("plots/step_time.png").exists(), "{}", text(&o));
    let o = flashgrpo(&["plot", out.join("nothing").to_str().unwrap()]);
    assert!(!o.status.success() && text(&o).contains("metrics.jsonl"), "{}", text(&o));

    let warm = run.join("warm_start");
    let bench = out.join("bench");
    let o = flashgrpo(&[
        "bench-rollout",
        "--model",
        warm.to_str().unwrap(),
        "--batch",
        "8",
        "--groups",
        "4",
        "--prompt-len",
        "5",
        "--new-tokens",
        "6",
        "--repeats",
        "1",
        "--no-peer",
        "--out",
        bench.to_str().unwrap(),
    ]);
    assert!(o.status.success() && text(&o).contains("flashgrpo rollout"), "{}", text(&o));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(bench.join("bench_rollout.json")).unwrap()).unwrap();
    assert_eq!(report["tokens"], 48.0);
    let o = flashgrpo(&["bench-rollout", "--model", warm.to_str().unwrap(), "--batch", "6", "--groups", "4"]);
    assert!(!o.status.success() && text(&o).contains("multiple of --groups"), "{}", text(&o));

    // A prompt mask with a hole in it: the error names the tensor and the row.
    let batch = out.join("batch.safetensors");
    let ids = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let floats = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let tensors = [
        ("prompt_ids", safetensors::Dtype::I64, vec![2, 3], ids(&[5, 6, 7, 5, 6, 7])),
        ("prompt_mask", safetensors::Dtype::I64, vec![2, 3], ids(&[1, 1, 1, 1, 0, 1])),
        ("completion_ids", safetensors::Dtype::I64, vec![2, 2], ids(&[8, 9, 8, 9])),
        ("completion_mask", safetensors::Dtype::I64, vec![2, 2], ids(&[1, 1, 1, 0])),
        ("advantages", safetensors::Dtype::F32, vec![2], floats(&[0.5, -0.5])),
    ];
    let views: Vec<(&str, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (*n, safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &batch).unwrap();
    let grads = out.join("grads.safetensors");
    let o = flashgrpo(&[
        "update-grads",
        "--model",
        warm.to_str().unwrap(),
        "--batch",
        batch.to_str().unwrap(),
        "--out",
        grads.to_str().unwrap(),
    ]);
    assert!(!o.status.success() && text(&o).contains("prompt_ids row 1"), "{}", text(&o));
    assert!(!grads.exists());

    generate_from_the_run(&run, &out);
    let _ = std::fs::remove_dir_all(&out);
}

/// `generate` on a run's model: text prompts through the run's chat template with its system
/// prompt, token-id prompts, every completion within `--max-new-tokens` and ended by a stop token
/// when finished, the same lines for the same seed, greedy by default (no generation_config.json);
/// bad input named.
fn generate_from_the_run(run: &std::path::Path, out: &std::path::Path) {
    let model = run.join("model");
    let prompts = out.join("prompts.jsonl");
    std::fs::write(&prompts, "{\"prompt_ids\": [5, 6, 7]}\n\n{\"prompt\": \"Ann has 3 pens.\"}\n").unwrap();
    let generate = |extra: &[&str]| {
        let mut args = vec!["generate", "--model", model.to_str().unwrap(), "--max-new-tokens", "9"];
        args.extend(extra);
        flashgrpo(&args)
    };
    let sampled = ["--prompt", "Ben has 4 coins.", "--prompts", prompts.to_str().unwrap(), "--num-generations", "2"];
    let knobs =
        ["--temperature", "1", "--top-k", "20", "--top-p", "0.95", "--min-p", "0.01", "--repetition-penalty", "1.2"];
    let o = generate(&[&sampled[..], &knobs[..]].concat());
    assert!(o.status.success(), "{}", text(&o));
    let lines: Vec<serde_json::Value> =
        String::from_utf8_lossy(&o.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 6);
    assert_eq!(lines[0]["prompt"], "Ben has 4 coins.");
    assert_eq!(lines[2]["prompt_ids"], serde_json::json!([5, 6, 7]));
    assert!(lines[2]["prompt"].is_null());
    // ChatML, as the run rendered its prompts: <|im_start|> (id 1) first, the assistant's turn open.
    let chat = lines[4]["prompt_ids"].as_array().unwrap();
    assert_eq!(chat[0], 1);
    for l in &lines {
        let ids = l["completion_ids"].as_array().unwrap();
        assert!(!ids.is_empty() && ids.len() <= 9, "{l}");
        // The trained tokenizer's end of text (0) and ChatML's end of turn (2) end a completion.
        assert_eq!(l["finished"], [0, 2].contains(&ids.last().unwrap().as_u64().unwrap()), "{l}");
    }
    assert_eq!(generate(&[&sampled[..], &knobs[..]].concat()).stdout, o.stdout, "the same seed, the same lines");
    // The run's system prompt by default; `--system` replaces it, "" drops it.
    let prompt_ids = |extra: &[&str]| {
        let o = generate(&[&["--prompt", "Ben has 4 coins."][..], extra].concat());
        assert!(o.status.success(), "{}", text(&o));
        let line: serde_json::Value =
            serde_json::from_str(String::from_utf8_lossy(&o.stdout).lines().next().unwrap()).unwrap();
        (line["prompt_ids"].clone(), line["completion_ids"].clone())
    };
    let (run_system, greedy) = prompt_ids(&[]);
    assert_eq!(prompt_ids(&["--system", "Be brief."]).0, run_system);
    let (no_system, _) = prompt_ids(&["--system", ""]);
    assert!(no_system.as_array().unwrap().len() < run_system.as_array().unwrap().len());
    assert_eq!(prompt_ids(&["--seed", "9"]).1, greedy, "greedy without a generation_config.json");
    let o = generate(&["--prompt", "x", "--raw", "--system", "y"]);
    assert!(!o.status.success() && text(&o).contains("--system"), "{}", text(&o));
    let o = generate(&["--prompt", "x", "--min-p", "2"]);
    assert!(!o.status.success() && text(&o).contains("--min-p"), "{}", text(&o));
    let o = generate(&[]);
    assert!(!o.status.success() && text(&o).contains("no prompts"), "{}", text(&o));
    std::fs::write(&prompts, "{\"prompt_ids\": [5]}\n{\"text\": \"x\"}\n").unwrap();
    let o = generate(&["--prompts", prompts.to_str().unwrap()]);
    assert!(!o.status.success() && text(&o).contains("line 2"), "{}", text(&o));
}

#[test]
fn multi_process_settings_that_cannot_work_are_named() {
    // A launcher's world of 2 for a binary built without MPI: refused, with the way to build one.
    let o = Command::new(env!("CARGO_BIN_EXE_flashgrpo"))
        .current_dir(root())
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .args(["train", "--set", "sft.steps=1", "--set", "grpo.steps=1"])
        .output()
        .unwrap();
    assert!(!o.status.success() && text(&o).contains("--features mpi"), "{}", text(&o));
    // A mesh that is not the world.
    let o = train(&["--set", "parallel.vocab=3", "--set", "sft.steps=1", "--set", "grpo.steps=1"]);
    assert!(!o.status.success() && text(&o).contains("parallel.vocab (3)"), "{}", text(&o));
}

/// GRPO with LOSSES.md's additions switched on through the config (TRL 1.16's names): the
/// sampler's log-probabilities handed to the loss with a token-level rollout correction and the
/// off-policy mask, the top-entropy tokens with TRL's masked-mean entropy bonus under the adaptive
/// coefficient, truncated completions masked; the recorded-vs-update metric is logged every step.
#[test]
fn grpo_with_the_trl_1_16_options_logs_their_metrics() {
    let out = three_grpo_steps(
        "flashgrpo-grpo-options",
        &[
            "--set",
            "grpo.sampling_logp=true",
            "--set",
            "loss.vllm_importance_sampling_mode=token_mask",
            "--set",
            "loss.off_policy_mask_threshold=0.5",
            "--set",
            "loss.top_entropy_quantile=0.5",
            "--set",
            "loss.entropy_coef=0.01",
            "--set",
            "loss.entropy_bonus=masked_mean",
            "--set",
            "grpo.use_adaptive_entropy=true",
            "--set",
            "grpo.entropy_target=100",
            "--set",
            "grpo.mask_truncated_completions=true",
            "--set",
            "grpo.multi_objective_aggregation=normalize_then_sum",
            "--set",
            "grpo.min_p=0.02",
            "--set",
            "grpo.repetition_penalty=1.1",
            "--set",
            "grpo.log_completions=true",
            "--set",
            "grpo.num_completions_to_print=3",
        ],
    );
    let steps = step_records(&out);
    assert_eq!(steps.len(), 3, "{steps:?}");
    let coef: Vec<f64> = steps.iter().map(|r| r["train/entropy_coef"].as_f64().unwrap()).collect();
    // The entropy is below the target every step: the coefficient grows by entropy_coef_delta.
    assert!((coef[1] - coef[0] - 0.005).abs() < 1e-12 && (coef[2] - coef[1] - 0.005).abs() < 1e-12, "{coef:?}");
    for r in &steps {
        let d = r["train/rollout_logp_max_abs_diff"].as_f64().unwrap();
        assert!((0.0..1e-4).contains(&d), "{r}");
    }
    // TRL's log_completions: three of each step's completions, with their rewards and advantage.
    let logged: Vec<serde_json::Value> = std::fs::read_to_string(out.join("completions.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(logged.iter().map(|l| l["step"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 1, 1, 2, 2, 2, 3, 3, 3]);
    for l in &logged {
        let rewards = &l["rewards"];
        let weighted = rewards["correctness"].as_f64().unwrap()
            + 0.5 * rewards["strict_format"].as_f64().unwrap()
            + 0.5 * rewards["tag_count"].as_f64().unwrap();
        assert!((l["reward"].as_f64().unwrap() - weighted).abs() < 1e-12, "{l}");
        assert!(l["prompt"].as_str().unwrap().contains("<|im_start|>user") && l["completion"].is_string(), "{l}");
        // The rewards are those of the completion logged beside them: its tags counted again.
        let completion = l["completion"].as_str().unwrap();
        let tags = ["<think>", "</think>", "<answer>", "</answer>"];
        let once = tags.iter().filter(|t| completion.matches(*t).count() == 1).count();
        assert_eq!(rewards["tag_count"].as_f64().unwrap(), once as f64 * 0.25, "{l}");
        assert!(l["advantage"].as_f64().unwrap().is_finite(), "{l}");
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// TRL's `sync_ref_model`: with a period of 2 steps and alpha 1, the reference is synchronised at
/// step 2 (logged) and not at steps 1 and 3, and then holds the policy's weights exactly: the KL
/// term of step 3 (the policy that step 2 left against that same reference) is 0, where step 2's
/// (the policy after step 1 against the initial reference) is not; the checkpoint keeps it.
#[test]
fn sync_ref_model_moves_the_reference() {
    let out = three_grpo_steps(
        "flashgrpo-sync-ref",
        &[
            "--set",
            "loss.beta=0.04",
            "--set",
            "grpo.sync_ref_model=true",
            "--set",
            "grpo.ref_model_sync_steps=2",
            "--set",
            "grpo.ref_model_mixup_alpha=1.0",
            // Enough warm start and groups for rewards that differ, and a step large enough to move
            // the policy measurably.
            "--set",
            "sft.steps=40",
            "--set",
            "grpo.num_generations=8",
            "--set",
            "grpo.optim.lr=3e-3",
        ],
    );
    let steps = step_records(&out);
    let synced: Vec<bool> = steps.iter().map(|r| r.get("train/ref_model_synced").is_some()).collect();
    assert_eq!(synced, [false, true, false]);
    let kl: Vec<f64> = steps.iter().map(|r| r["train/kl"].as_f64().unwrap()).collect();
    println!("KL per step: {kl:?}");
    assert!(kl[1] > 1e-10 && kl[2].abs() < 1e-12 && kl[0].abs() < 1e-12, "{kl:?}");
    // The checkpoint keeps the synchronised reference (no longer the warm start it began as).
    let reference = std::fs::read(out.join("checkpoint/reference/model.safetensors")).unwrap();
    let start = std::fs::read(out.join("warm_start/model.safetensors")).unwrap();
    let (reference, start) = (
        safetensors::SafeTensors::deserialize(&reference).unwrap(),
        safetensors::SafeTensors::deserialize(&start).unwrap(),
    );
    let moved = reference.tensors().iter().filter(|(name, r)| r.data() != start.tensor(name).unwrap().data()).count();
    assert!(moved > 0);
    let _ = std::fs::remove_dir_all(&out);
}

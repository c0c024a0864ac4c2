//! `flashgrpo gradcheck` on every shipped config, its metrics by name, and its gates.

use std::path::PathBuf;
use std::process::{Command, Output};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn gradcheck(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flashgrpo")).arg("gradcheck").args(args).output().unwrap()
}

const METRICS: &[&str] = &[
    "loss_ref",
    "loss_kernel",
    "abs_diff_loss",
    "fwd/logp_max_abs",
    "fwd/per_loss_max_abs",
    "dlogits_max_abs",
    "dlogits_max_rel",
    "dlogits_mean_abs",
    "shape/batch",
    "shape/seq_len",
    "shape/vocab",
    "time/ref_grad_s",
    "time/kernel_grad_s",
];

#[test]
fn every_shipped_config_passes_and_prints_the_metrics() {
    let mut configs: Vec<PathBuf> = std::fs::read_dir(root().join("configs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("gradcheck-"))
        .collect();
    configs.sort();
    assert!(configs.len() >= 3);
    for config in configs {
        let o = gradcheck(&["--config", config.to_str().unwrap(), "--set", "repeats=1"]);
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{}: {}{}", config.display(), stdout, String::from_utf8_lossy(&o.stderr));
        let linear = config.to_string_lossy().contains("linear");
        let expected: Vec<&str> = if linear {
            METRICS
                .iter()
                .filter(|m| !m.starts_with("dlogits"))
                .copied()
                .chain(["dhidden_rel_norm", "dweight_rel_norm"])
                .collect()
        } else {
            METRICS.to_vec()
        };
        for m in expected {
            assert!(stdout.lines().any(|l| l.split_whitespace().next() == Some(m)), "{} lacks {m}", config.display());
        }
        assert!(stdout.contains("gradcheck passed"));
    }
}

#[test]
fn the_default_is_the_original_grpo_shape_and_json_works() {
    let o = gradcheck(&["--json", "--set", "repeats=1"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["shape/batch"], 1);
    assert_eq!(v["shape/seq_len"], 129);
    assert_eq!(v["shape/vocab"], 151_936);
    assert!(v["dlogits_max_rel"].as_f64().unwrap() < 1e-4);
}

#[test]
fn a_breached_gate_fails_with_the_reason() {
    let o = gradcheck(&["--set", "vocab=64", "--set", "seq_len=8", "--set", "tolerances.dlogits_rel_norm=0"]);
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("gradcheck failed") && e.contains("dlogits_rel_norm"), "{e}");
    let o = gradcheck(&["--set", "vocab=64", "--set", "tolerance.loss_rel=1"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown key `tolerance`"));
}

#[test]
fn the_tolerances_follow_the_dtype_unless_set() {
    // The built-in config leaves the gates to LOSSES.md, so bf16 inputs get the bf16 gradient's.
    let small = ["--set", "vocab=300", "--set", "seq_len=8", "--set", "repeats=1", "--set", "dtype=bf16"];
    let o = gradcheck(&small);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // A gate set tighter than the dtype's says where it came from.
    let o = gradcheck(&[&small[..], &["--set", "tolerances.dlogits_rel_norm=1e-5"]].concat());
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("`tolerances.dlogits_rel_norm` in the config") && e.contains("is 1e-2"), "{e}");
}

#[test]
fn logits_from_a_file_and_non_finite_values() {
    let dir = std::env::temp_dir().join(format!("flashgrpo-gradcheck-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("logits.safetensors");
    let write = |values: &[f32]| {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 3, 10], &bytes).unwrap();
        safetensors::serialize_to_file([("logits", view)], None, &path).unwrap();
    };
    let mut values: Vec<f32> = (0..60).map(|i| ((i * 37) % 11) as f32 * 0.3 - 1.5).collect();
    write(&values);
    let file = format!("logits_file={}", path.display());
    let o = gradcheck(&["--set", &file, "--set", "mask_fraction=0"]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{stdout} {}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout.contains("shape/vocab                10"), "{stdout}");
    values[33] = f32::NAN;
    write(&values);
    let o = gradcheck(&["--set", &file, "--set", "mask_fraction=0"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("logits row 3 (b = 1, t = 0) contains NaN or Inf"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `FLASHGRPO_ISA` picks the row kernels of the process (to time a fallback); the loss agrees
/// with the default kernels', and a level the CPU cannot run is reported and ignored.
#[test]
fn bench_row_kernels_follow_flashgrpo_isa() {
    let run = |isa: &str| {
        let o = Command::new(env!("CARGO_BIN_EXE_flashgrpo"))
            .env("FLASHGRPO_ISA", isa)
            .args(["bench", "--json", "--set", "vocab=3001", "--set", "batch=2", "--set", "seq_len=8"])
            .args(["--set", "steps=1", "--set", "warmup=0", "--set", "dtype=bf16"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{isa}: {}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        (v, String::from_utf8_lossy(&o.stderr).into_owned())
    };
    let (default, _) = run("");
    let (generic, _) = run("generic");
    assert_eq!(generic["bench/row_kernels"], "generic");
    let (a, b) = (default["bench/loss"].as_f64().unwrap(), generic["bench/loss"].as_f64().unwrap());
    assert!((a - b).abs() < 1e-5 * a.abs().max(1.0), "default {a} vs generic {b}");
    let (bogus, stderr) = run("avx9000");
    assert!(stderr.contains("FLASHGRPO_ISA=avx9000 is not a level this CPU can run"), "{stderr}");
    assert_eq!(bogus["bench/row_kernels"], default["bench/row_kernels"]);
    // Each forced level against the f64 reference: gradcheck exits non-zero on a breach of
    // LOSSES.md's tolerances.
    for isa in ["generic", "avx2"] {
        let o = Command::new(env!("CARGO_BIN_EXE_flashgrpo"))
            .env("FLASHGRPO_ISA", isa)
            .args(["gradcheck", "--set", "vocab=3001", "--set", "seq_len=16"])
            .output()
            .unwrap();
        assert!(o.status.success(), "gradcheck with FLASHGRPO_ISA={isa}: {}", String::from_utf8_lossy(&o.stderr));
    }
}

/// `bf16_products` picks the fused-linear products' way for the run (reported, and the rate of
/// the same way measured); every way agrees on the loss; a way this machine lacks is refused with
/// the list of those it has.
#[test]
fn bench_bf16_products_follow_the_config() {
    let run = |way: &str| {
        Command::new(env!("CARGO_BIN_EXE_flashgrpo"))
            .args(["bench", "--json", "--set", "impl=fused-linear", "--set", "hidden_size=64", "--set", "dtype=bf16"])
            .args(["--set", "vocab=3001", "--set", "batch=2", "--set", "seq_len=16", "--set", "steps=1"])
            .args(["--set", "warmup=0", "--set", &format!("bf16_products={way}")])
            .output()
            .unwrap()
    };
    let loss = |way: &str| {
        let o = run(way);
        assert!(o.status.success(), "{way}: {}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        (v["bench/bf16_products"].as_str().unwrap().to_string(), v["bench/loss"].as_f64().unwrap())
    };
    let (auto_way, auto_loss) = loss("auto");
    let (widened, widened_loss) = loss("widened");
    assert_eq!(widened, "widened");
    assert!(
        (auto_loss - widened_loss).abs() < 1e-4 * auto_loss.abs().max(1.0),
        "{auto_way} {auto_loss} vs widened {widened_loss}"
    );
    let (rounded, rounded_loss) = loss(if auto_way == "widened" { "widened" } else { "rounded" });
    assert!(rounded == "widened" || rounded.ends_with("-rounded"), "{rounded}");
    assert!((auto_loss - rounded_loss).abs() < 1e-4 * auto_loss.abs().max(1.0), "{rounded} {rounded_loss}");
    let o = run("tpu");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && stderr.contains("bf16_products") && stderr.contains("widened"), "{stderr}");
}

#[test]
fn bench_reports_every_metric_and_impls_agree() {
    let mut losses = Vec::new();
    for imp in ["fused-inplace", "fused", "baseline"] {
        let o = Command::new(env!("CARGO_BIN_EXE_flashgrpo"))
            .args(["bench", "--json", "--set", "vocab=3000", "--set", "batch=2", "--set", "seq_len=16"])
            .args(["--set", "steps=2", "--set", "warmup=1", "--set", &format!("impl={imp}")])
            .output()
            .unwrap();
        assert!(o.status.success(), "{imp}: {}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        for key in [
            "bench/step_s_mean",
            "bench/step_s_p50",
            "bench/step_s_p90",
            "bench/loss",
            "mem/peak_bytes",
            "mem/peak_rss_bytes",
            "bench/copy_gbps",
            "bench/floor_s",
            "shape/vocab",
        ] {
            assert!(!v[key].is_null(), "{imp} lacks {key}");
        }
        assert_eq!(v["bench/impl"], imp);
        // The fused steps' floor as a pass over their own buffers; none for the baseline.
        let floor = v["bench/p50_over_pass_floor"].as_f64();
        assert_eq!(floor.is_some(), imp != "baseline", "{imp}: bench/p50_over_pass_floor {floor:?}");
        assert!(floor.is_none_or(|f| f.is_finite() && f > 0.0), "{imp}: {floor:?}");
        losses.push(v["bench/loss"].as_f64().unwrap());
    }
    assert!((losses[0] - losses[1]).abs() < 1e-9 && (losses[0] - losses[2]).abs() < 1e-5, "{losses:?}");
    // Fused-linear mode: the candle baseline (materialised logits) agrees with fused-linear.
    let mut linear = Vec::new();
    for imp in ["fused-linear", "baseline"] {
        let o = Command::new(env!("CARGO_BIN_EXE_flashgrpo"))
            .args([
                "bench",
                "--json",
                "--set",
                "vocab=3000",
                "--set",
                "batch=2",
                "--set",
                "seq_len=16",
                "--set",
                "hidden_size=32",
            ])
            .args(["--set", "steps=2", "--set", "warmup=1", "--set", "with_bias=true", "--set", &format!("impl={imp}")])
            .output()
            .unwrap();
        assert!(o.status.success(), "{imp}: {}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        for key in ["bench/gflops", "bench/matmul_gflops", "mem/peak_above_grads_bytes", "shape/hidden"] {
            assert!(!v[key].is_null(), "{imp} lacks {key}");
        }
        linear.push(v["bench/loss"].as_f64().unwrap());
    }
    assert!((linear[0] - linear[1]).abs() < 1e-4 * linear[0].abs().max(1.0), "{linear:?}");
    let o = Command::new(env!("CARGO_BIN_EXE_flashgrpo"))
        .args(["bench", "--set", "hidden_size=8", "--set", "impl=fused"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("use fused-linear or baseline"));
    let o = Command::new(env!("CARGO_BIN_EXE_flashgrpo")).args(["bench", "--set", "imp=fused"]).output().unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown key `imp`"));
}

/// `gradcheck --device cuda` and `bench --device cuda`: where a GPU exists, a passing gradcheck
/// (logits and fused-linear) and a bench report with CUDA timings and allocator memory; where none
/// does, an error saying why, not a crash.
#[test]
fn device_cuda_checks_and_benches_or_says_why_not() {
    let small = ["--set", "repeats=1", "--set", "batch=2", "--set", "seq_len=16", "--set", "vocab=3001"];
    for config in ["configs/gradcheck-grpo-original-bf16.yaml", "configs/gradcheck-linear-grpo.yaml"] {
        let path = root().join(config);
        let mut args = vec!["--config", path.to_str().unwrap(), "--device", "cuda"];
        args.extend(small);
        let o = gradcheck(&args);
        let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        if o.status.success() {
            assert!(stdout.contains("device                     cuda: "), "{stdout}");
            assert!(stdout.contains("gradcheck passed"), "{stdout}");
        } else {
            assert!(stderr.contains("CUDA") || stderr.contains("NVRTC"), "{config}: {stdout}{stderr}");
        }
    }
    let o = Command::new(env!("CARGO_BIN_EXE_flashgrpo"))
        .args(["bench", "--device", "cuda", "--json", "--set", "seq_len=64", "--set", "vocab=5000"])
        .args(["--set", "warmup=1", "--set", "steps=2"])
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    if o.status.success() {
        let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        for key in ["bench/step_s_p50", "mem/peak_bytes", "mem/free_drop_bytes", "bench/copy_gbps"] {
            assert!(report[key].is_number(), "{key} missing: {stdout}");
        }
    } else {
        assert!(stderr.contains("CUDA") || stderr.contains("NVRTC"), "{stdout}{stderr}");
    }
}

//! Checks against code no one here wrote, in the peers' venv (created on first use by
//! `bench/peers/setup.sh`; set `FLASHGRPO_PEERS_VENV` to use another location):
//! - `tests/peers/crosscheck.py`: `flashgrpo loss` against `F.cross_entropy`, Liger-Kernel's
//!   `LigerFusedLinearGRPOLoss` and TRL-style float64 autograd;
//! - `tests/peers/trl_losses.py`: `flashgrpo loss` against TRL 1.16's own `_compute_loss` and
//!   rollout-correction code, for every option TRL 1.16 added (luspo, vespo, rollout correction,
//!   off-policy mask, top-entropy quantile, its entropy bonus);
//! - `tests/peers/verl_losses.py`: the verl additions (aggregation modes, dual clip, gpg,
//!   geo_mean, the KL estimators) against verl's formulas, re-implemented from its source;
//! - `tests/peers/hf_forward.py`: `flashgrpo forward` against Hugging Face transformers' Qwen2;
//! - `tests/peers/hf_generate.py`: `flashgrpo generate` against transformers' `generate` (greedy
//!   tokens with and without a repetition penalty; the sampling distribution with temperature,
//!   top-k, top-p, min-p and the penalty);
//! - `tests/peers/trl_oracle.py`: the GRPO trainer's update (`flashgrpo update-grads`) against
//!   TRL's `GRPOTrainer.compute_loss`, loss and every parameter's gradient;
//! - `tests/peers/tensorboard_read.py`: the training metrics' TensorBoard event files, read back by
//!   the `tensorboard` package;
//! - `tests/cuda/nvrtc_compile.py`: every CUDA source compiles to PTX for sm_80 and sm_90 with the
//!   venv's NVRTC (no GPU or CUDA toolkit needed).

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

static SETUP: Mutex<Option<String>> = Mutex::new(None);

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The venv's python, creating the venv once.
fn python() -> String {
    let mut cached = SETUP.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = cached.as_ref() {
        return p.clone();
    }
    let mut setup = Command::new("bash");
    setup.arg(root().join("bench/peers/setup.sh"));
    if let Ok(dir) = std::env::var("FLASHGRPO_PEERS_VENV") {
        setup.arg(dir);
    }
    let out = setup.output().expect("bash runs");
    assert!(out.status.success(), "peer venv setup failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let python = String::from_utf8_lossy(&out.stdout).lines().last().expect("setup prints the python path").to_string();
    *cached = Some(python.clone());
    python
}

/// The venv's python on `args`: its stdout, after checking that it succeeded.
fn python_stdout<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> String {
    let out = Command::new(python()).args(args).output().expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("{stdout}");
    let what = args.first().map(|a| a.as_ref().to_string_lossy().into_owned()).unwrap_or_default();
    assert!(out.status.success(), "{what} failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

/// A script of the repository that ends by printing "N checks, 0 failures".
fn run_script(script: &str, args: &[&str]) {
    let mut all = vec![root().join(script).into_os_string()];
    all.extend(args.iter().map(Into::into));
    let stdout = python_stdout(&all);
    assert!(stdout.contains(" 0 failures"), "{stdout}");
}

#[test]
fn flashgrpo_loss_matches_pytorch_and_liger_kernel() {
    run_script("tests/peers/crosscheck.py", &["--bin", env!("CARGO_BIN_EXE_flashgrpo")]);
}

#[test]
fn grpo_losses_match_trl_1_16_loss_code() {
    run_script("tests/peers/trl_losses.py", &["--bin", env!("CARGO_BIN_EXE_flashgrpo")]);
}

#[test]
fn grpo_losses_match_verl_formulas() {
    run_script("tests/peers/verl_losses.py", &["--bin", env!("CARGO_BIN_EXE_flashgrpo")]);
}

#[test]
fn flashgrpo_forward_matches_hugging_face_transformers() {
    run_script("tests/peers/hf_forward.py", &["--bin", env!("CARGO_BIN_EXE_flashgrpo")]);
}

#[test]
fn flashgrpo_generate_matches_hugging_face_generate() {
    run_script("tests/peers/hf_generate.py", &["--bin", env!("CARGO_BIN_EXE_flashgrpo")]);
}

#[test]
fn grpo_update_matches_trl_grpo_trainer() {
    run_script("tests/peers/trl_oracle.py", &["--bin", env!("CARGO_BIN_EXE_flashgrpo")]);
}

/// A tiny `flashgrpo train` run (SFT warm start, then GRPO), its TensorBoard files read back.
#[test]
fn tensorboard_reads_the_training_metrics() {
    let out = std::env::temp_dir().join(format!("flashgrpo-tensorboard-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let sets = [
        "model.hidden_size=32",
        "model.num_layers=1",
        "model.num_heads=2",
        "model.num_kv_heads=1",
        "model.vocab_size=null",
        "tokenizer.vocab_size=300",
        "data.limit=300",
        "data.eval_limit=8",
        "sft.steps=5",
        "sft.batch_size=8",
        "grpo.steps=3",
        "grpo.prompts_per_step=4",
        "grpo.num_generations=4",
        "grpo.micro_batch_size=16",
        "grpo.max_new_tokens=12",
        "grpo.eval_batch_size=8",
        "grpo.eval_every_steps=2",
        "progress=false",
    ];
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_flashgrpo"));
    cmd.current_dir(root()).arg("train").arg("--out").arg(&out);
    for s in sets {
        cmd.args(["--set", s]);
    }
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    run_script("tests/peers/tensorboard_read.py", &["--run", out.to_str().unwrap()]);
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn cuda_sources_compile_to_ptx_for_sm80_and_sm90() {
    run_script("tests/cuda/nvrtc_compile.py", &[]);
}

/// The GPU peer script (bench/peers/gpu_grpo.py) runs end to end with `--device cpu`, so that a
/// lent GPU's time is not spent on its bugs: one JSON line per peer with a finite loss and time.
#[test]
fn gpu_peer_script_runs_on_the_cpu() {
    let script = root().join("bench/peers/gpu_grpo.py").display().to_string();
    let stdout = python_stdout(&[
        script.as_str(),
        "--device",
        "cpu",
        "--peers",
        "torch-eager,torch-compile",
        "--batch",
        "2",
        "--seq-len",
        "8",
        "--vocab",
        "300",
        "--dtype",
        "f32",
        "--warmup",
        "1",
        "--steps",
        "2",
    ]);
    let lines: Vec<serde_json::Value> = stdout.lines().map(|l| serde_json::from_str(l).expect("JSON lines")).collect();
    assert_eq!(lines.len(), 3, "{stdout}");
    for (line, peer) in lines.iter().zip(["torch-eager", "torch-compile"]) {
        assert_eq!(line["peer"], peer, "{stdout}");
        assert!(line["loss"].as_f64().is_some_and(f64::is_finite), "{stdout}");
        assert!(line["step_s_p50"].as_f64().is_some_and(|t| t > 0.0), "{stdout}");
    }
    let (eager, compiled) = (lines[0]["loss"].as_f64().unwrap(), lines[1]["loss"].as_f64().unwrap());
    assert!(
        (eager - compiled).abs() <= 1e-5 * eager.abs().max(1.0),
        "eager and compiled compute one function: {stdout}"
    );
    assert!(lines[2]["copy_gbps"].as_f64().is_some_and(|g| g > 0.0), "{stdout}");
}

/// The fused-linear GPU peer script (bench/peers/gpu_linear_grpo.py) runs end to end with
/// `--device cpu`: every peer, Liger's chunked loss included, gives the materialised loss.
#[test]
fn gpu_linear_peer_script_runs_on_the_cpu() {
    let script = root().join("bench/peers/gpu_linear_grpo.py").display().to_string();
    let args = ["--device", "cpu", "--batch", "2", "--seq-len", "7", "--hidden", "24", "--vocab", "301"];
    let stdout = python_stdout(
        &[script.as_str()]
            .into_iter()
            .chain(args)
            .chain(["--dtype", "f32", "--warmup", "1", "--steps", "2"])
            .collect::<Vec<_>>(),
    );
    let lines: Vec<serde_json::Value> = stdout.lines().map(|l| serde_json::from_str(l).expect("JSON lines")).collect();
    let peers = ["torch-eager", "torch-compile", "liger"];
    assert_eq!(lines.len(), peers.len(), "{stdout}");
    for (line, peer) in lines.iter().zip(peers) {
        assert_eq!(line["peer"], peer, "{stdout}");
        assert!(line["step_s_p50"].as_f64().is_some_and(|t| t > 0.0), "{stdout}");
        assert!(line["loss_rel_to_first"].as_f64().is_some_and(|r| r <= 1e-5), "one loss: {stdout}");
    }
}

/// `flashgrpo cuda-check` compiles the kernels to machine code for sm_80 and sm_90 through the
/// binary's own NVRTC path (cudarc's dynamic loading, header discovery beside the library, CUBIN
/// extraction), with the venv's NVRTC wheel and no GPU: what `--device cuda` does first on a GPU.
#[test]
fn the_binary_compiles_the_kernels_to_cubin_with_nvrtc() {
    let find = "import glob, os, nvidia\n\
                libs = [l for p in nvidia.__path__ for l in glob.glob(os.path.join(p, '**', 'libnvrtc.so*'), recursive=True)\n\
                        if 'builtins' not in l]\n\
                print(os.path.dirname(libs[0]))";
    let lib_dir = python_stdout(&["-c", find]).trim().to_string();
    for arch in ["sm_80", "sm_90"] {
        let o = Command::new(env!("CARGO_BIN_EXE_flashgrpo"))
            .args(["cuda-check", "--arch", arch])
            .env("LD_LIBRARY_PATH", &lib_dir)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{stdout}{}", String::from_utf8_lossy(&o.stderr));
        assert!(stdout.contains(&format!("rows.cu compiled for {arch}")), "{stdout}");
    }
}

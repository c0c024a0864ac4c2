//! Checks against code no one here wrote, in the peers' venv (created on first use by
//! `bench/peers/setup.sh`; set `FLASHGRPO_PEERS_VENV` to use another location):
//! - `tests/peers/crosscheck.py`: `flashgrpo loss` against `F.cross_entropy`, Liger-Kernel's
//!   `LigerFusedLinearGRPOLoss` and TRL-style float64 autograd;
//! - `tests/peers/hf_forward.py`: `flashgrpo forward` against Hugging Face transformers' Qwen2;
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

fn run_script(script: &str) {
    let out = Command::new(python())
        .arg(root().join(script))
        .arg("--bin")
        .arg(env!("CARGO_BIN_EXE_flashgrpo"))
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(out.status.success(), "{script} failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains(" 0 failures"), "{stdout}");
}

#[test]
fn flashgrpo_loss_matches_pytorch_and_liger_kernel() {
    run_script("tests/peers/crosscheck.py");
}

#[test]
fn flashgrpo_forward_matches_hugging_face_transformers() {
    run_script("tests/peers/hf_forward.py");
}

#[test]
fn cuda_sources_compile_to_ptx_for_sm80_and_sm90() {
    let out = Command::new(python()).arg(root().join("tests/cuda/nvrtc_compile.py")).output().expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(out.status.success(), "NVRTC compile check failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains(" 0 failures"), "{stdout}");
}

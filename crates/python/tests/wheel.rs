//! The `flashgrpo` wheel from a clean checkout: built and installed into the peers' venv by
//! `crates/python/install.sh` (once per test run), then the Python tests of `tests/python`, each
//! ending with "N checks, 0 failures":
//! - `test_torch.py`: `flashgrpo.torch` against TRL-style float64 autograd, `F.cross_entropy`,
//!   materialised fused-linear logits and Liger-Kernel's `LigerFusedLinearGRPOLoss`;
//! - `test_token_stats.py`: per-token log-probabilities, entropies and `lse`, all differentiable,
//!   and the drop-ins built on them against Liger-Kernel's fused-linear scaled cross-entropy (its
//!   PyTorch fallback, verl's formulas) and float64 autograd;
//! - `test_arrays.py`: `flashgrpo.arrays` on NumPy and JAX arrays against the same references;
//! - `test_jax.py`: `flashgrpo.jax` (XLA FFI custom calls) under `jit`, `grad` and `vmap` against
//!   plain JAX reference code, and the original's gradcheck at its shape;
//! - `test_jax_token_stats.py`: `flashgrpo.jax`'s token statistics, each back-propagated with its
//!   own cotangent, against float64 PyTorch autograd;
//! - `test_trl.py`: TRL's `GRPOTrainer` with our loss (`examples/trl_grpo.py`) against TRL's own,
//!   two training steps;
//! - `test_no_copy.py`: the logits are read and the gradient written in place (peak memory).

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The venv's python with the wheel installed (the venv and the wheel built once).
fn python() -> &'static str {
    static PYTHON: OnceLock<String> = OnceLock::new();
    PYTHON.get_or_init(|| {
        let setup = Command::new("bash").arg(root().join("bench/peers/setup.sh")).output().expect("bash runs");
        assert!(setup.status.success(), "peer venv setup failed:\n{}", String::from_utf8_lossy(&setup.stderr));
        let python = String::from_utf8_lossy(&setup.stdout).lines().last().expect("the python path").to_string();
        let install = Command::new("bash").arg(root().join("crates/python/install.sh")).arg(&python).output();
        let install = install.expect("bash runs");
        assert!(install.status.success(), "building the wheel failed:\n{}", String::from_utf8_lossy(&install.stderr));
        python
    })
}

/// A script of `tests/python` in the venv, outside the repository's package sources (so that the
/// installed wheel is what is imported).
fn run_script(script: &str) {
    let out = Command::new(python())
        .arg(root().join("tests/python").join(script))
        .current_dir(std::env::temp_dir())
        .env("OMP_NUM_THREADS", "1")
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(out.status.success(), "{script} failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains(" 0 failures"), "{stdout}");
}

#[test]
fn torch_functions_and_modules_match_references() {
    run_script("test_torch.py");
}

#[test]
fn token_stats_and_their_drop_ins_match_liger_and_float64_autograd() {
    run_script("test_token_stats.py");
}

#[test]
fn numpy_and_jax_arrays_match_references() {
    run_script("test_arrays.py");
}

#[test]
fn jax_custom_calls_match_plain_jax_under_jit_grad_and_vmap() {
    run_script("test_jax.py");
}

#[test]
fn jax_token_stats_match_float64_autograd() {
    run_script("test_jax_token_stats.py");
}

#[test]
fn trl_grpo_trainer_with_our_loss_matches_trl() {
    run_script("test_trl.py");
}

#[test]
fn inputs_are_read_and_gradients_written_in_place() {
    run_script("test_no_copy.py");
}

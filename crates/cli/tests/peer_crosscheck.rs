//! The cross-check against code no one here wrote: `tests/peers/crosscheck.py` runs
//! `flashgrpo loss` on inputs made with PyTorch and compares with `F.cross_entropy`, Liger-Kernel's
//! `LigerFusedLinearGRPOLoss` and TRL-style float64 autograd. The peers' venv is created on first
//! use by `bench/peers/setup.sh` (set `FLASHGRPO_PEERS_VENV` to use another location).

use std::path::PathBuf;
use std::process::Command;

#[test]
fn flashgrpo_loss_matches_pytorch_and_liger_kernel() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut setup = Command::new("bash");
    setup.arg(root.join("bench/peers/setup.sh"));
    if let Ok(dir) = std::env::var("FLASHGRPO_PEERS_VENV") {
        setup.arg(dir);
    }
    let out = setup.output().expect("bash runs");
    assert!(out.status.success(), "peer venv setup failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let python = String::from_utf8_lossy(&out.stdout).lines().last().expect("setup prints the python path").to_string();
    let out = Command::new(&python)
        .arg(root.join("tests/peers/crosscheck.py"))
        .arg("--bin")
        .arg(env!("CARGO_BIN_EXE_flashgrpo"))
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(out.status.success(), "cross-check failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains(" 0 failures"), "{stdout}");
}

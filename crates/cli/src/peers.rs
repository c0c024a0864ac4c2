//! Running the peers (PyTorch, transformers, TRL) beside flashgrpo: the peer venv's python
//! (created by `bench/peers/setup.sh` on first use), the repository's peer scripts, and child
//! processes measured as a whole (wall time and peak resident memory, read by `wait4` for each
//! child alone).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

/// The repository root: the working directory when it holds `bench/peers`, else the source tree
/// this binary was built from.
pub fn repo_root() -> PathBuf {
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
    if cwd.join("bench/peers").is_dir() {
        return cwd;
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A script of `bench/peers`.
pub fn script(name: &str) -> PathBuf {
    repo_root().join("bench/peers").join(name)
}

/// The peer venv's python, creating the venv first if needed (`FLASHGRPO_PEERS_VENV` picks its
/// directory).
pub fn python() -> Result<PathBuf> {
    let mut setup = Command::new("bash");
    setup.arg(script("setup.sh"));
    if let Ok(dir) = std::env::var("FLASHGRPO_PEERS_VENV") {
        setup.arg(dir);
    }
    let out = setup.stderr(Stdio::inherit()).output().context("cannot run bench/peers/setup.sh")?;
    if !out.status.success() {
        bail!("bench/peers/setup.sh failed (it creates the peer venv: PyTorch, transformers, TRL)");
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let python = text.lines().last().context("bench/peers/setup.sh printed no python path")?;
    Ok(PathBuf::from(python.trim()))
}

/// What a measured child did.
pub struct Measured {
    pub stdout: String,
    /// The child's own peak resident set size.
    pub peak_rss_bytes: u64,
}

/// Runs `cmd` to completion, its stdout captured, its stderr appended to `log`; fails with the
/// log's tail when it fails.
pub fn run_measured(cmd: &mut Command, log: &Path) -> Result<Measured> {
    let log_file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("cannot open {}", log.display()))?;
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(log_file)
        .spawn()
        .with_context(|| format!("cannot start {:?}", cmd.get_program()))?;
    let mut bytes = Vec::new();
    let read = child.stdout.take().context("stdout is piped")?.read_to_end(&mut bytes);
    // Reap the child whatever the read did.
    let (status, peak) = wait_with_peak_rss(child.id() as libc::pid_t)?;
    read.context("cannot read the child's output")?;
    let stdout = String::from_utf8_lossy(&bytes).into_owned();
    if !status {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(20).collect();
        bail!(
            "{:?} failed; the end of {}:\n{}",
            cmd.get_program(),
            log.display(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    Ok(Measured { stdout, peak_rss_bytes: peak })
}

/// Waits for `pid` and returns whether it succeeded and its peak RSS (`wait4`'s `ru_maxrss`, of
/// that child only).
fn wait_with_peak_rss(pid: libc::pid_t) -> Result<(bool, u64)> {
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value to be overwritten.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: `pid` is our child, not yet waited for; the pointers are to live locals.
        let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        if r >= 0 {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            bail!("wait4 failed: {e}");
        }
    }
    let ok = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
    Ok((ok, usage.ru_maxrss as u64 * 1024))
}

/// The JSON objects among `stdout`'s lines.
pub fn json_lines(stdout: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l.trim()).ok())
        .filter(|v| v.is_object())
        .collect()
}

/// The median of `v` (NaN when empty).
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

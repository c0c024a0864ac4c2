//! A diagnostic: with `FLASHGRPO_CUDA_PHASES=1`, each logits-level call prints on stderr how long
//! its phases took by the host clock. The statistics phase ends with the copy of the statistics
//! back (a synchronisation), the gradient phase with the final synchronisation, so the split is
//! exact: what the GPU does and what the host does between the two passes (the O(N) objective and
//! the copies) — the part of a call that events around the whole call cannot separate.

use std::sync::OnceLock;
use std::time::Instant;

/// Whether `FLASHGRPO_CUDA_PHASES` is set (read once).
fn enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var_os("FLASHGRPO_CUDA_PHASES").is_some_and(|v| v != "0"))
}

/// The phases of one call so far, or nothing when the diagnostic is off.
pub(crate) struct PhaseClock {
    last: Option<Instant>,
    rows: usize,
    parts: Vec<(&'static str, f64)>,
}

impl PhaseClock {
    pub fn start(rows: usize) -> Self {
        Self { last: enabled().then(Instant::now), rows, parts: Vec::new() }
    }

    /// Ends the phase `name` now.
    pub fn mark(&mut self, name: &'static str) {
        if let Some(last) = self.last {
            let now = Instant::now();
            self.parts.push((name, (now - last).as_secs_f64() * 1e3));
            self.last = Some(now);
        }
    }

    /// Prints the phases (once, when the call ends).
    pub fn report(&self) {
        if self.last.is_some() {
            let parts: Vec<String> = self.parts.iter().map(|(n, ms)| format!("{n} {ms:.3} ms")).collect();
            eprintln!("cuda phases ({} rows): {}", self.rows, parts.join(", "));
        }
    }
}

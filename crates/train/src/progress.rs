//! A training loop's progress on stderr, wherever stderr goes. On a terminal, an `indicatif` bar
//! with the latest metrics. Elsewhere (a log file, CI, `| tee`), where `indicatif` draws nothing,
//! a plain line after the first step, every [`PLAIN_EVERY`] and at the last step, so that a run started from a script
//! does not look hung for minutes. Warnings (a skipped step) are printed either way, above the bar
//! on a terminal: `indicatif`'s own `println` drops them when its bar is hidden.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// How often the plain form prints its line (besides the first and the last step).
pub const PLAIN_EVERY: Duration = Duration::from_secs(30);

/// How a loop reports: `Bar` on a terminal, `Plain` lines elsewhere, or `Quiet` (progress not
/// asked for, or a rank other than 0): warnings only.
enum Form {
    Bar(indicatif::ProgressBar),
    Plain { started: Instant, last_line: Instant, first: usize },
    Quiet,
}

/// The progress of one training loop (`label`: `sft`, `grpo`) over `steps` steps.
pub struct Progress {
    form: Form,
    label: String,
    steps: usize,
    done: usize,
    message: String,
    /// Whether warnings are printed (the root rank's only: the ranks agree on what they warn of).
    warnings: bool,
}

impl Progress {
    /// Starts at `done` of `steps` (a resumed run). `show`: progress asked for, on this rank;
    /// `warnings`: this rank prints warnings.
    pub fn new(label: &str, steps: usize, done: usize, show: bool, warnings: bool) -> Self {
        let form = match (show, std::io::stderr().is_terminal()) {
            (false, _) => Form::Quiet,
            (true, true) => Form::Bar(bar(label, steps, done)),
            (true, false) => Form::Plain { started: Instant::now(), last_line: Instant::now(), first: done },
        };
        Self { form, label: label.to_string(), steps, done, message: String::new(), warnings }
    }

    /// The metrics shown after the count (`metrics::summary_line`).
    pub fn set_message(&mut self, message: String) {
        if let Form::Bar(bar) = &self.form {
            bar.set_message(message.clone());
        }
        self.message = message;
    }

    /// One step done.
    pub fn inc(&mut self) {
        self.done += 1;
        match &mut self.form {
            Form::Bar(bar) => bar.inc(1),
            Form::Plain { started, last_line, first } => {
                if self.done == *first + 1 || self.done >= self.steps || last_line.elapsed() >= PLAIN_EVERY {
                    *last_line = Instant::now();
                    let line = plain_line(&self.label, self.done, self.steps, *first, started.elapsed(), &self.message);
                    eprintln!("{line}");
                }
            }
            Form::Quiet => {}
        }
    }

    /// A line for the user (a skipped step), above the bar on a terminal.
    pub fn warn(&self, line: &str) {
        match &self.form {
            Form::Bar(bar) => bar.println(line),
            _ if self.warnings => eprintln!("{line}"),
            _ => {}
        }
    }

    pub fn finish(&self) {
        if let Form::Bar(bar) = &self.form {
            bar.finish();
        }
    }
}

fn bar(label: &str, steps: usize, done: usize) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(steps as u64);
    let template = format!("{label} {{bar:30}} {{pos}}/{{len}} [{{elapsed_precise}}<{{eta_precise}}] {{msg}}");
    bar.set_style(indicatif::ProgressStyle::with_template(&template).expect("a valid template"));
    bar.set_position(done as u64);
    bar
}

/// `grpo 120/500 [00:01:02<00:03:16] reward 1.3  acc 0.33`: the count, the time since this run's
/// first step (`first` steps were done before it: a resumed run) and the time left at this run's
/// rate so far, then the metrics.
fn plain_line(label: &str, done: usize, steps: usize, first: usize, elapsed: Duration, message: &str) -> String {
    let run = done.saturating_sub(first);
    let left = if run == 0 { Duration::ZERO } else { elapsed.mul_f64(steps.saturating_sub(done) as f64 / run as f64) };
    let line = format!("{label} {done}/{steps} [{}<{}]", clock(elapsed), clock(left));
    if message.is_empty() {
        line
    } else {
        format!("{line} {message}")
    }
}

/// `HH:MM:SS`, as the bar writes it.
fn clock(d: Duration) -> String {
    let s = d.as_secs();
    format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_line_counts_the_time_left_at_this_runs_rate() {
        let line = plain_line("grpo", 120, 500, 20, Duration::from_secs(50), "reward 1.3000  acc 0.3300");
        // 100 steps in 50 s: 380 left take 190 s.
        assert_eq!(line, "grpo 120/500 [00:00:50<00:03:10] reward 1.3000  acc 0.3300");
    }

    #[test]
    fn a_plain_line_before_any_step_of_this_run_has_no_estimate_and_no_message() {
        assert_eq!(plain_line("sft", 0, 2000, 0, Duration::ZERO, ""), "sft 0/2000 [00:00:00<00:00:00]");
        assert_eq!(clock(Duration::from_secs(3 * 3600 + 62)), "03:01:02");
    }
}

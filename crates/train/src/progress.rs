//! A training loop's progress on stderr, wherever stderr goes. On a terminal, an `indicatif` bar
//! with the latest metrics. Where `indicatif` draws nothing (stderr a log file, CI, `| tee`; or a
//! terminal with `TERM` unset or `dumb`), a plain line after the first step, every
//! [`PLAIN_EVERY`] and at the end, so that a run started from a script does not look hung for
//! minutes. Warnings (a skipped step) are printed either way on rank 0, above the bar on a
//! terminal: `indicatif`'s own `println` drops them when its bar is hidden.

use std::time::{Duration, Instant};

use indicatif::FormattedDuration;

/// How often the plain form prints its line (besides the first step and the end).
pub const PLAIN_EVERY: Duration = Duration::from_secs(30);

/// How a loop reports: `Bar` where `indicatif` draws, `Plain` lines elsewhere, or `Quiet`
/// (progress not asked for, or a rank other than 0): no progress, warnings as [`Progress`] says.
enum Form {
    Bar(indicatif::ProgressBar),
    /// `first`: the steps done before this run (a resumed run); `printed`: the count of the last
    /// line printed.
    Plain {
        started: Instant,
        last_line: Instant,
        first: usize,
        printed: usize,
    },
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
        let form = match show.then(|| bar(label, steps, done)) {
            None => Form::Quiet,
            Some(bar) if !bar.is_hidden() => Form::Bar(bar),
            Some(_) => Form::Plain { started: Instant::now(), last_line: Instant::now(), first: done, printed: done },
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
            Form::Plain { last_line, first, .. } => {
                if self.done == *first + 1 || self.done >= self.steps || last_line.elapsed() >= PLAIN_EVERY {
                    self.print_plain();
                }
            }
            Form::Quiet => {}
        }
    }

    /// A line for the user (a skipped step), above the bar on a terminal.
    pub fn warn(&self, line: &str) {
        if !self.warnings {
            return;
        }
        match &self.form {
            Form::Bar(bar) => bar.println(line),
            _ => eprintln!("{line}"),
        }
    }

    /// The end of the loop: the bar left full, or the plain line of the last step done if it
    /// was not printed (a run stopped early).
    pub fn finish(&mut self) {
        match &self.form {
            Form::Bar(bar) => bar.finish(),
            Form::Plain { printed, .. } if *printed != self.done => self.print_plain(),
            _ => {}
        }
    }

    fn print_plain(&mut self) {
        if let Form::Plain { started, last_line, first, printed } = &mut self.form {
            (*last_line, *printed) = (Instant::now(), self.done);
            eprintln!("{}", plain_line(&self.label, self.done, self.steps, *first, started.elapsed(), &self.message));
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
/// rate so far (written as the bar writes them, `indicatif::FormattedDuration`), then the metrics.
fn plain_line(label: &str, done: usize, steps: usize, first: usize, elapsed: Duration, message: &str) -> String {
    let run = done.saturating_sub(first);
    let left = if run == 0 {
        Duration::ZERO
    } else {
        let seconds = elapsed.as_secs_f64() * steps.saturating_sub(done) as f64 / run as f64;
        Duration::try_from_secs_f64(seconds).unwrap_or(Duration::MAX)
    };
    let (elapsed, left) = (FormattedDuration(elapsed), FormattedDuration(left));
    let line = format!("{label} {done}/{steps} [{elapsed}<{left}]");
    if message.is_empty() {
        line
    } else {
        format!("{line} {message}")
    }
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
    }

    #[test]
    fn an_estimate_past_what_a_duration_holds_is_the_largest_one() {
        let line = plain_line("grpo", 1, usize::MAX, 0, Duration::from_secs(1 << 40), "");
        assert!(line.starts_with("grpo 1/18446744073709551615 [12725829d 00:36:16<"), "{line}");
    }
}

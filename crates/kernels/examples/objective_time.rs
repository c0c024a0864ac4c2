//! Times the host's parts of a step: validating the inputs ([`PreparedLoss::new`]), and step 2
//! alone, the token objective ([`PreparedLoss::objective`]). On a GPU both run on the host, the
//! validation before the first pass with the GPU idle.
//!
//! `cargo run --release -p flashgrpo-kernels --example objective_time -- [ROWS] [SEQUENCES]`
//! (default 4096 rows in 1 sequence; `ITERS` calls, default 20, and at least 50 of the
//! validation): GRPO (dapo, beta 0.04) with old and reference log-probabilities and 10% of rows
//! masked, on made-up statistics (the objective's cost does not depend on their values). Prints
//! the median and the fastest call of each.

use std::time::Instant;

use flashgrpo_kernels::synthetic::{Rng, SyntheticSpec};
use flashgrpo_kernels::{Loss, LossOptions, LossSpec, PartialRowStats, PolicyInputs, PreparedLoss, Rows};

fn arg(k: usize, default: usize) -> usize {
    std::env::args().nth(k).map_or(default, |s| s.parse().expect("a row or sequence count"))
}

fn main() {
    let (n, batch) = (arg(1, 4096), arg(2, 1).max(1));
    let iters: usize = std::env::var("ITERS").map_or(20, |s| s.parse().expect("ITERS: a count"));
    let seq_len = n / batch;
    let n = batch * seq_len;
    let vocab = 151936;
    let spec = SyntheticSpec { batch, seq_len, vocab, seed: 0, logit_std: 2.0, logp_noise: 0.3, mask_fraction: 0.1 };
    let mut rng = Rng::new(0);
    let rows = spec.rows(&mut rng);
    let logp: Vec<f64> = (0..n).map(|_| -5.0 + rng.normal()).collect();
    let (old_logp, ref_logp) = spec.near(&logp, &mut rng);
    let options = LossOptions { beta: 0.04, epsilon_high: Some(0.28), ..LossOptions::default() };
    let policy =
        PolicyInputs { old_logp: Some(&old_logp), ref_logp: Some(&ref_logp), ..PolicyInputs::new(&rows.advantages) };
    let loss = LossSpec {
        loss: Loss::Grpo(policy),
        rows: Rows { batch, seq_len, vocab, targets: Some(&rows.targets), mask: Some(&rows.mask) },
        options: &options,
        batch_shard: None,
    };
    let stats: Vec<PartialRowStats> = (0..n)
        .map(|i| PartialRowStats {
            max: 8.0,
            sum_exp: 1000.0 + (i % 97) as f32,
            sum_exp_shifted: 50.0,
            sum_u: 0.0,
            target_u: Some(-1.0f64),
            argmax: None,
        })
        .collect();
    let prepare = median_and_fastest(iters.max(50), || PreparedLoss::new(loss).expect("valid synthetic inputs"));
    let prepared = PreparedLoss::new(loss).expect("valid synthetic inputs");
    let objective = median_and_fastest(iters, || prepared.objective(&stats).expect("statistics for every row"));
    println!(
        "{n} rows ({batch} x {seq_len}): validation median {:.3} ms, fastest {:.3} ms; objective median {:.3} ms, fastest {:.3} ms",
        prepare.0, prepare.1, objective.0, objective.1
    );
}

/// The median and the fastest of `calls` timed calls of `f` (its result dropped after the clock).
fn median_and_fastest<R>(calls: usize, f: impl Fn() -> R) -> (f64, f64) {
    let mut times: Vec<f64> = (0..calls.max(1))
        .map(|_| {
            let start = Instant::now();
            let result = f();
            let ms = start.elapsed().as_secs_f64() * 1e3;
            drop(result);
            ms
        })
        .collect();
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], times[0])
}

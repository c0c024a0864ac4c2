//! The ceiling of AVX512-BF16's `vdpbf16ps` on this machine: the rate no bf16 product can pass
//! (issue 17, items 2 and 3; docs/BENCHMARKS.md, "The instruction's ceiling"). A standalone
//! program, outside the workspace so that CI never builds it:
//!
//! ```sh
//! rustc --edition 2021 -O -C target-cpu=native bench/tools/dpbf16_ceiling.rs -o /tmp/dpbf16_ceiling
//! /tmp/dpbf16_ceiling
//! ```
//!
//! Each thread issues `vdpbf16ps` (16 lanes x 2 bf16 products = 64 flops) on `CHAINS`
//! independent accumulators, enough to cover the instruction's latency, so the figure is its issue
//! rate: one thread alone, then one thread on each core at once (what a two-thread product gets).
//! Run it on an otherwise idle machine.

use std::arch::x86_64::*;
use std::hint::black_box;
use std::time::Instant;

const CHAINS: usize = 16;
const ROUNDS: usize = 40_000_000;

/// GFLOP/s of one thread issuing `vdpbf16ps` on `CHAINS` independent accumulators.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn rate() -> f64 {
    let mut acc = [_mm512_setzero_ps(); CHAINS];
    // bf16 pairs (1.0, 1.0); black_box keeps them out of the compiler's reach.
    let ones: __m512bh = std::mem::transmute(black_box(_mm512_set1_epi32(0x3f80_3f80)));
    let start = Instant::now();
    for _ in 0..ROUNDS {
        for a in acc.iter_mut() {
            *a = _mm512_dpbf16_ps(*a, ones, ones);
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    black_box(acc);
    (ROUNDS * CHAINS * 64) as f64 / seconds / 1e9
}

fn main() {
    assert!(is_x86_feature_detected!("avx512bf16"), "this CPU has no AVX512-BF16");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for _ in 0..3 {
        // SAFETY: the feature is present (asserted above).
        let alone = unsafe { rate() };
        let threads: Vec<_> = (0..cores).map(|_| std::thread::spawn(|| unsafe { rate() })).collect();
        let each: Vec<f64> = threads.into_iter().map(|t| t.join().expect("thread")).collect();
        let total: f64 = each.iter().sum();
        let each: Vec<String> = each.iter().map(|r| format!("{r:.0}")).collect();
        println!("vdpbf16ps: one thread {alone:.0} GFLOP/s; {cores} threads at once {total:.0} ({})", each.join(" + "));
    }
}

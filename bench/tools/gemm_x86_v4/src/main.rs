//! `gemm_x86_v4 M N K THREADS REPEATS`: the median time and rate of `y[M, N] = x[M, K] @ w[N, K]^T`
//! in f32 (the fused-linear loss's logits product, row-major), through `gemm` as `matmul_nt` calls
//! it. Built with and without `--features v4` (Cargo.toml says how).
use gemm::{gemm, Parallelism};

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|s| s.parse().expect("usage: gemm_x86_v4 M N K THREADS REPEATS"))
        .collect();
    let [m, n, k, threads, repeats] = args[..] else { panic!("usage: gemm_x86_v4 M N K THREADS REPEATS") };
    let x: Vec<f32> = (0..m * k).map(|i| (i * 7919 % 1000) as f32 * 1e-3).collect();
    let w: Vec<f32> = (0..n * k).map(|i| (i * 104_729 % 1000) as f32 * 1e-3).collect();
    let mut y = vec![0f32; m * n];
    let parallelism = if threads > 1 { Parallelism::Rayon(threads) } else { Parallelism::None };
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let start = std::time::Instant::now();
        // SAFETY: x is m x k, w is n x k and y is m x n, all row-major and fully allocated.
        unsafe {
            gemm(
                m, n, k, y.as_mut_ptr(), 1, n as isize, false, x.as_ptr(), 1, k as isize, w.as_ptr(),
                k as isize, 1, 0.0, 1.0, false, false, false, parallelism,
            );
        }
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let rate = 2.0 * (m * n * k) as f64 / median / 1e9;
    println!("m={m} n={n} k={k} threads={threads}: median {median:.4} s, {rate:.0} GFLOP/s (y[0] = {})", y[0]);
}

//! The forward product `y = x @ w^T` at a layer's shapes, `gemm` (as at the generic level) beside
//! the weight-rows kernel (AVX2 level), alternated, median of the repeats, in GFLOP/s:
//! `cargo run --release -p flashgrpo-kernels --example forward_product_rates [repeats [rows out in]]`.
//! Needs an AVX2 CPU. Shapes: Qwen2.5-0.5B's (hidden 896, intermediate 4864, 128 key rows, the
//! 151,936-entry lm_head) at a decode step's 1, 8 and 32 rows and an update's 1024.

use flashgrpo_kernels::matmul::{matmul_nt, Mat, MatMut};
use flashgrpo_kernels::synthetic::normal_matrix;
use flashgrpo_kernels::{with_isa, Isa};

fn seconds(isa: Isa, y: &mut [f32], x: &[f32], w: &[f32], (m, n, k): (usize, usize, usize)) -> f64 {
    let start = std::time::Instant::now();
    with_isa(isa, || matmul_nt(&mut MatMut::new(y, m, n), false, Mat::new(x, m, k), Mat::new(w, n, k)));
    start.elapsed().as_secs_f64()
}

fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn main() {
    if !Isa::available().contains(&Isa::Avx2) {
        eprintln!("forward_product_rates: the weight-rows kernel needs AVX2 and FMA, which this CPU lacks");
        std::process::exit(2);
    }
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap_or_else(|_| panic!("`{a}` is not a count: usage [repeats [rows out in]]")))
        .collect();
    let repeats = args.first().copied().unwrap_or(7);
    // `repeats rows out in`: one shape.
    let shapes: Vec<(usize, usize, usize)> = match args[..] {
        [_, m, n, k] => vec![(m, n, k)],
        _ => [1, 8, 32, 1024]
            .into_iter()
            .flat_map(|m| [(128, 896), (896, 896), (4864, 896), (896, 4864), (151_936, 896)].map(|(n, k)| (m, n, k)))
            .filter(|&(m, n, _)| m < 1024 || n < 151_936)
            .collect(),
    };
    println!("{:>5} {:>7} {:>5} {:>12} {:>12} {:>7}", "rows", "out", "in", "gemm GF/s", "w-rows GF/s", "ratio");
    for (m, n, k) in shapes {
        let (x, w) = (normal_matrix(m, k, 1.0, 1), normal_matrix(n, k, 0.05, 2));
        let mut y = vec![0.0f32; m * n];
        let (mut gemm, mut rows) = (Vec::new(), Vec::new());
        for _ in 0..repeats {
            gemm.push(seconds(Isa::Generic, &mut y, &x, &w, (m, n, k)));
            rows.push(seconds(Isa::Avx2, &mut y, &x, &w, (m, n, k)));
        }
        let flops = 2.0 * (m * n * k) as f64 / 1e9;
        let (g, r) = (flops / median(gemm), flops / median(rows));
        println!("{m:>5} {n:>7} {k:>5} {g:>12.1} {r:>12.1} {:>7.2}", r / g);
    }
}

//! The three products of a training update at Qwen2.5-0.5B's shapes, in GFLOP/s (median of the
//! repeats, the arms alternated): the forward `y = x @ w^T` through `gemm` and through the
//! weight-rows kernel (AVX2 machines), the input gradient `dx = dy @ w` and the weight gradient
//! `dw += dy^T @ x` (both `gemm`). What the trainer's update runs at, beside what a tuned BLAS
//! reaches on the same shapes (bench/peers/product_rates.py):
//! `cargo run --release -p flashgrpo-kernels --example update_product_rates [repeats [rows out in]]`.
//!
//! Shapes: a micro-batch of `rows` (default 1024) through a layer (`out x in`: the 896-wide
//! projections, the 128 key / value rows, the MLP's 4864) and a fused-linear loss chunk of 256 rows
//! through the 151,936-entry lm_head.

use flashgrpo_kernels::matmul::{matmul_nn, matmul_nt, matmul_tn, Mat, MatMut};
use flashgrpo_kernels::synthetic::normal_matrix;
use flashgrpo_kernels::{with_isa, Isa};

/// One product's arm: which kernel, on which operands.
#[derive(Clone, Copy)]
enum Arm {
    ForwardGemm,
    ForwardWeightRows,
    InputGradient,
    WeightGradient,
}

struct Operands {
    x: Vec<f32>,
    w: Vec<f32>,
    dy: Vec<f32>,
    y: Vec<f32>,
    dx: Vec<f32>,
    dw: Vec<f32>,
}

fn seconds(arm: Arm, o: &mut Operands, (m, n, k): (usize, usize, usize)) -> f64 {
    let start = std::time::Instant::now();
    let (x, w, dy) = (Mat::new(&o.x, m, k), Mat::new(&o.w, n, k), Mat::new(&o.dy, m, n));
    match arm {
        Arm::ForwardGemm => with_isa(Isa::Generic, || matmul_nt(&mut MatMut::new(&mut o.y, m, n), false, x, w)),
        Arm::ForwardWeightRows => with_isa(Isa::Avx2, || matmul_nt(&mut MatMut::new(&mut o.y, m, n), false, x, w)),
        Arm::InputGradient => matmul_nn(&mut MatMut::new(&mut o.dx, m, k), false, dy, w),
        Arm::WeightGradient => matmul_tn(&mut MatMut::new(&mut o.dw, n, k), true, dy, x),
    }
    start.elapsed().as_secs_f64()
}

fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap_or_else(|_| panic!("`{a}` is not a count: usage [repeats [rows out in]]")))
        .collect();
    let repeats = args.first().copied().unwrap_or(5);
    let shapes: Vec<(usize, usize, usize)> = match args[..] {
        [_, m, n, k] => vec![(m, n, k)],
        [_, m] => layer_shapes(m),
        _ => layer_shapes(1024),
    };
    let rows_kernel = Isa::available().contains(&Isa::Avx2);
    let mut arms = vec![Arm::ForwardGemm, Arm::InputGradient, Arm::WeightGradient];
    if rows_kernel {
        arms.insert(1, Arm::ForwardWeightRows);
    }
    println!(
        "{:>5} {:>7} {:>5} {:>10} {:>10} {:>10} {:>10}   GFLOP/s",
        "rows", "out", "in", "fwd gemm", "fwd w-rows", "dx (nn)", "dw (tn)"
    );
    for (m, n, k) in shapes {
        let mut o = Operands {
            x: normal_matrix(m, k, 1.0, 1),
            w: normal_matrix(n, k, 0.05, 2),
            dy: normal_matrix(m, n, 0.01, 3),
            y: vec![0.0; m * n],
            dx: vec![0.0; m * k],
            dw: vec![0.0; n * k],
        };
        let mut times = vec![Vec::new(); arms.len()];
        for _ in 0..repeats {
            for (t, &arm) in times.iter_mut().zip(&arms) {
                t.push(seconds(arm, &mut o, (m, n, k)));
            }
        }
        let flops = 2.0 * (m * n * k) as f64 / 1e9;
        let mut rates: Vec<String> = times.into_iter().map(|t| format!("{:>10.1}", flops / median(t))).collect();
        if !rows_kernel {
            rates.insert(1, format!("{:>10}", "-"));
        }
        println!("{m:>5} {n:>7} {k:>5} {}", rates.join(" "));
    }
}

/// A layer's products at `rows` rows, and a loss chunk of 256 rows through the lm_head.
fn layer_shapes(rows: usize) -> Vec<(usize, usize, usize)> {
    let mut shapes: Vec<_> = [(128, 896), (896, 896), (4864, 896), (896, 4864)].map(|(n, k)| (rows, n, k)).into();
    shapes.push((256, 151_936, 896));
    shapes
}

//! Times the three bf16 products of one fused-linear chunk over the whole vocabulary, on the way
//! `FLASHGRPO_BF16_PRODUCTS` picks (AMX by default where the CPU has it): the logits, `d hidden`
//! alone, and `d hidden` with `d weight` (issue 17).
//!
//! `cargo run --release -p flashgrpo-kernels --example bf16_products -- [ROWS] [HIDDEN] [VOCAB] [REPEATS] [TILE]`
//! (defaults: 256 rows, Qwen2.5-0.5B's 896 x 151936, 5 repeats, tiles of 1024 vocabulary rows);
//! prints the median of the repeats.

#[path = "common/chunk_inputs.rs"]
mod chunk_inputs;

use chunk_inputs::{arg, hidden_and_weight, packed_products};
use flashgrpo_kernels::matmul::{Mat, MatMut};
use flashgrpo_kernels::matmul_bf16::{self, PackedHidden};
use std::time::Instant;

fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() {
    let (n, h, v, repeats, tile) = (arg(1, 256), arg(2, 896), arg(3, 151936), arg(4, 5).max(1), arg(5, 1024));
    let Some(products) = packed_products() else { return };
    let (hc, weight) = hidden_and_weight(n, h, v);
    // Touched before timing: first writes would count page faults.
    let (mut z, mut dh, mut dw) = (vec![1.0f32; n * v], vec![1.0f32; n * h], vec![1.0f32; v * h]);
    let mut partials = vec![];
    let mut packed = PackedHidden::default();
    packed.pack(&hc, n, h, products);
    let (mut logits, mut gradients, mut dh_alone) = (vec![], vec![], vec![]);
    for _ in 0..repeats {
        let start = Instant::now();
        matmul_bf16::logits(&mut MatMut::new(&mut z, n, v), false, &packed, &weight, tile);
        logits.push(start.elapsed().as_secs_f64());
        let start = Instant::now();
        let dz = Mat::new(&z, n, v);
        matmul_bf16::gradients(
            &mut MatMut::new(&mut dh, n, h),
            Some(&mut dw),
            true,
            dz,
            &weight,
            &packed,
            tile,
            &mut partials,
        );
        gradients.push(start.elapsed().as_secs_f64());
        let start = Instant::now();
        matmul_bf16::gradients(&mut MatMut::new(&mut dh, n, h), None, true, dz, &weight, &packed, tile, &mut partials);
        dh_alone.push(start.elapsed().as_secs_f64());
    }
    let (logits, gradients, dh_alone) = (median(logits), median(gradients), median(dh_alone));
    let gflop = 2.0 * (n * h * v) as f64 / 1e9;
    // The split gradient (the default) multiplies twice the terms of the rounded one.
    let executed = if products.rounded() { 1.0 } else { 2.0 };
    println!("{products:?}, {n} rows, H = {h}, V = {v}, tiles of {tile}:");
    println!("  logits            {logits:.4} s  {:.0} GFLOP/s", gflop / logits);
    println!("  d hidden          {dh_alone:.4} s  {:.0} GFLOP/s executed", executed * gflop / dh_alone);
    println!(
        "  d weight          {:.4} s  {:.0} GFLOP/s executed",
        gradients - dh_alone,
        executed * gflop / (gradients - dh_alone)
    );
}

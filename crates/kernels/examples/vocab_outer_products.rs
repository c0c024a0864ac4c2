//! Times the bf16 products of a fused-linear step in the vocabulary-outer order (Cut
//! Cross-Entropy's), to decide on a machine whether a streamer in that order would beat today's
//! row chunks (issue 17): per vocabulary tile, every row block's logits (the statistics pass),
//! then every row block's logits again with `d hidden` and the tile's `d weight`, which is written
//! once instead of read and rewritten by every row chunk. Today's order reads the weight twice
//! and `d weight` (f32) once each way per chunk of rows and writes and reads the chunk's f32
//! logits; this order keeps a tile's logits in the caches and pays a second logits product.
//!
//! Timing only: the row sweep between the products is left out (its time is the same in both
//! orders), the logits stand in for their gradient, and each `d hidden` block is overwritten
//! rather than summed over the tiles. Compare the time printed with the step of
//! `flashgrpo bench --config configs/bench-linear-grpo-n1024-f32.yaml --set dtype=bf16` on the
//! same way (`FLASHGRPO_BF16_PRODUCTS`), alternating the two.
//!
//! `cargo run --release -p flashgrpo-kernels --example vocab_outer_products -- [ROWS] [HIDDEN] [VOCAB] [REPEATS] [TILE] [ROW_BLOCK]`
//! (defaults: 1024 rows, Qwen2.5-0.5B's 896 x 151936, 3 repeats, vocabulary tiles of 256, row
//! blocks of 1024); the tiles are spread over the threads.

#[path = "common/chunk_inputs.rs"]
mod chunk_inputs;

use chunk_inputs::{arg, hidden_and_weight, packed_products};
use flashgrpo_kernels::matmul::{Mat, MatMut};
use flashgrpo_kernels::matmul_bf16::{self, PackedHidden};
use rayon::prelude::*;
use std::time::Instant;

fn main() {
    let (n, h, v) = (arg(1, 1024), arg(2, 896), arg(3, 151936));
    let (repeats, tile, row_block) = (arg(4, 3).max(1), arg(5, 256).max(1), arg(6, 1024).max(1));
    let Some(products) = packed_products() else { return };
    let (hc, weight) = hidden_and_weight(n, h, v);
    let blocks: Vec<(usize, PackedHidden)> = (0..n)
        .step_by(row_block)
        .map(|start| {
            let rows = row_block.min(n - start);
            let mut packed = PackedHidden::default();
            packed.pack(&hc[start * h..(start + rows) * h], rows, h, products);
            (rows, packed)
        })
        .collect();
    // Touched before timing: first writes would count page faults.
    let mut dw = vec![1.0f32; v * h];
    let counted = 2.0 * (n * h * v) as f64 / 1e9;
    // Two logits products, and the gradient products (twice the terms where `dz` is split).
    let executed = counted * (2.0 + if products.rounded() { 2.0 } else { 4.0 });
    println!("{products:?}, {n} rows, H = {h}, V = {v}, vocabulary tiles of {tile}, row blocks of {row_block}:");
    for _ in 0..repeats {
        let start = Instant::now();
        // Each tile's rows of `d weight` are its own; the scratch is made per rayon job, not per tile.
        let scratch = || (vec![0.0f32; row_block * tile], vec![0.0f32; row_block * h], vec![]);
        dw.par_chunks_mut(tile * h).enumerate().for_each_init(scratch, |(z, dh, partials), (t, dw_tile)| {
            let cols = dw_tile.len() / h;
            let w = &weight[t * tile * h..(t * tile + cols) * h];
            for (rows, packed) in &blocks {
                matmul_bf16::logits(&mut MatMut::new(&mut z[..rows * cols], *rows, cols), false, packed, w, tile);
            }
            for (b, (rows, packed)) in blocks.iter().enumerate() {
                let z = &mut z[..rows * cols];
                matmul_bf16::logits(&mut MatMut::new(z, *rows, cols), false, packed, w, tile);
                let dh = &mut MatMut::new(&mut dh[..rows * h], *rows, h);
                let dz = Mat::new(z, *rows, cols);
                matmul_bf16::gradients(dh, Some(&mut *dw_tile), b > 0, dz, w, packed, tile, partials);
            }
        });
        let seconds = start.elapsed().as_secs_f64();
        println!("  {seconds:.3} s, {executed:.0} GFLOP executed at {:.0} GFLOP/s", executed / seconds);
    }
}

//! The layer operations of the engine on row-major f32 buffers, forward and backward: linear
//! layers (through `gemm`), RMSNorm, rotary embedding, the SiLU-gated MLP's activation, the
//! embedding lookup. Each writes into a buffer the caller owns (no allocation per call beyond a
//! few partial sums), and every reduction that crosses rows (weight and bias gradients) runs in
//! one fixed order, so the results are the same bits for any thread count.
//!
//! The formulas are Hugging Face's Qwen2 in f32; `flashgrpo_candle::ops` holds the candle versions
//! that the engine is tested against (crates/train/tests/engine.rs).

use flashgrpo_candle::ops::RopeTable;
use flashgrpo_kernels::matmul::{matmul_nn, matmul_nt, matmul_tn, Mat, MatMut};
use flashgrpo_kernels::matmul_bf16::{self, Bf16Products};
use rayon::prelude::*;

use super::math::{avx2_or_baseline, fast_exp};

/// Rows per partial sum of the column sums (a fixed partition: the same sums for any thread count).
const ROWS_PER_TASK: usize = 32;

/// Elements per parallel task of the elementwise operations: a decode step's small batch runs as
/// one task instead of paying for many tiny ones.
const ELEMENTS_PER_TASK: usize = 1 << 14;

/// Rows of `width` per parallel task.
fn rows_per_task(width: usize) -> usize {
    ELEMENTS_PER_TASK.div_ceil(width.max(1))
}

/// A linear layer's weight `[out, in]`: f32, or bf16 bits for the machine's bf16 products
/// ([`matmul_bf16::layer`]: the activations rounded to bf16 as a bf16 model holds them, f32
/// accumulation).
#[derive(Clone, Copy)]
pub enum Weight<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16], Bf16Products),
}

impl Weight<'_> {
    fn len(&self) -> usize {
        match self {
            Weight::F32(w) => w.len(),
            Weight::Bf16(w, _) => w.len(),
        }
    }
}

/// `y[n, out] = x[n, in] @ w[out, in]^T (+ bias)`: an `nn.Linear`.
pub fn linear(y: &mut [f32], x: &[f32], w: Weight<'_>, bias: Option<&[f32]>, inputs: usize) {
    let outputs = w.len() / inputs;
    let n = x.len() / inputs;
    debug_assert_eq!(y.len(), n * outputs);
    if let Some(b) = bias {
        y.par_chunks_mut(outputs).for_each(|row| row.copy_from_slice(b));
    }
    product_nt(&mut MatMut::new(y, n, outputs), bias.is_some(), Mat::new(x, n, inputs), w);
}

/// `y += x @ w^T`: a linear layer added onto a residual stream.
pub fn linear_add(y: &mut [f32], x: &[f32], w: Weight<'_>, inputs: usize) {
    let outputs = w.len() / inputs;
    let n = x.len() / inputs;
    product_nt(&mut MatMut::new(y, n, outputs), true, Mat::new(x, n, inputs), w);
}

fn product_nt(y: &mut MatMut<'_>, accumulate: bool, x: Mat<'_>, w: Weight<'_>) {
    match w {
        Weight::F32(w) => matmul_nt(y, accumulate, x, Mat::new(w, y.cols, x.cols)),
        Weight::Bf16(w, products) => matmul_bf16::layer::forward(y, accumulate, x, w, products),
    }
}

/// The gradients of [`linear`] from `dy [n, out]`: `dx (+)= dy @ w` (added when `add_dx`) and
/// `dw += dy^T @ x` (a bias's gradient is [`add_column_sums`] of `dy`).
pub fn linear_backward(
    dy: &[f32],
    x: &[f32],
    w: Weight<'_>,
    dx: &mut [f32],
    add_dx: bool,
    dw: &mut [f32],
    inputs: usize,
) {
    let outputs = w.len() / inputs;
    let n = x.len() / inputs;
    let (dy, x, mut dx_) = (Mat::new(dy, n, outputs), Mat::new(x, n, inputs), MatMut::new(dx, n, inputs));
    match w {
        Weight::F32(w) => {
            let w = Mat::new(w, outputs, inputs);
            matmul_nn(&mut dx_, add_dx, dy, w);
            matmul_tn(&mut MatMut::new(dw, outputs, inputs), true, dy, x);
        }
        Weight::Bf16(w, products) => matmul_bf16::layer::backward(&mut dx_, add_dx, dw, dy, x, w, products),
    }
}

/// `out[j] += sum_i m[i, j]` for `m` with `out.len()` columns: partial sums over fixed blocks of
/// rows (in parallel), then the blocks in order.
pub fn add_column_sums(out: &mut [f32], m: &[f32]) {
    let cols = out.len();
    let partials: Vec<Vec<f32>> = m
        .par_chunks(cols * ROWS_PER_TASK)
        .map(|block| {
            let mut sum = vec![0.0f32; cols];
            for row in block.chunks_exact(cols) {
                sum.iter_mut().zip(row).for_each(|(s, &x)| *s += x);
            }
            sum
        })
        .collect();
    for p in &partials {
        out.iter_mut().zip(p).for_each(|(o, &x)| *o += x);
    }
}

/// `1 / sqrt(mean(x^2) + eps)` of one row (the mean accumulated in f64).
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let mean = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len() as f64;
    1.0 / (mean as f32 + eps).sqrt()
}

/// `y = w * x / sqrt(mean(x^2) + eps)` per row of `x [n, H]`; keeps each row's `1 / rms` in `rstd`.
pub fn rms_norm(y: &mut [f32], rstd: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    let h = w.len();
    let rows = rows_per_task(h);
    y.par_chunks_mut(h * rows).zip(rstd.par_chunks_mut(rows)).zip(x.par_chunks(h * rows)).for_each(|((y, r), x)| {
        for ((y, r), x) in y.chunks_exact_mut(h).zip(r).zip(x.chunks_exact(h)) {
            *r = inv_rms(x, eps);
            for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
                *y = w * (x * *r);
            }
        }
    });
}

/// The gradients of [`rms_norm`] from `dy`: `dx += r (dy w) - x r^3 / H sum(dy w x)` and
/// `dw += sum_rows dy x r`.
pub fn rms_norm_backward(dx: &mut [f32], dw: &mut [f32], dy: &[f32], x: &[f32], rstd: &[f32], w: &[f32]) {
    let h = w.len();
    let rows = rows_per_task(h);
    dx.par_chunks_mut(h * rows)
        .zip(dy.par_chunks(h * rows))
        .zip(x.par_chunks(h * rows))
        .zip(rstd.par_chunks(rows))
        .for_each(|(((dx, dy), x), rstd)| {
            for (((dx, dy), x), &r) in dx.chunks_exact_mut(h).zip(dy.chunks_exact(h)).zip(x.chunks_exact(h)).zip(rstd) {
                let dot: f64 = dy.iter().zip(x).zip(w).map(|((&g, &x), &w)| (g * w * x) as f64).sum();
                let k = r * r * r * (dot / h as f64) as f32;
                for (((dx, &g), &x), &w) in dx.iter_mut().zip(dy).zip(x).zip(w) {
                    *dx += r * g * w - x * k;
                }
            }
        });
    let partials: Vec<Vec<f32>> = dy
        .par_chunks(h * ROWS_PER_TASK)
        .zip(x.par_chunks(h * ROWS_PER_TASK))
        .zip(rstd.par_chunks(ROWS_PER_TASK))
        .map(|((dy, x), rstd)| {
            let mut sum = vec![0.0f32; h];
            for ((dy, x), &r) in dy.chunks_exact(h).zip(x.chunks_exact(h)).zip(rstd) {
                sum.iter_mut().zip(dy).zip(x).for_each(|((s, &g), &x)| *s += g * x * r);
            }
            sum
        })
        .collect();
    for p in &partials {
        dw.iter_mut().zip(p).for_each(|(o, &x)| *o += x);
    }
}

/// Rotates each head of each row of `x [n, heads * head_dim]` in place by its position's angles
/// (`rotate_half`: `[a, b] -> [a cos - b sin, b cos + a sin]`); `inverse` rotates back (the
/// backward).
pub fn rope(x: &mut [f32], positions: &[u32], head_dim: usize, table: &RopeTable, inverse: bool) {
    let width = x.len() / positions.len().max(1);
    let (half, rows) = (head_dim / 2, rows_per_task(width));
    x.par_chunks_mut(width * rows).zip(positions.par_chunks(rows)).for_each(|(x, positions)| {
        for (row, &p) in x.chunks_exact_mut(width).zip(positions) {
            let (cos, sin) = table.cos_sin(p as usize);
            for head in row.chunks_exact_mut(head_dim) {
                let (a, b) = head.split_at_mut(half);
                for (((a, b), &c), &s) in a.iter_mut().zip(b.iter_mut()).zip(cos).zip(sin) {
                    let s = if inverse { -s } else { s };
                    let (x0, x1) = (*a, *b);
                    *a = x0 * c - x1 * s;
                    *b = x1 * c + x0 * s;
                }
            }
        }
    });
}

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + fast_exp(-x))
}

/// `act = silu(gate) * up`, `silu(g) = g sigmoid(g)`.
pub fn silu_gate(act: &mut [f32], gate: &[f32], up: &[f32]) {
    const CHUNK: usize = ELEMENTS_PER_TASK;
    act.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK))
        .zip(up.par_chunks(CHUNK))
        .for_each(|((a, g), u)| silu_chunk(a, g, u));
}

avx2_or_baseline!(fn silu_chunk(act: &mut [f32], gate: &[f32], up: &[f32]) => silu_body);

#[inline(always)]
fn silu_body(act: &mut [f32], gate: &[f32], up: &[f32]) {
    for ((a, &g), &u) in act.iter_mut().zip(gate).zip(up) {
        *a = g * sigmoid(g) * u;
    }
}

/// The gradients of [`silu_gate`]: `d_up = d_act silu(g)`,
/// `d_gate = d_act u sigmoid(g) (1 + g (1 - sigmoid(g)))`.
pub fn silu_gate_backward(d_gate: &mut [f32], d_up: &mut [f32], d_act: &[f32], gate: &[f32], up: &[f32]) {
    const CHUNK: usize = ELEMENTS_PER_TASK;
    d_gate
        .par_chunks_mut(CHUNK)
        .zip(d_up.par_chunks_mut(CHUNK))
        .zip(d_act.par_chunks(CHUNK))
        .zip(gate.par_chunks(CHUNK))
        .zip(up.par_chunks(CHUNK))
        .for_each(|((((dg, du), da), g), u)| silu_backward_chunk(dg, du, da, g, u));
}

avx2_or_baseline!(
    fn silu_backward_chunk(d_gate: &mut [f32], d_up: &mut [f32], d_act: &[f32], gate: &[f32], up: &[f32]) => silu_backward_body
);

#[inline(always)]
fn silu_backward_body(d_gate: &mut [f32], d_up: &mut [f32], d_act: &[f32], gate: &[f32], up: &[f32]) {
    for ((((dg, du), &da), &g), &u) in d_gate.iter_mut().zip(d_up.iter_mut()).zip(d_act).zip(gate).zip(up) {
        let s = sigmoid(g);
        *du = da * g * s;
        *dg = da * u * s * (1.0 + g * (1.0 - s));
    }
}

/// `x[i] = table[tokens[i]]`, rows of `h`.
pub fn embed(x: &mut [f32], tokens: &[u32], table: Weight<'_>, h: usize) {
    for (row, &t) in x.chunks_exact_mut(h).zip(tokens) {
        let at = t as usize * h..(t as usize + 1) * h;
        match table {
            Weight::F32(table) => row.copy_from_slice(&table[at]),
            Weight::Bf16(table, _) => {
                row.iter_mut().zip(&table[at]).for_each(|(x, &b)| *x = f32::from_bits((b as u32) << 16))
            }
        }
    }
}

/// `d_table[tokens[i]] += dx[i]`, tokens in order (a token seen twice adds in the same order every
/// time).
pub fn embed_backward(d_table: &mut [f32], tokens: &[u32], dx: &[f32], h: usize) {
    for (&t, row) in tokens.iter().zip(dx.chunks_exact(h)) {
        d_table[t as usize * h..(t as usize + 1) * h].iter_mut().zip(row).for_each(|(d, &g)| *d += g);
    }
}

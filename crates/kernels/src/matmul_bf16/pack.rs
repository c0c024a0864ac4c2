//! Packing the operands of the AMX kernel ([`super::amx`]) from the layouts the fused-linear loss
//! holds them in. Every packed dimension is zero-padded to a multiple of 32, so the kernel never
//! sees a ragged edge; the padding's products are zeros the output writer skips.
//!
//! - A, row-major `[rows, k]` bf16: a weight tile as it is ([`a_from_rows`]), or the hidden
//!   states transposed, each element twice ([`a_from_transposed_duplicated`]).
//! - B, panels of 16 columns, each `k/2` rows of 16 pairs `(B[2k', j], B[2k'+1, j])`: the hidden
//!   states transposed ([`b_from_transposed`]) or a weight tile with its rows twice
//!   ([`b_from_rows_duplicated`]).
//! - The logits' gradient `dz` (f32), a tile at a time: [`a_from_f32_split`] turns each element
//!   into two bf16 numbers side by side, `x = hi + lo` with `hi = bf16(x)`, `lo = bf16(x - hi)`.
//!   The packed tile is an A of twice the columns (against a B with duplicated rows) and, read as
//!   VNNI, a B (against an A with duplicated columns): one product
//!   computes `x * b` to 16 bits of `x` instead of 8, so the gradient products keep f32's accuracy
//!   (LOSSES.md's 1e-4 for fused-linear gradients) at twice the flops of rounding `dz` to bf16.

use rayon::prelude::*;

use crate::element::Element;

/// `x` rounded up to a multiple of 32.
pub fn padded(x: usize) -> usize {
    x.div_ceil(32) * 32
}

/// A packed A operand: `rows x k` bf16 values, row-major, both multiples of 32, stored as the
/// `k / 2` pairs of each row (the unit AMX reads; `u32` stores vectorise).
#[derive(Default)]
pub struct PackedA {
    pub data: Vec<u32>,
    pub rows: usize,
    pub k: usize,
}

/// A packed B operand: `cols / 16` panels of `k / 2` rows of 16 pairs; `k` and `cols`
/// multiples of 32.
#[derive(Default)]
pub struct PackedB {
    pub data: Vec<u32>,
    pub k: usize,
    pub cols: usize,
}

impl PackedA {
    fn reset(&mut self, rows: usize, k: usize) {
        (self.rows, self.k) = (padded(rows), padded(k));
        self.data.clear();
        self.data.resize(self.rows * self.k / 2, 0);
    }
}

impl PackedB {
    fn reset(&mut self, k: usize, cols: usize) {
        (self.k, self.cols) = (padded(k), padded(cols));
        self.data.clear();
        self.data.resize(self.k * self.cols / 2, 0);
    }
}

/// Two bf16 values as the pair AMX reads: `first` in the low half.
#[inline(always)]
fn pair(first: u16, second: u16) -> u32 {
    first as u32 | (second as u32) << 16
}

/// `x` as the pair `(hi, lo)` of bf16 values, `hi + lo` within 2^-16 of `x` relative.
#[inline(always)]
fn split(x: f32) -> u32 {
    let hi = <half::bf16 as Element>::from_f32(x);
    let lo = <half::bf16 as Element>::from_f32(x - hi.to_f32());
    pair(hi.to_bits(), lo.to_bits())
}

/// A = `src[r * stride + c]` for `r < rows`, `c < cols` (bf16 bits).
pub fn a_from_rows(src: &[u16], stride: usize, rows: usize, cols: usize, out: &mut PackedA) {
    out.reset(rows, cols);
    let half_k = out.k / 2;
    out.data.par_chunks_mut(half_k).take(rows).enumerate().for_each(|(r, dst)| {
        let row = &src[r * stride..r * stride + cols];
        for (d, p) in dst.iter_mut().zip(row.chunks(2)) {
            *d = pair(p[0], p.get(1).copied().unwrap_or(0));
        }
    });
}

/// A = the f32 matrix `src` (`rows x cols`, row stride `stride`) with each element split into its
/// `(hi, lo)` bf16 pair: `2 * padded(cols)` columns, so that the same buffer is also a VNNI B of
/// `padded(cols)` columns whose row pairs are `(hi, lo)` (rows `2 * out.k` bytes apart).
pub fn a_from_f32_split(src: &[f32], stride: usize, rows: usize, cols: usize, out: &mut PackedA) {
    out.reset(rows, 2 * padded(cols));
    let half_k = out.k / 2;
    out.data.par_chunks_mut(half_k).take(rows).enumerate().for_each(|(r, dst)| {
        for (d, &x) in dst.iter_mut().zip(&src[r * stride..r * stride + cols]) {
            *d = split(x);
        }
    });
}

/// A = the transpose of `src` (`rows x cols` bf16 bits, row-major) with every element twice
/// along k: `A[j, 2r] = A[j, 2r + 1] = src[r, j]`, the partner of a split B.
pub fn a_from_transposed_duplicated(src: &[u16], rows: usize, cols: usize, out: &mut PackedA) {
    out.reset(cols, 2 * rows);
    let half_k = out.k / 2;
    out.data.par_chunks_mut(16 * half_k).enumerate().for_each(|(block, dst)| {
        let c0 = 16 * block;
        let width = cols.saturating_sub(c0).min(16);
        if width == 0 {
            return;
        }
        for r in 0..rows {
            for (i, &x) in src[r * cols + c0..r * cols + c0 + width].iter().enumerate() {
                dst[i * half_k + r] = pair(x, x);
            }
        }
    });
}

/// B = the transpose of `src` (`cols x k` bf16 bits, row stride `stride`): `B[k, j] = src[j, k]`.
pub fn b_from_transposed(src: &[u16], stride: usize, cols: usize, k: usize, out: &mut PackedB) {
    out.reset(k, cols);
    let panel_len = out.k * 8;
    out.data.par_chunks_mut(panel_len).enumerate().for_each(|(p, panel)| {
        for i in 0..16.min(cols.saturating_sub(16 * p)) {
            let row = &src[(16 * p + i) * stride..(16 * p + i) * stride + k];
            for (kk, two) in row.chunks(2).enumerate() {
                panel[kk * 16 + i] = pair(two[0], two.get(1).copied().unwrap_or(0));
            }
        }
    });
}

/// B = `src` (`rows x cols` bf16 bits, row stride `stride`) with every row twice, the partner of
/// [`a_from_f32_split`]'s A: `B[2r, j] = B[2r + 1, j] = src[r, j]`.
pub fn b_from_rows_duplicated(src: &[u16], stride: usize, rows: usize, cols: usize, out: &mut PackedB) {
    out.reset(2 * rows, cols);
    let panel_len = out.k * 8;
    // Four panels (64 columns, 128 bytes of each source row) per task, rows in the outer loop.
    out.data.par_chunks_mut(4 * panel_len).enumerate().for_each(|(task, panels)| {
        for r in 0..rows {
            for (p, panel) in panels.chunks_exact_mut(panel_len).enumerate() {
                let c0 = 16 * (4 * task + p);
                let width = cols.saturating_sub(c0).min(16);
                if width == 0 {
                    break;
                }
                let dst = &mut panel[r * 16..r * 16 + width];
                for (d, &x) in dst.iter_mut().zip(&src[r * stride + c0..r * stride + c0 + width]) {
                    *d = pair(x, x);
                }
            }
        }
    });
}

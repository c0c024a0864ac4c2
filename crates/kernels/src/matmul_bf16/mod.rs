//! bf16 matrix products at the machine's bf16 rate: the three products of a fused-linear loss
//! (see [`crate::matmul`]) with bf16 weights and hidden states, f32 accumulation and f32 outputs.
//! [`layer`] gives the same products to a model's linear layers (the trainer's engine).
//!
//! The ways, chosen at run time ([`Bf16Products::detected`], overridable per call with
//! [`Bf16Choice`] in the [`ChunkBudget`](crate::ChunkBudget), per thread with
//! [`with_bf16_products`] and for the process with `FLASHGRPO_BF16_PRODUCTS`):
//! - [`Bf16Products::Amx`]: Intel AMX tiles ([`amx`]), 1.4-2 TFLOP/s per core on this project's
//!   machine with the operands in the caches, against ~100 GFLOP/s for f32. The logits product multiplies the bf16 inputs exactly; the two
//!   gradient products take the f32 logits' gradient split into two bf16 numbers ([`pack`]), so
//!   every product keeps f32's accuracy.
//! - [`Bf16Products::Avx512Bf16`]: the same packed products on `vdpbf16ps` ([`dpbf16`]), for CPUs
//!   with AVX512-BF16 and no AMX (AMD Zen 4 and later).
//! - their `Rounded` forms: the logits' gradient rounded to bf16 as PyTorch and Liger take it.
//! - [`Bf16Products::Widened`]: the operands widened to f32 for the `gemm` crate (every CPU).
//!
//! The products are deterministic: each output element sums its terms in one fixed order, on one
//! thread, whatever the thread count.

pub mod amx;
pub mod dpbf16;
pub mod layer;
pub mod pack;

use crate::scratch::with_scratch;
use std::ops::Range;

use rayon::prelude::*;

use crate::matmul::{Mat, MatMut};
use pack::{PackedA, PackedB};

mod blocked_product;
mod choice;

pub use blocked_product::BLOCK;
use blocked_product::{product, AOperand, BOperand, Output, MACRO};
pub use choice::{current, with_bf16_products, Bf16Choice, Bf16Products};

/// The packed forms of one chunk of bf16 hidden states, reused by every vocabulary tile.
#[derive(Default)]
pub struct PackedHidden {
    /// `hc^T`: the B of the logits product.
    transposed: PackedB,
    /// On AMX, the A of the weight-gradient product `d weight^T = hc^T @ dz`: `hc^T` with each
    /// element twice (against the split `dz`), or as it is (against `dz` rounded).
    transposed_for_gradient: PackedA,
    /// On `vdpbf16ps`, the B of the weight-gradient product `d weight = dz^T @ hc`, written in
    /// place: `hc` with each row twice (against the split `dz`), or as it is.
    rows_for_gradient: PackedB,
    /// The way of the products (whether the gradient products take `dz` rounded to bf16).
    products: Bf16Products,
    rows: usize,
    hidden_size: usize,
}

impl PackedHidden {
    /// Packs `hc` (`rows x hidden_size` bf16 bits, row-major) for the products of `products`.
    pub fn pack(&mut self, hc: &[u16], rows: usize, hidden_size: usize, products: Bf16Products) {
        self.pack_parts(hc, rows, hidden_size, products, true, true);
    }

    /// Packs `hc` for [`logits`] alone (a layer's forward product); [`gradients`] refuses it.
    pub fn pack_for_logits(&mut self, hc: &[u16], rows: usize, hidden_size: usize, products: Bf16Products) {
        self.pack_parts(hc, rows, hidden_size, products, true, false);
    }

    /// Packs `hc` for the gradient products alone (a layer's backward); [`logits`] refuses it.
    pub fn pack_for_gradients(&mut self, hc: &[u16], rows: usize, hidden_size: usize, products: Bf16Products) {
        self.pack_parts(hc, rows, hidden_size, products, false, true);
    }

    /// The operands asked for; the others emptied (their memory kept for the next packing), so
    /// that a stale one is never read.
    fn pack_parts(&mut self, hc: &[u16], rows: usize, h: usize, products: Bf16Products, logits: bool, gradients: bool) {
        if logits {
            pack::b_from_transposed(hc, h, rows, h, &mut self.transposed);
        } else {
            self.transposed.empty();
        }
        // The buffer packed keeps its memory from chunk to chunk (no allocation, no zeroing).
        let (a, b) = (&mut self.transposed_for_gradient, &mut self.rows_for_gradient);
        match (gradients, weight_gradient_in_place(products), products.rounded()) {
            (false, ..) => {
                a.empty();
                b.empty();
            }
            (true, false, rounded) => {
                b.empty();
                if rounded {
                    pack::a_from_transposed(hc, rows, h, a)
                } else {
                    pack::a_from_transposed_duplicated(hc, rows, h, a)
                }
            }
            (true, true, rounded) => {
                a.empty();
                if rounded {
                    pack::b_from_rows(hc, h, rows, h, b)
                } else {
                    pack::b_from_rows_duplicated(hc, h, rows, h, b)
                }
            }
        }
        (self.products, self.rows, self.hidden_size) = (products, rows, h);
    }

    /// Whether the operands of the gradient products are packed (not for the logits alone).
    fn packed_for_gradients(&self) -> bool {
        if weight_gradient_in_place(self.products) {
            self.rows_for_gradient.cols >= self.hidden_size
        } else {
            self.transposed_for_gradient.rows >= self.hidden_size
        }
    }
}

/// Whether `d weight` is written in place as `dz^T @ hc` (on `vdpbf16ps`, which reads A a pair
/// at a time from anywhere: `dz^T` is the packed `dz` read across) or as `(hc^T @ dz)^T` through
/// 16 x 16 transposes (AMX, whose tile loads want A's rows packed). In place saves the
/// transposes and lets the kernel load and store `d weight`'s blocks itself.
fn weight_gradient_in_place(products: Bf16Products) -> bool {
    !products.on_amx()
}

/// The per-tile operands a thread packs, kept from tile to tile (and call to call).
#[derive(Default)]
struct TileScratch {
    a: PackedA,
    b: PackedB,
    c: PackedB,
}

thread_local! {
    static TILE_SCRATCH: std::cell::RefCell<TileScratch> = std::cell::RefCell::default();
}

/// Runs `f` on every tile of `tiles`, spread over the rayon threads, each with its thread's
/// [`TileScratch`] (a fresh one where a packer's parallel loop re-enters: `crate::scratch`). One parallel region per call: a region per tile and product would cost a
/// thread wake-up each, thousands per step.
fn for_each_tile(tiles: &[Range<usize>], f: impl Fn(usize, &Range<usize>, &mut TileScratch) + Sync) {
    tiles.par_iter().enumerate().for_each(|(i, t)| with_scratch(&TILE_SCRATCH, |scratch| f(i, t, scratch)));
}

/// `[start, start + len)` in `tile`-wide pieces.
fn tiles(len: usize, tile: usize) -> Vec<Range<usize>> {
    (0..len).step_by(tile.max(1)).map(|c| c..(c + tile).min(len)).collect()
}

/// `z (+)= hc @ weight^T` on the packed kernel of `hc`'s way: the logits of the packed chunk `hc` over the vocabulary rows
/// of `weight` (bf16 bits, row-major, `hidden_size` columns, `z.cols` rows), `tile` rows at a
/// time, the tiles spread over the threads. Each tile is `C = W_tile @ hc^T`, written transposed;
/// its A is the weight's rows packed a macro block at a time.
pub fn logits(z: &mut MatMut<'_>, accumulate: bool, hc: &PackedHidden, weight: &[u16], tile: usize) {
    let h = hc.hidden_size;
    assert!(z.rows == hc.rows && weight.len() >= z.cols * h);
    assert!(z.rows == 0 || hc.transposed.cols >= z.rows, "hidden states packed for the gradients alone");
    let out = Output::new(z, true, accumulate);
    for_each_tile(&tiles(out.rows, tile), |_, t, scratch| {
        // Packed a macro block's rows at a time, so that they are still in L2 when read. Read in
        // place, the weight's rows were slower wherever they were not on cache lines (a tile
        // row across two lines) or were a power of two apart (all in one cache set).
        for part in tiles(t.len(), 32 * MACRO.0) {
            let rows = t.start + part.start..t.start + part.end;
            let a = if in_place_a(hc.products, h, rows.len()) {
                AOperand::rows(weight[rows.start * h..].as_ptr(), 2 * h, h / 32)
            } else {
                pack::a_from_rows(&weight[rows.start * h..], h, rows.len(), h, &mut scratch.a);
                AOperand::packed(&scratch.a)
            };
            let out = out.part(rows, 0..out.cols);
            // SAFETY: A is packed to whole blocks, or read in place where its rows are whole
            // blocks of whole k-steps; B is packed; these columns of z are written by this task
            // only.
            unsafe { product(a, BOperand::packed(&hc.transposed), &out, hc.products) };
        }
    });
}

/// Whether the logits product reads `rows` weight rows of `h` values in place as its A: on
/// `vdpbf16ps`, which reads A a pair at a time (broadcast), where the rows are whole blocks of
/// whole k-steps. (AMX's tile loads want packed rows on cache lines, an odd number apart.)
fn in_place_a(products: Bf16Products, h: usize, rows: usize) -> bool {
    !products.on_amx() && h.is_multiple_of(32) && rows.is_multiple_of(32)
}

/// Vocabulary tiles fall into this many fixed groups, each summing its tiles' share of `d hidden`
/// in order; the groups' sums are added in order. The sums do not depend on the thread count.
pub const GROUPS: usize = 16;

/// The gradient products of a chunk on the packed kernel of `hc`'s way: `dh = dz @ weight` and, if `dw` is given,
/// `dw (+)= dz^T @ hc` (`dz`: f32, `n x v`; `weight` and `dw`: `v x hidden_size`), `tile`
/// vocabulary rows at a time, the tiles spread over the threads. `partials` holds the groups'
/// sums of `dh` (kept for reuse).
///
/// Each tile's `dz` is split into bf16 pairs ([`pack::a_from_f32_split`]) or rounded, the A of
/// `dz @ W_tile` (against the tile's rows, twice where split); `dW_tile` is `dz^T @ hc` written
/// in place on `vdpbf16ps` and `(hc^T @ dz)^T` written transposed on AMX
/// (`weight_gradient_in_place`).
#[allow(clippy::too_many_arguments)]
pub fn gradients(
    dh: &mut MatMut<'_>,
    dw: Option<&mut [f32]>,
    accumulate_dw: bool,
    dz: Mat<'_>,
    weight: &[u16],
    hc: &PackedHidden,
    tile: usize,
    partials: &mut Vec<f32>,
) {
    let (n, h, v) = (dz.rows, hc.hidden_size, dz.cols);
    assert!(dh.rows == n && dh.cols == h && hc.rows == n && weight.len() >= v * h);
    assert!(n == 0 || hc.packed_for_gradients(), "hidden states packed for the logits alone");
    let all = tiles(v, tile);
    let groups: Vec<Range<usize>> = (0..GROUPS.min(all.len()))
        .map(|g| g * all.len() / GROUPS.min(all.len())..(g + 1) * all.len() / GROUPS.min(all.len()))
        .collect();
    // Each group's sum on cache lines, where the tiles load and store it.
    let part = (n * h).next_multiple_of(16);
    partials.resize(groups.len() * part + 16, 0.0);
    let first = partials.as_ptr().cast::<u8>().align_offset(64) / 4;
    let partials = &mut partials[first..first + groups.len() * part];
    let base = partials.as_mut_ptr();
    let partial_outs: Vec<Output> = (0..groups.len())
        .map(|g| Output {
            ptr: base.wrapping_add(g * part),
            rows: n,
            cols: h,
            stride: h,
            transposed: false,
            accumulate: false,
        })
        .collect();
    let dw_out = dw.map(|dw| {
        assert!(dw.len() >= v * h);
        Output::new(&mut MatMut::new(dw, v, h), !weight_gradient_in_place(hc.products), accumulate_dw)
    });
    let (partial_outs, dw_out) = (&partial_outs, &dw_out);
    groups.par_iter().enumerate().for_each(|(g, group)| {
        with_scratch(&TILE_SCRATCH, |scratch| {
            for (i, t) in all[group.clone()].iter().enumerate() {
                let partial = Output { accumulate: i > 0, ..partial_outs[g] };
                let dw_tile = dw_out.as_ref().map(|out| out.weight_rows(t.clone()));
                // (No rows: `dz` is empty.)
                let dz_tile = Mat { data: dz.data.get(t.start..).unwrap_or(&[]), cols: t.len(), ..dz };
                let weight_tile = &weight[t.start * h..];
                // SAFETY: group g's partial and this tile's rows of dw are written by this task
                // only.
                unsafe { gradient_products(&partial, dw_tile.as_ref(), dz_tile, weight_tile, hc, scratch, product) }
            }
        })
    });
    sum_partials(dh, partials, part);
}

/// How a product is run: [`product`] on the calling thread (a fused-linear tile, the tiles
/// already spread over the threads) or `layer::parallel_product` (a layer's whole product).
type Run = unsafe fn(AOperand, BOperand, &Output, Bf16Products);

/// The gradient products of `dz` (`n x v`, f32) through `weight` (`v` rows of `hc.hidden_size`
/// bf16 bits): `partial (+)= dz @ weight` and `dw (+)= dz^T @ hc` ([`weight_gradient_in_place`]),
/// with `dz` split or rounded as `hc`'s way says, each product run by `run`. Shared by the fused-linear loss (a vocabulary
/// tile at a time) and a model's linear layers ([`layer::backward`]).
///
/// # Safety
/// No other thread writes `partial` or `dw` at the same time.
unsafe fn gradient_products(
    partial: &Output,
    dw: Option<&Output>,
    dz: Mat<'_>,
    weight: &[u16],
    hc: &PackedHidden,
    scratch: &mut TileScratch,
    run: Run,
) {
    // SAFETY: the caller's promise.
    unsafe {
        if hc.products.rounded() {
            tile_gradients_rounded(partial, dw, dz, weight, hc, scratch, run)
        } else {
            tile_gradients_split(partial, dw, dz, weight, hc, scratch, run)
        }
    }
}

/// One vocabulary tile's gradient products on `dz` split into bf16 pairs: `partial (+)= dz @ W`
/// (A: the split `dz`, B: the tile's rows twice) and `dw (+)= dz^T @ hc` (A: the same split `dz`
/// read across, B: `hc` with each row twice), or on AMX `dw^T (+)= hc^T @ dz` (A: `hc^T` with
/// each element twice, B: the split `dz` read as VNNI).
///
/// # Safety
/// No other thread writes `partial` or `dw` at the same time.
unsafe fn tile_gradients_split(
    partial: &Output,
    dw: Option<&Output>,
    dz: Mat<'_>,
    weight: &[u16],
    hc: &PackedHidden,
    scratch: &mut TileScratch,
    run: Run,
) {
    let (n, h, v) = (dz.rows, hc.hidden_size, dz.cols);
    let TileScratch { a: split, b: doubled, .. } = scratch;
    pack::a_from_f32_split(dz.data, dz.stride, n, v, split);
    pack::b_from_rows_duplicated(weight, h, v, h, doubled);
    // A's rows hold 2 * padded(cols) bf16 values (padded(cols) pairs); B has padded(2 * cols) rows.
    let a = AOperand { steps: doubled.k / 32, ..AOperand::packed(split) };
    // SAFETY: both operands are packed to whole blocks, A's `steps` inside its rows
    // (padded(2 cols) <= 2 padded(cols)); the caller owns `partial`.
    unsafe { run(a, BOperand::packed(doubled), partial, hc.products) };
    let Some(dw) = dw else { return };
    if weight_gradient_in_place(hc.products) {
        let b = &hc.rows_for_gradient;
        let a = AOperand::across_split(split, b.k / 32);
        // SAFETY: A's rows (padded(v) columns of pairs) and pairs (padded(n) >= b.k / 2 rows)
        // are inside the packed tile; B is packed; the caller owns `dw`.
        unsafe { run(a, BOperand::packed(b), dw, hc.products) };
    } else {
        let b = BOperand { ptr: split.data.as_ptr().cast(), panel_elems: 32, row_bytes: 2 * split.stride };
        // SAFETY: A is packed; B's rows (padded(n)) and columns (padded(v), 2 * 32 per block)
        // are inside the packed tile, zero padded; the caller owns `dw`.
        unsafe { run(AOperand::packed(&hc.transposed_for_gradient), b, dw, hc.products) };
    }
}

/// As [`tile_gradients_split`] with `dz` rounded to bf16 (as PyTorch and Liger take it in
/// bf16): half the flops, bf16-grade gradients. A: `dz` rounded, B: the tile's rows; then A:
/// `dz` rounded as VNNI and read across, B: `hc` (on AMX: A `hc^T`, B `dz` as VNNI).
///
/// # Safety
/// As for [`tile_gradients_split`].
unsafe fn tile_gradients_rounded(
    partial: &Output,
    dw: Option<&Output>,
    dz: Mat<'_>,
    weight: &[u16],
    hc: &PackedHidden,
    scratch: &mut TileScratch,
    run: Run,
) {
    let (n, h, v) = (dz.rows, hc.hidden_size, dz.cols);
    let TileScratch { a: rounded, b: rows, c: rounded_b } = scratch;
    pack::a_from_f32_rounded(dz.data, dz.stride, n, v, rounded);
    pack::b_from_rows(weight, h, v, h, rows);
    // SAFETY: both packed to whole blocks over the same padded(v) k; the caller owns `partial`.
    unsafe { run(AOperand::packed(rounded), BOperand::packed(rows), partial, hc.products) };
    let Some(dw) = dw else { return };
    pack::b_from_f32_rounded(dz.data, dz.stride, n, v, rounded_b);
    if weight_gradient_in_place(hc.products) {
        let (a, b) = (AOperand::across_panels(rounded_b), BOperand::packed(&hc.rows_for_gradient));
        // SAFETY: both packed to whole blocks over the same padded(n) k; the caller owns `dw`.
        unsafe { run(a, b, dw, hc.products) };
    } else {
        // SAFETY: both packed to whole blocks over the same padded(n) k; the caller owns `dw`.
        unsafe { run(AOperand::packed(&hc.transposed_for_gradient), BOperand::packed(rounded_b), dw, hc.products) };
    }
}

/// `dh` = the sum of the `partials` (each `dh.rows x dh.cols`, `part` apart), in order.
fn sum_partials(dh: &mut MatMut<'_>, partials: &[f32], part: usize) {
    let (n, h) = (dh.rows, dh.cols);
    let stride = dh.stride;
    dh.data.par_chunks_mut(stride).take(n).enumerate().for_each(|(r, row)| {
        let row = &mut row[..h];
        row.fill(0.0);
        for partial in partials.chunks_exact(part) {
            for (d, &x) in row.iter_mut().zip(&partial[r * h..(r + 1) * h]) {
                *d += x;
            }
        }
    });
}

#[cfg(test)]
mod tests;

//! bf16 matrix products at the machine's bf16 rate: the three products of a fused-linear loss
//! (see [`crate::matmul`]) with bf16 weights and hidden states, f32 accumulation and f32 outputs.
//!
//! Two ways, chosen at run time ([`Bf16Products::detected`], overridable per thread with
//! [`with_bf16_products`] and for the process with `FLASHGRPO_BF16_PRODUCTS=widened|amx`):
//! - [`Bf16Products::Amx`]: Intel AMX tiles ([`amx`]), ~1 TFLOP/s per core on this project's
//!   machine against ~100 for f32. The logits product multiplies the bf16 inputs exactly; the two
//!   gradient products take the f32 logits' gradient split into two bf16 numbers ([`pack`]), so
//!   every product keeps f32's accuracy.
//! - [`Bf16Products::Widened`]: the operands widened to f32 for the `gemm` crate (every CPU).
//!
//! The products are deterministic: each output element sums its terms in one fixed order, on one
//! thread, whatever the thread count.

pub mod amx;
pub mod pack;

use std::cell::Cell;
use std::sync::OnceLock;

use rayon::prelude::*;

use crate::matmul::{Mat, MatMut};
use pack::{PackedA, PackedB};

/// The kernels the bf16 products run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Products {
    /// bf16 operands widened to f32 for the f32 products.
    Widened,
    /// AMX-BF16 tiles.
    Amx,
}

impl Bf16Products {
    /// AMX where the CPU and the kernel allow it, unless `FLASHGRPO_BF16_PRODUCTS` says otherwise.
    pub fn detected() -> Self {
        static DETECTED: OnceLock<Bf16Products> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            let wanted = std::env::var("FLASHGRPO_BF16_PRODUCTS").unwrap_or_default();
            match wanted.as_str() {
                "widened" => Bf16Products::Widened,
                _ if amx::available() => Bf16Products::Amx,
                _ => Bf16Products::Widened,
            }
        })
    }

    /// Every way this machine can run.
    pub fn available() -> Vec<Self> {
        let mut all = vec![Bf16Products::Widened];
        if amx::available() {
            all.push(Bf16Products::Amx);
        }
        all
    }

    pub fn name(self) -> &'static str {
        match self {
            Bf16Products::Widened => "widened-f32",
            Bf16Products::Amx => "amx-bf16",
        }
    }
}

thread_local! {
    static OVERRIDE: Cell<Option<Bf16Products>> = const { Cell::new(None) };
}

/// Runs `f` with the bf16 products of `products` for calls made from this thread.
///
/// # Panics
/// If this machine cannot run `products`.
pub fn with_bf16_products<R>(products: Bf16Products, f: impl FnOnce() -> R) -> R {
    assert!(Bf16Products::available().contains(&products), "this machine cannot run {products:?}");
    let previous = OVERRIDE.with(|o| o.replace(Some(products)));
    let result = f();
    OVERRIDE.with(|o| o.set(previous));
    result
}

/// The way calls from this thread run now.
pub fn current() -> Bf16Products {
    OVERRIDE.with(Cell::get).unwrap_or_else(Bf16Products::detected)
}

/// Where a product's f32 result goes: `rows x cols` of C at `ptr` (rows `stride` apart), or, if
/// `transposed`, C^T (C's column `j` is memory row `j`).
#[derive(Clone, Copy)]
struct Output {
    ptr: *mut f32,
    rows: usize,
    cols: usize,
    stride: usize,
    transposed: bool,
    accumulate: bool,
}

// SAFETY: the blocks of C written by different threads are disjoint (see `product`).
unsafe impl Sync for Output {}

impl Output {
    fn new(out: &mut MatMut<'_>, transposed: bool, accumulate: bool) -> Self {
        let (rows, cols) = if transposed { (out.cols, out.rows) } else { (out.rows, out.cols) };
        assert!(out.rows == 0 || out.cols == 0 || out.data.len() >= (out.rows - 1) * out.stride + out.cols);
        Self { ptr: out.data.as_mut_ptr(), rows, cols, stride: out.stride, transposed, accumulate }
    }

    /// Block `(bi, bj)` of C in place, where the tiles can read and write it there: not
    /// transposed, and the whole block inside the output.
    fn direct(&self, bi: usize, bj: usize) -> Option<amx::CTile> {
        let inside = 32 * (bi + 1) <= self.rows && 32 * (bj + 1) <= self.cols;
        (inside && !self.transposed).then(|| amx::CTile {
            ptr: self.ptr.wrapping_add(32 * bi * self.stride + 32 * bj),
            row_bytes: 4 * self.stride,
            load: self.accumulate,
        })
    }

    /// Writes (or adds) the valid part of block `(bi, bj)`.
    ///
    /// # Safety
    /// No other thread writes this block at the same time.
    unsafe fn write(&self, bi: usize, bj: usize, block: &amx::Block) {
        let (r0, c0) = (32 * bi, 32 * bj);
        let (rows, cols) = (self.rows.saturating_sub(r0).min(32), self.cols.saturating_sub(c0).min(32));
        let store = |dst: &mut f32, x: f32| *dst = if self.accumulate { *dst + x } else { x };
        if self.transposed {
            for c in 0..cols {
                // SAFETY: memory row c0 + c, columns r0..r0 + rows are inside the output.
                let dst = unsafe { std::slice::from_raw_parts_mut(self.ptr.add((c0 + c) * self.stride + r0), rows) };
                for (r, d) in dst.iter_mut().enumerate() {
                    store(d, block[32 * r + c]);
                }
            }
        } else {
            for r in 0..rows {
                // SAFETY: row r0 + r, columns c0..c0 + cols are inside the output.
                let dst = unsafe { std::slice::from_raw_parts_mut(self.ptr.add((r0 + r) * self.stride + c0), cols) };
                for (d, &x) in dst.iter_mut().zip(&block[32 * r..32 * r + cols]) {
                    store(d, x);
                }
            }
        }
    }
}

/// An A operand of [`product`]: row `i` at `ptr + i * row_bytes`, read 32 rows and `steps`
/// k-steps (64 bytes each) at a time.
#[derive(Clone, Copy)]
struct AOperand {
    ptr: *const u16,
    row_bytes: usize,
    steps: usize,
}

/// A B operand of [`product`]: panel `p` (16 columns) at `ptr + p * panel_elems`, its rows
/// `row_bytes` apart, 16 rows a k-step.
#[derive(Clone, Copy)]
struct BOperand {
    ptr: *const u16,
    panel_elems: usize,
    row_bytes: usize,
}

// SAFETY: the operands are only read, by the threads of one `product` call, while the buffers
// they point into are borrowed by its caller.
unsafe impl Sync for AOperand {}
unsafe impl Sync for BOperand {}

impl AOperand {
    fn packed(a: &PackedA) -> Self {
        Self { ptr: a.data.as_ptr().cast(), row_bytes: 2 * a.k, steps: a.k / 32 }
    }

    /// The first row of block row `bi`.
    fn block(&self, bi: usize) -> *const u16 {
        self.ptr.wrapping_byte_add(32 * bi * self.row_bytes)
    }
}

impl BOperand {
    fn packed(b: &PackedB) -> Self {
        Self { ptr: b.data.as_ptr().cast(), panel_elems: 16 * b.k, row_bytes: 64 }
    }

    /// The first row of panel `p`.
    fn panel(&self, p: usize) -> *const u16 {
        self.ptr.wrapping_add(p * self.panel_elems)
    }
}

/// C (+)= A @ B on AMX tiles, blocks of 32x32 spread over the rayon threads.
///
/// # Safety
/// A must be readable for `32 * ceil(out.rows / 32)` rows of `a.steps` steps, and B's panels
/// `0..2 * ceil(out.cols / 32)` for `16 * a.steps` rows.
unsafe fn product(a: AOperand, b: BOperand, out: &Output) {
    assert!(amx::available());
    let (blocks_m, blocks_n) = (out.rows.div_ceil(32), out.cols.div_ceil(32));
    let blocks = blocks_m * blocks_n;
    let per_task = blocks.div_ceil(4 * rayon::current_num_threads()).max(1);
    (0..blocks.div_ceil(per_task)).into_par_iter().for_each(|task| {
        let mut block = [0.0f32; 32 * 32];
        // SAFETY: AMX is available (asserted); the operands are readable as the caller promised,
        // and each block of C is written by the one task that owns it.
        unsafe {
            amx::configure();
            for index in task * per_task..((task + 1) * per_task).min(blocks) {
                let (bi, bj) = (index / blocks_n, index % blocks_n);
                let (b0, b1) = (b.panel(2 * bj), b.panel(2 * bj + 1));
                match out.direct(bi, bj) {
                    Some(c) => amx::block(a.block(bi), a.row_bytes, b0, b1, b.row_bytes, a.steps, &c),
                    None => {
                        let c = amx::CTile { ptr: block.as_mut_ptr(), row_bytes: 128, load: false };
                        amx::block(a.block(bi), a.row_bytes, b0, b1, b.row_bytes, a.steps, &c);
                        out.write(bi, bj, &block);
                    }
                }
            }
            amx::release();
        }
    });
}

/// The packed forms of one chunk of bf16 hidden states, reused by every vocabulary tile.
#[derive(Default)]
pub struct PackedHidden {
    /// `hc^T`: the B of the logits product.
    transposed: PackedB,
    /// `hc^T`, each element twice: the A of the weight-gradient product.
    transposed_duplicated: PackedA,
    rows: usize,
    hidden_size: usize,
}

impl PackedHidden {
    /// Packs `hc` (`rows x hidden_size` bf16 bits, row-major).
    pub fn pack(&mut self, hc: &[u16], rows: usize, hidden_size: usize) {
        pack::b_from_transposed(hc, hidden_size, rows, hidden_size, &mut self.transposed);
        pack::a_from_transposed_duplicated(hc, rows, hidden_size, &mut self.transposed_duplicated);
        (self.rows, self.hidden_size) = (rows, hidden_size);
    }
}

/// Packing buffers of the per-tile operands, reused from tile to tile.
#[derive(Default)]
pub struct Scratch {
    a: PackedA,
    b: PackedB,
}

/// `z (+)= hc @ wt^T` on AMX: the logits of the packed chunk `hc` over `wt_rows` vocabulary rows
/// (`wt`: bf16 bits, row-major, `hidden_size` columns; it may go on past those rows, to the end of
/// the weight, which lets the product read whole blocks of rows in place).
pub fn logits(
    z: &mut MatMut<'_>,
    accumulate: bool,
    hc: &PackedHidden,
    wt: &[u16],
    wt_rows: usize,
    scratch: &mut Scratch,
) {
    let h = hc.hidden_size;
    assert!(z.rows == hc.rows && z.cols == wt_rows && wt.len() >= wt_rows * h);
    let a = if h.is_multiple_of(32) && wt.len() >= pack::padded(wt_rows) * h {
        AOperand { ptr: wt.as_ptr(), row_bytes: 2 * h, steps: h / 32 }
    } else {
        pack::a_from_rows(wt, h, wt_rows, h, &mut scratch.a);
        AOperand::packed(&scratch.a)
    };
    // SAFETY: A's whole blocks of rows are inside `wt` or packed; B is packed to whole blocks.
    unsafe { product(a, BOperand::packed(&hc.transposed), &Output::new(z, true, accumulate)) };
}

/// A tile of the logits' gradient, split into bf16 pairs and packed (see
/// [`pack::a_from_f32_split`]), read by both gradient products.
#[derive(Default)]
pub struct SplitGradient {
    packed: PackedA,
    rows: usize,
    cols: usize,
}

impl SplitGradient {
    /// Packs `dz` (f32).
    pub fn pack(&mut self, dz: Mat<'_>) {
        pack::a_from_f32_split(dz.data, dz.stride, dz.rows, dz.cols, &mut self.packed);
        (self.rows, self.cols) = (dz.rows, dz.cols);
    }
}

/// `dh (+)= dz @ wt` on AMX (`wt`: bf16 bits, `dz.cols x dh.cols`).
pub fn input_gradient(dh: &mut MatMut<'_>, accumulate: bool, dz: &SplitGradient, wt: &[u16], scratch: &mut Scratch) {
    let h = dh.cols;
    assert!(dh.rows == dz.rows && wt.len() >= dz.cols * h);
    pack::b_from_rows_duplicated(wt, h, dz.cols, h, &mut scratch.b);
    // A's rows hold 2 * padded(cols) pairs; B has the rows of padded(2 * cols) of them.
    let a = AOperand { steps: scratch.b.k / 32, ..AOperand::packed(&dz.packed) };
    // SAFETY: A's `steps` are inside its rows (padded(2 cols) <= 2 padded(cols)), B is packed for
    // all of them, and both are padded to whole blocks.
    unsafe { product(a, BOperand::packed(&scratch.b), &Output::new(dh, false, accumulate)) };
}

/// `dw (+)= dz^T @ hc` on AMX (`dw`: `dz.cols x hidden_size`).
pub fn weight_gradient(dw: &mut MatMut<'_>, accumulate: bool, dz: &SplitGradient, hc: &PackedHidden) {
    assert!(dz.rows == hc.rows && dw.rows == dz.cols && dw.cols == hc.hidden_size);
    let split = &dz.packed;
    let b = BOperand { ptr: split.data.as_ptr().cast(), panel_elems: 32, row_bytes: 2 * split.k };
    // SAFETY: A is packed; B's rows (padded(rows)) and columns (padded(cols), 2 * 32 per block)
    // are inside the packed tile, zero padded.
    unsafe { product(AOperand::packed(&hc.transposed_duplicated), b, &Output::new(dw, true, accumulate)) };
}

#[cfg(test)]
mod tests;

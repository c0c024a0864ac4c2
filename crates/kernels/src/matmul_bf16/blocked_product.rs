//! One blocked product `C (+)= A @ B` on the packed kernels (AMX tiles or `vdpbf16ps`), on the
//! calling thread: its operands ([`AOperand`], [`BOperand`]), where its result goes ([`Output`]),
//! and the macro blocks and passes over K that keep the operands in the caches.

use std::ops::Range;

use super::pack::{PackedA, PackedB};
use super::{amx, dpbf16, Bf16Products};
use crate::matmul::MatMut;

/// Where a product's f32 result goes: `rows x cols` of C at `ptr` (rows `stride` apart), or, if
/// `transposed`, C^T (C's column `j` is memory row `j`).
#[derive(Clone, Copy)]
pub(super) struct Output {
    pub(super) ptr: *mut f32,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) stride: usize,
    pub(super) transposed: bool,
    pub(super) accumulate: bool,
}

// SAFETY: the blocks of C written by different threads are disjoint (see `product`).
unsafe impl Sync for Output {}

impl Output {
    pub(super) fn new(out: &mut MatMut<'_>, transposed: bool, accumulate: bool) -> Self {
        let (rows, cols) = if transposed { (out.cols, out.rows) } else { (out.rows, out.cols) };
        assert!(out.rows == 0 || out.cols == 0 || out.data.len() >= (out.rows - 1) * out.stride + out.cols);
        Self { ptr: out.data.as_mut_ptr(), rows, cols, stride: out.stride, transposed, accumulate }
    }

    /// The part `rows x cols` of C.
    pub(super) fn part(&self, rows: Range<usize>, cols: Range<usize>) -> Self {
        assert!(rows.end <= self.rows && cols.end <= self.cols);
        let (r, c) = if self.transposed { (cols.start, rows.start) } else { (rows.start, cols.start) };
        Self { ptr: self.ptr.wrapping_add(r * self.stride + c), rows: rows.len(), cols: cols.len(), ..*self }
    }

    /// The part of a weight's gradient (`V x H`, or transposed) of weight rows `rows`.
    pub(super) fn weight_rows(&self, rows: Range<usize>) -> Self {
        if self.transposed {
            self.part(0..self.rows, rows)
        } else {
            self.part(rows, 0..self.cols)
        }
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

    /// Asks for the memory of block `(bi, bj)` ahead of [`Self::write`] or of the kernel's own
    /// load of it, so that it arrives while the kernel computes (a transposed write reads 32 rows
    /// of 128 bytes, each in another page of a large output: without this the write waits on
    /// memory).
    fn prefetch(&self, bi: usize, bj: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let (r0, c0) = (32 * bi, 32 * bj);
            let (rows, cols) = (self.rows.saturating_sub(r0).min(32), self.cols.saturating_sub(c0).min(32));
            let (lines, len) = if self.transposed { (cols, rows) } else { (rows, cols) };
            let start = if self.transposed { c0 * self.stride + r0 } else { r0 * self.stride + c0 };
            for line in 0..lines {
                let p = self.ptr.wrapping_add(start + line * self.stride);
                // SAFETY: a prefetch never faults; the addresses are inside the output anyway.
                unsafe {
                    _mm_prefetch::<_MM_HINT_T0>(p.cast());
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(len - 1).cast());
                }
            }
        }
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
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx512f") {
                // SAFETY: AVX-512F was detected; memory rows c0..c0 + cols, columns
                // r0..r0 + rows are inside the output.
                unsafe {
                    add_transposed(self.ptr.add(c0 * self.stride + r0), self.stride, block, rows, cols, self.accumulate)
                };
                return;
            }
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

/// `dst[c * stride + r] (+)= block[32 * r + c]` for `r < rows`, `c < cols`: a block's transpose,
/// a 16 x 16 quarter at a time in registers (the scalar loop beside it is the reference).
///
/// # Safety
/// AVX-512F; `dst` valid for `cols` rows of `rows` values, `stride` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn add_transposed(dst: *mut f32, stride: usize, block: &amx::Block, rows: usize, cols: usize, accumulate: bool) {
    use std::arch::x86_64::*;
    for r0 in (0..rows).step_by(16) {
        let mask: __mmask16 = if rows - r0 >= 16 { 0xffff } else { (1 << (rows - r0)) - 1 };
        for c0 in (0..cols).step_by(16) {
            // SAFETY: rows r0..r0 + 16, columns c0..c0 + 16 are inside the block's 32 x 32.
            let mut quarter: [__m512; 16] =
                std::array::from_fn(|i| unsafe { _mm512_loadu_ps(block[32 * (r0 + i) + c0..].as_ptr()) });
            transpose16(&mut quarter);
            for (j, column) in quarter.iter().enumerate().take(cols - c0) {
                // SAFETY (dst): the caller's promise, for the `mask`ed lanes.
                let p = unsafe { dst.add((c0 + j) * stride + r0) };
                let v = if accumulate {
                    _mm512_add_ps(*column, unsafe { _mm512_maskz_loadu_ps(mask, p) })
                } else {
                    *column
                };
                unsafe { _mm512_mask_storeu_ps(p, mask, v) };
            }
        }
    }
}

/// Transposes 16 x 16 f32 in registers: for each bit `b` of the index, every pair of rows `b`
/// apart swaps the `b` bit of row and lane (`vpermt2ps`, 8 pairs a round, 4 rounds).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn transpose16(rows: &mut [std::arch::x86_64::__m512; 16]) {
    use std::arch::x86_64::*;
    const fn indices(b: usize, upper: bool) -> [i32; 16] {
        let mut idx = [0i32; 16];
        let mut l = 0;
        while l < 16 {
            idx[l] = match (l & b == 0, upper) {
                (true, false) => l,
                (false, false) => 16 + l - b,
                (true, true) => l + b,
                (false, true) => 16 + l,
            } as i32;
            l += 1;
        }
        idx
    }
    const INDICES: [[[i32; 16]; 2]; 4] = {
        let mut all = [[[0; 16]; 2]; 4];
        let mut k = 0;
        while k < 4 {
            all[k] = [indices(8 >> k, false), indices(8 >> k, true)];
            k += 1;
        }
        all
    };
    for (k, [lower, upper]) in INDICES.iter().enumerate() {
        let b = 8 >> k;
        // SAFETY: 16 i32 each; the caller is compiled with AVX-512F (`__m512` values exist).
        let (lower, upper) =
            unsafe { (_mm512_loadu_si512(lower.as_ptr().cast()), _mm512_loadu_si512(upper.as_ptr().cast())) };
        for i in (0..16).filter(|i| i & b == 0) {
            let (x, y) = (rows[i], rows[i + b]);
            rows[i] = unsafe { _mm512_permutex2var_ps(x, lower, y) };
            rows[i + b] = unsafe { _mm512_permutex2var_ps(x, upper, y) };
        }
    }
}

/// An A operand of [`product`]: where its rows and pairs lie ([`dpbf16::ABlock`]: AMX reads only
/// rows of contiguous pairs, `vdpbf16ps` any), `steps` k-steps (16 pairs each) long.
#[derive(Clone, Copy)]
pub(super) struct AOperand {
    pub(super) layout: dpbf16::ABlock,
    pub(super) steps: usize,
}

/// A B operand of [`product`]: panel `p` (16 columns) at `ptr + p * panel_elems`, its rows
/// `row_bytes` apart, 16 rows a k-step.
#[derive(Clone, Copy)]
pub(super) struct BOperand {
    pub(super) ptr: *const u16,
    pub(super) panel_elems: usize,
    pub(super) row_bytes: usize,
}

// SAFETY: the operands are only read, by the threads of one `product` call, while the buffers
// they point into are borrowed by its caller.
unsafe impl Sync for AOperand {}
unsafe impl Sync for BOperand {}

impl AOperand {
    /// Rows `row_bytes` apart, each row's pairs contiguous.
    pub(super) fn rows(ptr: *const u16, row_bytes: usize, steps: usize) -> Self {
        Self { layout: dpbf16::ABlock::rows(ptr, row_bytes), steps }
    }

    pub(super) fn packed(a: &PackedA) -> Self {
        Self::rows(a.data.as_ptr().cast(), 2 * a.stride, a.k / 32)
    }

    /// `dz^T` from [`super::pack::a_from_f32_split`]'s `dz` (`split`), read across: row `j` (a column of
    /// `dz`) is its rows' pairs `j`, 4 bytes apart; its pairs are the packed rows.
    pub(super) fn across_split(split: &PackedA, steps: usize) -> Self {
        let ptr = split.data.as_ptr().cast();
        Self { layout: dpbf16::ABlock { ptr, row_bytes: 4, half_bytes: 64, pair_bytes: 2 * split.stride }, steps }
    }

    /// The transpose of a VNNI B ([`PackedB`]), read across: row `j` is lane `j % 16` of panel
    /// `j / 16`, its pairs the panel's rows (64 bytes apart).
    pub(super) fn across_panels(b: &PackedB) -> Self {
        let ptr = b.data.as_ptr().cast();
        Self { layout: dpbf16::ABlock { ptr, row_bytes: 4, half_bytes: 32 * b.k, pair_bytes: 64 }, steps: b.k / 32 }
    }

    /// Block row `bi`, at its first k-step `k0`.
    fn block(&self, bi: usize, k0: usize) -> dpbf16::ABlock {
        let l = self.layout;
        dpbf16::ABlock { ptr: l.ptr.wrapping_byte_add(2 * bi * l.half_bytes + 16 * k0 * l.pair_bytes), ..l }
    }

    /// The operand from block row `bi` on.
    pub(super) fn starting_at_block(self, bi: usize) -> Self {
        Self { layout: self.block(bi, 0), ..self }
    }
}

impl BOperand {
    pub(super) fn packed(b: &PackedB) -> Self {
        Self { ptr: b.data.as_ptr().cast(), panel_elems: 16 * b.k, row_bytes: 64 }
    }

    /// The first row of panel `p`.
    pub(super) fn panel(&self, p: usize) -> *const u16 {
        self.ptr.wrapping_add(p * self.panel_elems)
    }
}

/// k-steps (32 each) per pass of the kernel over a block: one block column's chunk of B (two
/// panels, 1 KiB each a step: 16 KiB) then stays in L1 while the macro block's rows of A stream
/// past it from L2. Whole-K blocks read both operands from L2 and ran at ~60% of the kernel's
/// in-L1 rate (issue 17).
const K_STEPS: usize = 8;

/// The side of the products' blocks of C: a product's rows and columns, and its k-steps, are
/// computed in whole blocks of 32 (a ragged edge costs a whole block).
pub const BLOCK: usize = 32;

/// A macro block's block rows and columns (32 each): its rows' chunks of A (`MACRO.0 * 16` KiB)
/// stay in L2 across its columns, and the f32 blocks it keeps between passes (where C is not
/// written in place) take `MACRO.0 * MACRO.1 * 4` KiB.
pub(super) const MACRO: (usize, usize) = (8, 8);

/// A block of C on cache lines (the tiles load and store its rows of 128 bytes).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct KeptBlock(amx::Block);

thread_local! {
    /// The blocks of a macro block that cannot be accumulated in place (transposed or partial
    /// outputs), between the passes over K.
    static KEPT_BLOCKS: std::cell::Cell<Vec<KeptBlock>> = const { std::cell::Cell::new(Vec::new()) };
}

/// C (+)= A @ B on the packed kernel of `products` (AMX tiles or AVX512-BF16), on the calling
/// thread: macro block by macro block ([`MACRO`]), each in passes of [`K_STEPS`] over its 32 x 32
/// blocks. Every C element still adds its K products in one order (the passes reload the f32
/// sums exactly), so the results are those of one pass over K.
///
/// # Safety
/// A must be readable for `32 * ceil(out.rows / 32)` rows of `a.steps` steps, and B's panels
/// `0..2 * ceil(out.cols / 32)` for `16 * a.steps` rows; no other thread writes `out`.
pub(super) unsafe fn product(a: AOperand, b: BOperand, out: &Output, products: Bf16Products) {
    let amx = products.on_amx();
    assert!(if amx { amx::available() } else { products.packed() && dpbf16::available() });
    let (blocks_m, blocks_n) = (out.rows.div_ceil(32), out.cols.div_ceil(32));
    assert!(!amx || a.layout.contiguous_rows(), "AMX reads A's rows packed");
    let kernel = |bi: usize, bj: usize, k0: usize, steps: usize, c: &amx::CTile, next_c: Option<*const f32>| {
        let a_block = a.block(bi, k0);
        let (b0, b1) = (b.panel(2 * bj), b.panel(2 * bj + 1));
        let (b0, b1) = (b0.wrapping_byte_add(16 * k0 * b.row_bytes), b1.wrapping_byte_add(16 * k0 * b.row_bytes));
        // SAFETY: the kernel is available (asserted; AMX configured below); steps k0..k0 + steps
        // of the operands are readable as the caller promised.
        unsafe {
            if amx {
                amx::block(a_block.ptr, a_block.row_bytes, b0, b1, b.row_bytes, steps, c)
            } else {
                dpbf16::block(a_block, b0, b1, b.row_bytes, steps, c, next_c)
            }
        }
    };
    let mut kept = KEPT_BLOCKS.take();
    kept.resize(MACRO.0 * MACRO.1, KeptBlock([0.0; 32 * 32]));
    // SAFETY: AMX is available (asserted).
    if amx {
        unsafe { amx::configure() };
    }
    let (macros_m, macros_n) = (blocks_m.div_ceil(MACRO.0), blocks_n.div_ceil(MACRO.1));
    for index in 0..macros_m * macros_n {
        // Along the output's memory rows.
        let (mi, mj) =
            if out.transposed { (index % macros_m, index / macros_m) } else { (index / macros_n, index % macros_n) };
        let rows = MACRO.0 * mi..(MACRO.0 * (mi + 1)).min(blocks_m);
        let cols = MACRO.1 * mj..(MACRO.1 * (mj + 1)).min(blocks_n);
        for k0 in (0..a.steps.max(1)).step_by(K_STEPS) {
            let (steps, last) = (K_STEPS.min(a.steps - k0.min(a.steps)), k0 + K_STEPS >= a.steps);
            for bj in cols.clone() {
                for bi in rows.clone() {
                    match out.direct(bi, bj) {
                        Some(c) => {
                            // The next block's C from memory while this one computes (on
                            // `vdpbf16ps`, where `d weight` is accumulated in place).
                            let next = next_block(bi, bj, &rows, &cols).filter(|_| !amx && c.load && k0 == 0);
                            let next_c = next.and_then(|(ni, nj)| ask_for_block(out, ni, nj, steps));
                            kernel(bi, bj, k0, steps, &amx::CTile { load: c.load || k0 > 0, ..c }, next_c)
                        }
                        None => {
                            let block = &mut kept[(bi - rows.start) * MACRO.1 + bj - cols.start].0;
                            if last {
                                out.prefetch(bi, bj);
                            }
                            let c = amx::CTile { ptr: block.as_mut_ptr(), row_bytes: 128, load: k0 > 0 };
                            kernel(bi, bj, k0, steps, &c, None);
                            if last {
                                // SAFETY: the caller's promise: no other thread writes `out`.
                                unsafe { out.write(bi, bj, block) };
                            }
                        }
                    }
                }
            }
        }
    }
    // SAFETY: AMX is available (asserted).
    if amx {
        unsafe { amx::release() };
    }
    KEPT_BLOCKS.set(kept);
}

/// Asks for block `(ni, nj)` of `out` ahead of its use: returns its C for the `vdpbf16ps` kernel
/// to ask for over the block it computes (in place, where a pass covers all its lines: spread,
/// they arrive in time), else asks for it all now.
fn ask_for_block(out: &Output, ni: usize, nj: usize, steps: usize) -> Option<*const f32> {
    match out.direct(ni, nj) {
        Some(n) if steps >= dpbf16::STEPS_TO_ASK_AHEAD => Some(n.ptr.cast_const()),
        _ => {
            out.prefetch(ni, nj);
            None
        }
    }
}

/// The block after `(bi, bj)` in [`product`]'s order within a macro block (down its columns), if
/// any.
fn next_block(bi: usize, bj: usize, rows: &Range<usize>, cols: &Range<usize>) -> Option<(usize, usize)> {
    if bi + 1 < rows.end {
        Some((bi + 1, bj))
    } else {
        (bj + 1 < cols.end).then_some((rows.start, bj + 1))
    }
}

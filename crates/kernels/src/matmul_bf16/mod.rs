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

use std::cell::Cell;

use crate::scratch::with_scratch;
use std::ops::Range;
use std::sync::OnceLock;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::error::LossError;
use crate::matmul::{Mat, MatMut};
use pack::{PackedA, PackedB};

/// The kernels the bf16 products run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Bf16Products {
    /// bf16 operands widened to f32 for the f32 products.
    #[default]
    Widened,
    /// AMX-BF16 tiles, the logits' gradient split into two bf16 numbers (f32-grade gradients).
    Amx,
    /// AMX-BF16 tiles, the logits' gradient rounded to bf16 as PyTorch and Liger take it: the
    /// gradient products at half the flops, with bf16-grade gradients (named, or the default of the
    /// front ends that hand bf16 gradients back: [`Bf16Choice::default_for`]).
    AmxRounded,
    /// AVX512-BF16 (`vdpbf16ps`), the gradient split as [`Bf16Products::Amx`].
    Avx512Bf16,
    /// AVX512-BF16, the gradient rounded as [`Bf16Products::AmxRounded`] (named, or the same
    /// front ends' default on a CPU without AMX).
    Avx512Bf16Rounded,
}

impl Bf16Products {
    /// AMX where the CPU and the kernel allow it, else AVX512-BF16 where the CPU has it, else
    /// widened, unless `FLASHGRPO_BF16_PRODUCTS` names another way this machine has (`widened`,
    /// `amx`, `amx-rounded`, `avx512-bf16`, `avx512-bf16-rounded`; one it lacks is ignored).
    pub fn detected() -> Self {
        static DETECTED: OnceLock<Bf16Products> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            let available = Self::available();
            let default = *available.iter().find(|p| !p.rounded()).expect("one way at least");
            let named = Self::named_by_environment();
            let wanted = std::env::var("FLASHGRPO_BF16_PRODUCTS").unwrap_or_default();
            if named.is_none() && !wanted.is_empty() {
                let ways: Vec<&str> = available.iter().map(|p| p.setting()).collect();
                eprintln!(
                    "flashgrpo: FLASHGRPO_BF16_PRODUCTS={wanted} is not a way this machine has (it has: {}); using {}",
                    ways.join(", "),
                    default.setting()
                );
            }
            named.unwrap_or(default)
        })
    }

    /// The way `FLASHGRPO_BF16_PRODUCTS` names, if this machine has it (a value naming none is
    /// ignored). Public so that tests outside the crate follow the same rule.
    pub fn named_by_environment() -> Option<Self> {
        let wanted = std::env::var("FLASHGRPO_BF16_PRODUCTS").unwrap_or_default();
        Self::available().into_iter().find(|p| p.setting() == wanted)
    }

    /// Whether the products run on the packed bf16 kernels (AMX or AVX512-BF16).
    pub fn packed(self) -> bool {
        self != Bf16Products::Widened
    }

    /// Whether the gradient products take the logits' gradient rounded to bf16.
    pub fn rounded(self) -> bool {
        matches!(self, Bf16Products::AmxRounded | Bf16Products::Avx512Bf16Rounded)
    }

    /// Whether the products run on AMX tiles.
    pub fn on_amx(self) -> bool {
        matches!(self, Bf16Products::Amx | Bf16Products::AmxRounded)
    }

    /// Every way this machine can run, fastest first.
    pub fn available() -> Vec<Self> {
        let mut all = vec![];
        if amx::available() {
            all.extend([Bf16Products::Amx, Bf16Products::AmxRounded]);
        }
        if dpbf16::available() {
            all.extend([Bf16Products::Avx512Bf16, Bf16Products::Avx512Bf16Rounded]);
        }
        all.push(Bf16Products::Widened);
        all
    }

    /// The value of `FLASHGRPO_BF16_PRODUCTS` that asks for this way.
    pub fn setting(self) -> &'static str {
        match self {
            Bf16Products::Widened => "widened",
            Bf16Products::Amx => "amx",
            Bf16Products::AmxRounded => "amx-rounded",
            Bf16Products::Avx512Bf16 => "avx512-bf16",
            Bf16Products::Avx512Bf16Rounded => "avx512-bf16-rounded",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Bf16Products::Widened => "widened-f32",
            Bf16Products::Amx => "amx-bf16",
            Bf16Products::AmxRounded => "amx-bf16-rounded-gradient",
            Bf16Products::Avx512Bf16 => "avx512-bf16",
            Bf16Products::Avx512Bf16Rounded => "avx512-bf16-rounded-gradient",
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
    /// Puts the thread's previous way back when dropped, also when `f` panics and the panic is
    /// caught (a test's `catch_unwind`, a Python call's error), so the way does not leak.
    struct Restore(Option<Bf16Products>);
    impl Drop for Restore {
        fn drop(&mut self) {
            OVERRIDE.with(|o| o.set(self.0));
        }
    }
    let _restore = Restore(OVERRIDE.with(|o| o.replace(Some(products))));
    f()
}

/// The way calls from this thread run now.
pub fn current() -> Bf16Products {
    OVERRIDE.with(Cell::get).unwrap_or_else(Bf16Products::detected)
}

/// A call's or a config's choice of bf16 products (`bf16_products`), carried by
/// [`ChunkBudget`](crate::ChunkBudget) so that every front end, and a deferred backward, runs the
/// way its forward ran: `auto` ([`current`]: the machine's fastest way with f32-grade gradients,
/// or what `FLASHGRPO_BF16_PRODUCTS` names), `rounded` (the machine's fastest way with the logits'
/// gradient rounded to bf16, as PyTorch and Liger take it; kept by that name, so a config written
/// on one CPU reads on another), or one way's setting. Checked against this machine when read: a
/// way it lacks is an error naming the ones it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Bf16Choice {
    #[default]
    Auto,
    Rounded,
    Way(Bf16Products),
}

impl Bf16Choice {
    pub fn parse(setting: &str) -> Result<Self, LossError> {
        let available = Bf16Products::available();
        let choice = match setting {
            "auto" => Some(Bf16Choice::Auto),
            "rounded" => available.iter().any(|p| p.rounded()).then_some(Bf16Choice::Rounded),
            _ => available.iter().find(|p| p.setting() == setting).map(|&p| Bf16Choice::Way(p)),
        };
        choice.ok_or_else(|| {
            let ways: Vec<&str> = available.iter().map(|p| p.setting()).collect();
            let packed = available.iter().any(|p| p.packed());
            LossError::InvalidOption {
                name: "bf16_products",
                message: format!(
                    "`{setting}` is not a way this machine has; it has: auto, {}{}{}",
                    if packed { "rounded, " } else { "" },
                    ways.join(", "),
                    if packed { "" } else { " (this CPU has neither AMX nor AVX512-BF16)" }
                ),
            }
        })
    }

    /// What a front end runs when its caller names no way: `rounded` where every gradient it hands
    /// back is bf16 (`bf16_gradients`: `flashgrpo loss`, PyTorch and JAX on bf16 inputs), else
    /// `auto`. Rounding those gradients to bf16 already costs them ~1.7e-3 relative (norm);
    /// taking the logits' gradient rounded too brings that to ~2.4e-3, about Liger-Kernel's and
    /// below PyTorch eager's own bf16 error, for half the gradient products' flops
    /// (docs/BENCHMARKS.md, "The front ends' bf16 default"), while the library's f32 gradients
    /// and the trainer's f32 master weights keep f32-grade products.
    /// `FLASHGRPO_BF16_PRODUCTS` naming a way this machine has, or a way this thread runs under
    /// ([`with_bf16_products`]), still decides (`auto`); so does a CPU with no rounded way.
    pub fn default_for(bf16_gradients: bool) -> Self {
        let named = OVERRIDE.with(Cell::get).is_some() || Bf16Products::named_by_environment().is_some();
        let rounded_here = Bf16Products::available().iter().any(|p| p.rounded());
        if bf16_gradients && rounded_here && !named {
            Bf16Choice::Rounded
        } else {
            Bf16Choice::Auto
        }
    }

    /// The way a call runs: the one chosen, else this thread's ([`current`]).
    pub fn resolve(self) -> Bf16Products {
        match self {
            Bf16Choice::Auto => current(),
            Bf16Choice::Rounded => Bf16Products::available().into_iter().find(|p| p.rounded()).unwrap_or_else(current),
            Bf16Choice::Way(p) => p,
        }
    }

    /// Runs `f` with this choice as the calling thread's way (`auto`: as it is), for what reads
    /// the thread's way rather than a budget: the bench's product rate, a training run's layers.
    pub fn run<R>(self, f: impl FnOnce() -> R) -> R {
        match self {
            Bf16Choice::Auto => f(),
            choice => with_bf16_products(choice.resolve(), f),
        }
    }

    pub fn setting(self) -> &'static str {
        match self {
            Bf16Choice::Auto => "auto",
            Bf16Choice::Rounded => "rounded",
            Bf16Choice::Way(p) => p.setting(),
        }
    }
}

impl TryFrom<String> for Bf16Choice {
    type Error = LossError;

    fn try_from(setting: String) -> Result<Self, LossError> {
        Self::parse(&setting)
    }
}

impl From<Bf16Choice> for String {
    fn from(choice: Bf16Choice) -> String {
        choice.setting().to_string()
    }
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

    /// The part `rows x cols` of C.
    fn part(&self, rows: Range<usize>, cols: Range<usize>) -> Self {
        assert!(rows.end <= self.rows && cols.end <= self.cols);
        let (r, c) = if self.transposed { (cols.start, rows.start) } else { (rows.start, cols.start) };
        Self { ptr: self.ptr.wrapping_add(r * self.stride + c), rows: rows.len(), cols: cols.len(), ..*self }
    }

    /// The part of a weight's gradient (`V x H`, or transposed) of weight rows `rows`.
    fn weight_rows(&self, rows: Range<usize>) -> Self {
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
struct AOperand {
    layout: dpbf16::ABlock,
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
    /// Rows `row_bytes` apart, each row's pairs contiguous.
    fn rows(ptr: *const u16, row_bytes: usize, steps: usize) -> Self {
        Self { layout: dpbf16::ABlock::rows(ptr, row_bytes), steps }
    }

    fn packed(a: &PackedA) -> Self {
        Self::rows(a.data.as_ptr().cast(), 2 * a.stride, a.k / 32)
    }

    /// `dz^T` from [`pack::a_from_f32_split`]'s `dz` (`split`), read across: row `j` (a column of
    /// `dz`) is its rows' pairs `j`, 4 bytes apart; its pairs are the packed rows.
    fn across_split(split: &PackedA, steps: usize) -> Self {
        let ptr = split.data.as_ptr().cast();
        Self { layout: dpbf16::ABlock { ptr, row_bytes: 4, half_bytes: 64, pair_bytes: 2 * split.stride }, steps }
    }

    /// The transpose of a VNNI B ([`PackedB`]), read across: row `j` is lane `j % 16` of panel
    /// `j / 16`, its pairs the panel's rows (64 bytes apart).
    fn across_panels(b: &PackedB) -> Self {
        let ptr = b.data.as_ptr().cast();
        Self { layout: dpbf16::ABlock { ptr, row_bytes: 4, half_bytes: 32 * b.k, pair_bytes: 64 }, steps: b.k / 32 }
    }

    /// Block row `bi`, at its first k-step `k0`.
    fn block(&self, bi: usize, k0: usize) -> dpbf16::ABlock {
        let l = self.layout;
        dpbf16::ABlock { ptr: l.ptr.wrapping_byte_add(2 * bi * l.half_bytes + 16 * k0 * l.pair_bytes), ..l }
    }

    /// The operand from block row `bi` on.
    fn starting_at_block(self, bi: usize) -> Self {
        Self { layout: self.block(bi, 0), ..self }
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
const MACRO: (usize, usize) = (8, 8);

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
unsafe fn product(a: AOperand, b: BOperand, out: &Output, products: Bf16Products) {
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
/// ([`weight_gradient_in_place`]).
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

//! Packing the operands of the AMX and `vdpbf16ps` kernels ([`super::amx`], [`super::dpbf16`])
//! from the layouts the fused-linear loss holds them in. Every packed dimension is zero-padded to a multiple of 32, so the kernel never
//! sees a ragged edge; the padding's products are zeros the output writer skips.
//!
//! - A, row-major `[rows, k]` bf16, rows [`row_stride`] apart: a weight tile as it is
//!   ([`a_from_rows`]), or the hidden states transposed, each element twice
//!   ([`a_from_transposed_duplicated`]).
//! - B, panels of 16 columns, each `k/2` rows of 16 pairs `(B[2k', j], B[2k'+1, j])`: the hidden
//!   states transposed ([`b_from_transposed`]) or a weight tile with its rows twice
//!   ([`b_from_rows_duplicated`]).
//! - The logits' gradient `dz` (f32), a tile at a time: [`a_from_f32_split`] turns each element
//!   into two bf16 numbers side by side, `x = hi + lo` with `hi = bf16(x)`, `lo = bf16(x - hi)`.
//!   The packed tile is an A of twice the columns (against a B with duplicated rows) and, read as
//!   VNNI, a B (against an A with duplicated columns, on AMX) or, read across, the A of `dz^T`
//!   (against a B with duplicated rows, on `vdpbf16ps`): one product
//!   computes `x * b` to 16 bits of `x` instead of 8, so the gradient products keep f32's accuracy
//!   (LOSSES.md's 1e-4 for fused-linear gradients) at twice the flops of rounding `dz` to bf16.

use rayon::prelude::*;

/// B panels (16 columns each) per task of the packers that write them row by row: 256 bytes of
/// each source row read at once.
const PANELS_PER_TASK: usize = 8;

/// Source rows the panel packers ask for ahead of reading them: each row is one short piece
/// (`16 * PANELS_PER_TASK` elements) of a long row, which the hardware prefetchers do not follow,
/// and the weights come from memory.
const AHEAD: usize = 8;

/// Asks for `src[start..start + len]` (clamped to `src`) to be brought into the caches.
#[inline(always)]
fn prefetch_row<T>(src: &[T], start: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let end = (start + len).min(src.len());
        let bytes = std::mem::size_of::<T>();
        for i in (start..end).step_by((64 / bytes).max(1)) {
            // SAFETY: a prefetch never faults; the address is inside `src`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(src.as_ptr().add(i).cast()) };
        }
        if start < end {
            // SAFETY: as above; the last element's line, where the piece ends on another line.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(src.as_ptr().add(end - 1).cast()) };
        }
    }
}

/// `x` rounded up to a multiple of 32.
pub fn padded(x: usize) -> usize {
    x.div_ceil(32) * 32
}

/// 16 `u32`s on one cache line.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u32; 16]);

/// `u32`s starting on a cache line, so that each 64-byte row a tile load reads is one line, not
/// two: the AMX products ran ~1.5x slower on operands 16 bytes off the lines (`Vec`'s alignment
/// from the allocator), issue 17.
#[derive(Default)]
pub struct Lines {
    lines: Vec<Line>,
    len: usize,
}

impl Lines {
    /// `len` values; those beyond the old length are `value`, the others left as they were.
    pub fn resize(&mut self, len: usize, value: u32) {
        // New lines come filled; only the old lines' unused tail needs writing.
        let (old, kept) = (self.len, 16 * self.lines.len());
        self.lines.resize(len.div_ceil(16), Line([value; 16]));
        self.len = len;
        if len > old {
            self[old..len.min(kept)].fill(value);
        }
    }
}

impl std::ops::Deref for Lines {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        // SAFETY: `Line` is 16 `u32`s with no padding; `len <= 16 * lines.len()`.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast(), self.len) }
    }
}

impl std::ops::DerefMut for Lines {
    fn deref_mut(&mut self) -> &mut [u32] {
        // SAFETY: as for `deref`, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast(), self.len) }
    }
}

/// A packed A operand: `rows x k` bf16 values, row-major, both multiples of 32, stored as the
/// `k / 2` pairs of each row (the unit AMX reads; `u32` stores vectorise), rows `stride / 2`
/// pairs apart.
#[derive(Default)]
pub struct PackedA {
    pub data: Lines,
    pub rows: usize,
    pub k: usize,
    /// Row `r` starts at bf16 element `r * stride` (`data[r * stride / 2]`, [`row_stride`]).
    pub stride: usize,
}

/// The row length (bf16 elements) that holds rows of `k` (a multiple of 32): `k`, plus one
/// cache line where `k`'s rows would be an even number of lines apart. With an odd number the 16
/// rows of a tile load fall in 16 different cache sets; rows 4 KiB apart (the split gradient of
/// a 1024-row tile) all fell in one L1 set, and the products waited on L2 (issue 17).
pub fn row_stride(k: usize) -> usize {
    if (k / 32).is_multiple_of(2) {
        k + 32
    } else {
        k
    }
}

/// A packed B operand: `cols / 16` panels of `k / 2` rows of 16 pairs; `k` and `cols`
/// multiples of 32.
#[derive(Default)]
pub struct PackedB {
    pub data: Lines,
    pub k: usize,
    pub cols: usize,
}

impl PackedA {
    /// Sets the shape; the data is left as it was, for the packer to overwrite every row's `k / 2`
    /// pairs (the padding to 32 included: zeroing first would write every byte twice). The pairs
    /// between `k` and `stride` are never read.
    fn reset(&mut self, rows: usize, k: usize) {
        (self.rows, self.k) = (padded(rows), padded(k));
        self.stride = row_stride(self.k);
        self.data.resize(self.rows * self.stride / 2, 0);
    }

    /// No rows: nothing packed to read, the memory kept for the next packing.
    pub fn empty(&mut self) {
        (self.rows, self.k, self.stride) = (0, 0, 0);
    }
}

impl PackedB {
    /// As [`PackedA::reset`].
    fn reset(&mut self, k: usize, cols: usize) {
        (self.k, self.cols) = (padded(k), padded(cols));
        self.data.resize(self.k * self.cols / 2, 0);
    }

    /// As [`PackedA::empty`].
    pub fn empty(&mut self) {
        (self.k, self.cols) = (0, 0);
    }
}

/// Defines `fn $name(args)` whose body is compiled twice, for AVX-512 (chosen at run time; every
/// AMX CPU has it) and for the build's baseline, so that LLVM vectorises the hot packing loops
/// 16 lanes wide.
macro_rules! vectorised {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$doc])*
        fn $name($($arg: $ty),*) {
            #[inline(always)]
            fn body($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx512bw") && std::is_x86_feature_detected!("avx512vl") {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
                unsafe fn wide($($arg: $ty),*) {
                    body($($arg),*)
                }
                // SAFETY: AVX-512 F/BW/VL were detected (BW implies F).
                return unsafe { wide($($arg),*) };
            }
            body($($arg),*)
        }
    };
}

/// Two bf16 values as the pair AMX reads: `first` in the low half.
#[inline(always)]
fn pair(first: u16, second: u16) -> u32 {
    first as u32 | (second as u32) << 16
}

/// The bits of `x` rounded to bf16, to nearest even (NaN stays a quiet NaN), in the low half:
/// `half::bf16::from_f32` written without branches, so that it vectorises.
#[inline(always)]
fn bf16_bits(x: f32) -> u32 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    if x.is_nan() {
        (b >> 16) | 0x40
    } else {
        rounded
    }
}

/// `x` as the pair `(hi, lo)` of bf16 values, `hi + lo` within 2^-16 of `x` relative
/// (`lo = 0` where `hi` is infinite).
#[inline(always)]
fn split(x: f32) -> u32 {
    let hi = bf16_bits(x);
    let hi_value = f32::from_bits(hi << 16);
    let lo = if hi_value.is_finite() { bf16_bits(x - hi_value) } else { 0 };
    hi | lo << 16
}

vectorised! {
    /// `dst = split(src)`, then zeros.
    fn split_row(dst: &mut [u32], src: &[f32]) {
        let (head, tail) = dst.split_at_mut(src.len());
        for (d, &x) in head.iter_mut().zip(src) {
            *d = split(x);
        }
        tail.fill(0);
    }
}

vectorised! {
    /// `dst` = the pairs of `src`'s consecutive elements, then zeros.
    fn pair_row(dst: &mut [u32], src: &[u16]) {
        let (pairs, odd) = src.as_chunks::<2>();
        let (head, tail) = dst.split_at_mut(src.len().div_ceil(2));
        for (d, &[first, second]) in head.iter_mut().zip(pairs) {
            *d = pair(first, second);
        }
        if let [x] = odd {
            head[pairs.len()] = pair(*x, 0);
        }
        tail.fill(0);
    }
}

vectorised! {
    /// Panels `first..` of `b_from_rows_duplicated`'s B (as many as `panels` holds, `half_k`
    /// pair-rows each): panel row `r` = the pairs `(x, x)` of `src` row `r`'s 16 columns.
    fn duplicate_panels(panels: &mut [u32], half_k: usize, first: usize, src: &[u16], stride: usize, rows: usize, cols: usize) {
        let count = panels.len() / (16 * half_k).max(1);
        // Row by row, each source row read once along its length: panel by panel, the reads
        // went down a column of rows 2 H bytes apart and waited on memory (issue 17).
        for r in 0..half_k {
            prefetch_row(src, (r + AHEAD) * stride + 16 * first, 16 * count);
            for p in 0..count {
                let dst = &mut panels[(p * half_k + r) * 16..][..16];
                let c0 = 16 * (first + p);
                let width = cols.saturating_sub(c0).min(16);
                let src_row = if r < rows && width > 0 { &src[r * stride + c0..r * stride + c0 + width] } else { &[] };
                let (head, tail) = dst.split_at_mut(src_row.len());
                for (d, &x) in head.iter_mut().zip(src_row) {
                    *d = pair(x, x);
                }
                tail.fill(0);
            }
        }
    }
}

/// Panel rows of a VNNI B from the rows of `src` (`rows x cols`, row stride `stride`): panel `p`
/// (columns `16 (first + p)..`), row `k'` = the pairs `(bits(src[2k', j]), bits(src[2k' + 1, j]))`,
/// zero past `rows` and `cols`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn interleave_body<T: Copy>(
    panels: &mut [u32],
    half_k: usize,
    first: usize,
    src: &[T],
    stride: usize,
    rows: usize,
    cols: usize,
    bits: impl Fn(T) -> u32,
) {
    let count = panels.len() / (16 * half_k).max(1);
    // Row pair by row pair, as `duplicate_panels`.
    for k in 0..half_k {
        prefetch_row(src, (2 * k + AHEAD) * stride + 16 * first, 16 * count);
        prefetch_row(src, (2 * k + 1 + AHEAD) * stride + 16 * first, 16 * count);
        for p in 0..count {
            let dst = &mut panels[(p * half_k + k) * 16..][..16];
            let c0 = 16 * (first + p);
            let width = cols.saturating_sub(c0).min(16);
            let row =
                |r: usize| if r < rows && width > 0 { &src[r * stride + c0..r * stride + c0 + width] } else { &[] };
            let (even, odd) = (row(2 * k), row(2 * k + 1));
            if let (Ok(even), Ok(odd)) = (<&[T; 16]>::try_from(even), <&[T; 16]>::try_from(odd)) {
                // A whole panel row (the common case), in fixed-size arrays so that it vectorises:
                // with the per-element bounds below the loop stayed scalar (issue 17).
                for (d, (&lo, &hi)) in dst.iter_mut().zip(even.iter().zip(odd)) {
                    *d = bits(lo) | bits(hi) << 16;
                }
                continue;
            }
            for (i, d) in dst.iter_mut().enumerate() {
                let lo = even.get(i).map_or(0, |&x| bits(x));
                let hi = odd.get(i).map_or(0, |&x| bits(x));
                *d = lo | hi << 16;
            }
        }
    }
}

vectorised! {
    /// [`interleave_body`] on bf16 bits.
    fn interleave_panels(panels: &mut [u32], half_k: usize, first: usize, src: &[u16], stride: usize, rows: usize, cols: usize) {
        interleave_body(panels, half_k, first, src, stride, rows, cols, |x| x as u32)
    }
}

vectorised! {
    /// [`interleave_body`] on f32 rounded to bf16.
    fn interleave_panels_rounded(panels: &mut [u32], half_k: usize, first: usize, src: &[f32], stride: usize, rows: usize, cols: usize) {
        interleave_body(panels, half_k, first, src, stride, rows, cols, bf16_bits)
    }
}

vectorised! {
    /// `dst` = the pairs of `src`'s consecutive elements rounded to bf16, then zeros.
    fn rounded_pair_row(dst: &mut [u32], src: &[f32]) {
        let (head, tail) = dst.split_at_mut(src.len().div_ceil(2));
        for (d, p) in head.iter_mut().zip(src.chunks(2)) {
            *d = bf16_bits(p[0]) | p.get(1).map_or(0, |&x| bf16_bits(x)) << 16;
        }
        tail.fill(0);
    }
}

/// A = the f32 matrix `src` (`rows x cols`, row stride `stride`) rounded to bf16.
pub fn a_from_f32_rounded(src: &[f32], stride: usize, rows: usize, cols: usize, out: &mut PackedA) {
    out.reset(rows, cols);
    let half_k = out.k / 2;
    out.data.par_chunks_mut(out.stride / 2).enumerate().for_each(|(r, dst)| {
        let row: &[f32] = if r < rows { &src[r * stride..r * stride + cols] } else { &[] };
        rounded_pair_row(&mut dst[..half_k], row);
    });
}

/// B = `src` (`rows x cols` bf16 bits, row stride `stride`), as it is: `B[k, j] = src[k, j]`.
pub fn b_from_rows(src: &[u16], stride: usize, rows: usize, cols: usize, out: &mut PackedB) {
    out.reset(rows, cols);
    let half_k = out.k / 2;
    out.data.par_chunks_mut((16 * half_k * PANELS_PER_TASK).max(1)).enumerate().for_each(|(t, panels)| {
        interleave_panels(panels, half_k, t * PANELS_PER_TASK, src, stride, rows, cols);
    });
}

/// B = the f32 matrix `src` (`rows x cols`, row stride `stride`) rounded to bf16.
pub fn b_from_f32_rounded(src: &[f32], stride: usize, rows: usize, cols: usize, out: &mut PackedB) {
    out.reset(rows, cols);
    let half_k = out.k / 2;
    out.data.par_chunks_mut((16 * half_k * PANELS_PER_TASK).max(1)).enumerate().for_each(|(t, panels)| {
        interleave_panels_rounded(panels, half_k, t * PANELS_PER_TASK, src, stride, rows, cols);
    });
}

/// A = the transpose of `src` (`rows x cols` bf16 bits, row-major): `A[j, r] = src[r, j]`.
pub fn a_from_transposed(src: &[u16], rows: usize, cols: usize, out: &mut PackedA) {
    out.reset(cols, rows);
    out.data.par_chunks_mut(out.stride / 2).enumerate().for_each(|(j, dst)| {
        dst.fill(0);
        if j < cols {
            for (r, d) in (0..rows).step_by(2).zip(dst.iter_mut()) {
                let odd = if r + 1 < rows { src[(r + 1) * cols + j] } else { 0 };
                *d = pair(src[r * cols + j], odd);
            }
        }
    });
}

/// A = `src[r * stride + c]` for `r < rows`, `c < cols` (bf16 bits).
pub fn a_from_rows(src: &[u16], stride: usize, rows: usize, cols: usize, out: &mut PackedA) {
    out.reset(rows, cols);
    let half_k = out.k / 2;
    for (r, dst) in out.data.chunks_mut(out.stride / 2).enumerate() {
        let row: &[u16] = if r < rows { &src[r * stride..r * stride + cols] } else { &[] };
        pair_row(&mut dst[..half_k], row);
    }
}

/// A = the f32 matrix `src` (`rows x cols`, row stride `stride`) with each element split into its
/// `(hi, lo)` bf16 pair: `2 * padded(cols)` columns, so that the same buffer is also a VNNI B of
/// `padded(cols)` columns whose row pairs are `(hi, lo)` (rows `2 * out.stride` bytes apart).
pub fn a_from_f32_split(src: &[f32], stride: usize, rows: usize, cols: usize, out: &mut PackedA) {
    out.reset(rows, 2 * padded(cols));
    let half_k = out.k / 2;
    out.data.par_chunks_mut(out.stride / 2).enumerate().for_each(|(r, dst)| {
        let row: &[f32] = if r < rows { &src[r * stride..r * stride + cols] } else { &[] };
        split_row(&mut dst[..half_k], row);
    });
}

/// A = the transpose of `src` (`rows x cols` bf16 bits, row-major) with every element twice
/// along k: `A[j, 2r] = A[j, 2r + 1] = src[r, j]`, the partner of a split B.
pub fn a_from_transposed_duplicated(src: &[u16], rows: usize, cols: usize, out: &mut PackedA) {
    out.reset(cols, 2 * rows);
    let row_pairs = out.stride / 2;
    out.data.par_chunks_mut(16 * row_pairs).enumerate().for_each(|(block, dst)| {
        dst.fill(0);
        let c0 = 16 * block;
        let width = cols.saturating_sub(c0).min(16);
        if width == 0 {
            return;
        }
        for r in 0..rows {
            for (i, &x) in src[r * cols + c0..r * cols + c0 + width].iter().enumerate() {
                dst[i * row_pairs + r] = pair(x, x);
            }
        }
    });
}

/// B = the transpose of `src` (`cols x k` bf16 bits, row stride `stride`): `B[k, j] = src[j, k]`.
pub fn b_from_transposed(src: &[u16], stride: usize, cols: usize, k: usize, out: &mut PackedB) {
    out.reset(k, cols);
    let panel_len = out.k * 8;
    out.data.par_chunks_mut(panel_len.max(1)).enumerate().for_each(|(p, panel)| {
        panel.fill(0);
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
    let half_k = out.k / 2;
    out.data.par_chunks_mut((16 * half_k * PANELS_PER_TASK).max(1)).enumerate().for_each(|(t, panels)| {
        duplicate_panels(panels, half_k, t * PANELS_PER_TASK, src, stride, rows, cols);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Lines` resizes as `Vec` does, on cache lines.
    #[test]
    fn lines_resize_as_a_vec() {
        let (mut lines, mut vec) = (Lines::default(), Vec::<u32>::new());
        for (len, value) in [(5, 1), (3, 2), (40, 3), (17, 4), (100, 5), (0, 6), (21, 7)] {
            lines.resize(len, value);
            vec.resize(len, value);
            assert_eq!(&lines[..], &vec[..], "len {len}");
            assert_eq!(lines.as_ptr() as usize % 64, 0);
            let n = lines.len();
            lines.iter_mut().zip(0..).for_each(|(x, i)| *x = i * 10 + n as u32);
            vec.iter_mut().zip(0..).for_each(|(x, i)| *x = i * 10 + n as u32);
        }
    }

    /// The branch-free rounding against `half`'s on random bit patterns and the special values.
    #[test]
    fn rounding_matches_half() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let specials = [0.0f32, -0.0, 1.0, f32::MAX, f32::MIN_POSITIVE, 1e-40, f32::INFINITY, -f32::INFINITY, f32::NAN];
        let random = (0..200_000).map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            f32::from_bits(state as u32)
        });
        for x in specials.into_iter().chain(random) {
            assert_eq!(bf16_bits(x) as u16, half::bf16::from_f32(x).to_bits(), "{x:e} ({:#x})", x.to_bits());
            let (hi, lo) = (split(x) as u16, (split(x) >> 16) as u16);
            let (hi, lo) = (half::bf16::from_bits(hi).to_f64(), half::bf16::from_bits(lo).to_f64());
            if x.is_finite() && hi.is_finite() && x.abs() > 1e-30 {
                assert!((hi + lo - x as f64).abs() <= (x as f64).abs() * 2f64.powi(-16), "{x:e}: {hi} + {lo}");
            }
        }
    }
}

//! `y (+)= x @ w^T` in f32 with `w [n, k]`'s rows read in place: the product of a layer's
//! `[out, in]` weight on AVX2 machines, above all at a rollout's decode steps (a few dozen rows).
//!
//! Why not `gemm` there: it packs its right-hand operand on every call, and `w^T` read column by
//! column is a scalar gather, one weight row apart per element: at the Qwen2.5-0.5B shape on an
//! AVX2-only machine that packing was 31% of a rollout (docs/BENCHMARKS.md, "On an AVX2-only
//! machine"). Here `x` is packed instead (transposed into panels of up to 32 rows, `k` steps of
//! one vector per 8 rows, by 8 x 8 transposes in registers: small at a decode step) and each
//! weight element is broadcast from its row against a panel step: 6 weight rows x 2 vectors of
//! rows = 12 accumulators per step (fewer rows: 4 x 3, 12 x 1), the weight's rows streamed in
//! order.
//!
//! Blocking (constants measured on the AVX2-only machine of docs/BENCHMARKS.md, where the
//! results are the same bits for any of them): one task per slice of at most `ROWS_PER_TASK`
//! weight rows and group of `PANELS_PER_GROUP` panels (256 rows of `x`), about four tasks per
//! thread; `k` in blocks of `KC` steps, so that a panel's block (8 KiB) stays in L1 while the
//! slice's block passes it; the task keeps its group's partial sums (`[w row][rows]`, 96 KiB,
//! in L2 with the group's blocks of `x`), the slice's block packed once per group for them.
//! (Groups of 32 panels: 384 KiB of sums, and a large batch split into fewer tasks; at 1,024 rows
//! the 128 key / value rows ran at 0.73-1.01x `gemm` with them, 0.82-1.11x with 8, within the
//! VM's noise elsewhere.) A decode step (one panel) reads the weight in place in longer blocks
//! (`KC_ONE_PANEL`), each row a run the prefetcher follows.
//!
//! Each output is one FMA chain over `k` in order, from zero: `acc = fma(x[i, p], w[j, p], acc)`
//! for `p = 0..k` (the chain's partial value stored and reloaded exactly between blocks), then
//! `y = acc` or `y = y + acc`. Nothing in it depends on the number of rows, on where a row falls in
//! a panel, on the blocking or on the thread count: every row gets the same bits in any batch (the
//! rollout's one-row steps and the update's thousands, as `grpo.batch_invariant` promises), and
//! the same bits as [`reference`](fn@reference).

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::{Mat, MatMut};
use crate::scratch::with_scratch;

/// f32 lanes of a vector.
const LANES: usize = 8;
/// Rows of `x` per panel: four vectors.
const PANEL: usize = 4 * LANES;
/// Steps of `k` per block of a group of panels: a full panel's block is 8 KiB.
const KC: usize = 64;
/// Steps of `k` per block when a group is one panel (a decode step): long runs of each weight
/// row for the prefetcher, the panel's block in L2.
const KC_ONE_PANEL: usize = 512;
/// Panels of a task, whose partial sums it keeps while it passes its weight slice over them.
const PANELS_PER_GROUP: usize = 8;
/// The most weight rows per task (a multiple of every tile's 3, 4, 6 and 12 rows).
const ROWS_PER_TASK: usize = 96;

/// Whether this CPU runs [`product`] (AVX2 and FMA).
pub fn available() -> bool {
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
}

/// `y (+)= x @ w^T` (`y [m, n]` with any row stride, `x [m, k]`, `w [n, k]`), as described above.
///
/// # Panics
/// If the shapes disagree or the CPU lacks AVX2 or FMA ([`available`]).
pub fn product(y: &mut MatMut<'_>, accumulate: bool, x: Mat<'_>, w: Mat<'_>) {
    assert!(available(), "the weight-rows product needs AVX2 and FMA");
    assert!(y.rows == x.rows && y.cols == w.rows && x.cols == w.cols, "shapes of y, x and w disagree");
    x.check();
    w.check();
    y.check();
    let (m, n, k) = (y.rows, y.cols, x.cols);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        // No terms: every sum is zero (and there are no steps to pack).
        for r in 0..m {
            for v in &mut y.data[r * y.stride..r * y.stride + n] {
                *v = if accumulate { *v + 0.0 } else { 0.0 };
            }
        }
        return;
    }
    with_scratch(&PACKED, |packed| {
        pack_panels(packed, x);
        let panels = m.div_ceil(PANEL);
        let groups = panels.div_ceil(PANELS_PER_GROUP);
        let rows_per_task = rows_per_task(n, groups);
        let slices = n.div_ceil(rows_per_task);
        let out = OutPtr { data: y.data.as_mut_ptr(), stride: y.stride };
        let (packed, w) = (&packed[..], w);
        // Group-major: the threads share a group's packed rows while they pass their slices.
        (0..groups * slices).into_par_iter().for_each(|t| {
            let (g, s) = (t / slices, t % slices);
            let rows = s * rows_per_task..(n.min((s + 1) * rows_per_task));
            let group = g * PANELS_PER_GROUP..panels.min((g + 1) * PANELS_PER_GROUP);
            with_scratch(&SUMS, |sums| {
                with_scratch(&WEIGHT_BLOCK, |weight_block| {
                    // SAFETY: `available()` was asserted; tasks write disjoint blocks (rows of
                    // `group`, columns `rows`) of `y` (bounded by `y.check()`), and read `packed`
                    // and `w` only.
                    unsafe { task(out, accumulate, packed, m, k, w, rows, group, sums, weight_block) }
                })
            });
        });
    });
}

/// `y (+)= x @ w^T` one FMA chain per output, in the order of [`product`]: its bitwise reference.
pub fn reference(y: &mut MatMut<'_>, accumulate: bool, x: Mat<'_>, w: Mat<'_>) {
    assert!(y.rows == x.rows && y.cols == w.rows && x.cols == w.cols, "shapes of y, x and w disagree");
    for i in 0..y.rows {
        for j in 0..y.cols {
            let xi = &x.data[i * x.stride..i * x.stride + x.cols];
            let wj = &w.data[j * w.stride..j * w.stride + w.cols];
            let acc = xi.iter().zip(wj).fold(0.0f32, |acc, (&a, &b)| a.mul_add(b, acc));
            let out = &mut y.data[i * y.stride + j];
            *out = if accumulate { *out + acc } else { acc };
        }
    }
}

/// Weight rows per task, given the groups of panels each slice of them runs against: about four
/// tasks per thread in all (a decode step's 128 key rows on two threads: slices of 24 rows; a
/// large batch's many groups: slices as wide as they may be), at most [`ROWS_PER_TASK`], a
/// multiple of 12.
fn rows_per_task(n: usize, groups: usize) -> usize {
    let slices = (4 * rayon::current_num_threads()).div_ceil(groups);
    let wanted = n.div_ceil(slices).div_ceil(12) * 12;
    wanted.clamp(12, ROWS_PER_TASK)
}

thread_local! {
    /// `x` packed in panels (per calling thread).
    static PACKED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A task's partial sums (per worker thread).
    static SUMS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A task's weight rows of one block, packed for a group of several panels (per worker).
    static WEIGHT_BLOCK: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The rows of `x` (of `m`) in panel `g`.
fn panel_rows(m: usize, g: usize) -> usize {
    (m - g * PANEL).min(PANEL)
}

/// The lanes a panel of `rows` rows is packed with: a whole number of vectors.
fn width(rows: usize) -> usize {
    rows.div_ceil(LANES) * LANES
}

/// `x` transposed into panels of [`PANEL`] rows: panel `g` at `g * PANEL * k`, step `p` of it at
/// `p * width` (its `width(rows)` lanes: row `i` of the panel in lane `i`, zeros past its rows).
/// Every lane a task reads is written here (no clearing of the buffer first).
fn pack_panels(packed: &mut Vec<f32>, x: Mat<'_>) {
    let (m, k) = (x.rows, x.cols);
    let len = m.div_ceil(PANEL) * PANEL * k;
    if packed.len() < len {
        packed.resize(len, 0.0);
    }
    packed[..len].par_chunks_mut(PANEL * k).enumerate().for_each(|(g, panel)| {
        // SAFETY: `product` asserted AVX2 and FMA; `x.check()` bounds the rows read.
        unsafe { pack_panel(panel, x, g) }
    });
}

/// Panel `g`: blocks of 8 rows x 8 steps loaded as rows and stored as steps (an 8 x 8 transpose
/// in registers), rows past `x`'s as zeros; the last `k % 8` steps element by element.
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_panel(panel: &mut [f32], x: Mat<'_>, g: usize) {
    let (first, rows, k) = (g * PANEL, panel_rows(x.rows, g), x.cols);
    let width = width(rows);
    let out = panel.as_mut_ptr();
    for i0 in (0..rows).step_by(LANES) {
        let here = (rows - i0).min(LANES);
        let row = |r: usize| x.data.as_ptr().add((first + i0 + r) * x.stride);
        let mut p = 0;
        while p + LANES <= k {
            let mut v = [_mm256_setzero_ps(); LANES];
            for (r, v) in v.iter_mut().enumerate().take(here) {
                *v = _mm256_loadu_ps(row(r).add(p));
            }
            transpose8(&mut v);
            for (q, v) in v.iter().enumerate() {
                _mm256_storeu_ps(out.add((p + q) * width + i0), *v);
            }
            p += LANES;
        }
        for p in p..k {
            for r in 0..LANES {
                *out.add(p * width + i0 + r) = if r < here { *row(r).add(p) } else { 0.0 };
            }
        }
    }
}

/// Eight vectors of eight lanes transposed: lane `j` of vector `i` becomes lane `i` of vector `j`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn transpose8(v: &mut [__m256; LANES]) {
    let t0 = _mm256_unpacklo_ps(v[0], v[1]);
    let t1 = _mm256_unpackhi_ps(v[0], v[1]);
    let t2 = _mm256_unpacklo_ps(v[2], v[3]);
    let t3 = _mm256_unpackhi_ps(v[2], v[3]);
    let t4 = _mm256_unpacklo_ps(v[4], v[5]);
    let t5 = _mm256_unpackhi_ps(v[4], v[5]);
    let t6 = _mm256_unpacklo_ps(v[6], v[7]);
    let t7 = _mm256_unpackhi_ps(v[6], v[7]);
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    v[0] = _mm256_permute2f128_ps::<0x20>(u0, u4);
    v[1] = _mm256_permute2f128_ps::<0x20>(u1, u5);
    v[2] = _mm256_permute2f128_ps::<0x20>(u2, u6);
    v[3] = _mm256_permute2f128_ps::<0x20>(u3, u7);
    v[4] = _mm256_permute2f128_ps::<0x31>(u0, u4);
    v[5] = _mm256_permute2f128_ps::<0x31>(u1, u5);
    v[6] = _mm256_permute2f128_ps::<0x31>(u2, u6);
    v[7] = _mm256_permute2f128_ps::<0x31>(u3, u7);
}

/// `y`'s data for writes from several tasks, each to its own columns.
#[derive(Clone, Copy)]
struct OutPtr {
    data: *mut f32,
    stride: usize,
}

// SAFETY: tasks write disjoint columns through it (see `product`).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// One task: the weight rows `rows` against the panels of `group`. With more than one panel in
/// the group, each block of the weight rows is packed first as the full panels' tiles read it
/// ([`pack_weight_block`], one stream per tile instead of six; copied once for the group's
/// panels).
///
/// # Safety
/// AVX2 and FMA must be available; `out` must hold `m` rows of at least `rows.end` columns, and no
/// other task may write the group's rows at columns `rows`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
unsafe fn task(
    out: OutPtr,
    accumulate: bool,
    packed: &[f32],
    m: usize,
    k: usize,
    w: Mat<'_>,
    rows: std::ops::Range<usize>,
    group: std::ops::Range<usize>,
    sums: &mut Vec<f32>,
    weight_block: &mut Vec<f32>,
) {
    let nw = rows.len();
    sums.clear();
    sums.resize(group.len() * nw * PANEL, 0.0);
    let several = group.len() > 1;
    let kc = if several { KC } else { KC_ONE_PANEL };
    for k0 in (0..k).step_by(kc) {
        let steps = kc.min(k - k0);
        let first = rows.start * w.stride + k0;
        let packed_block = several.then(|| {
            pack_weight_block(weight_block, &w.data[first..], w.stride, nw, steps);
            weight_block.as_ptr()
        });
        let weights = Weights { in_place: w.data.as_ptr().add(first), stride: w.stride, packed: packed_block };
        for (s, g) in group.clone().enumerate() {
            let lanes = width(panel_rows(m, g));
            let xt = packed.as_ptr().add(g * PANEL * k + k0 * lanes);
            let panel_sums = sums.as_mut_ptr().add(s * nw * PANEL);
            block(xt, lanes, weights, nw, steps, panel_sums);
        }
    }
    for (s, g) in group.enumerate() {
        let (first, rows_here) = (g * PANEL, panel_rows(m, g));
        let lanes = width(rows_here);
        let panel_sums = &sums[s * nw * PANEL..];
        for i in 0..rows_here {
            let y = out.data.add((first + i) * out.stride + rows.start);
            for j in 0..nw {
                let acc = panel_sums[j * lanes + i];
                *y.add(j) = if accumulate { *y.add(j) + acc } else { acc };
            }
        }
    }
}

/// Tiles of weight rows in a packed block: [`WIDE_TILE`] rows, a step's elements adjacent.
const WIDE_TILE: usize = 6;

/// `nw` weight rows' `steps` elements from `w` (rows `stride` apart) as the full panels' tiles
/// read them: per tile of [`WIDE_TILE`] rows `[step][row]`, then each remaining row's steps.
fn pack_weight_block(block: &mut Vec<f32>, w: &[f32], stride: usize, nw: usize, steps: usize) {
    block.clear();
    let full = nw / WIDE_TILE * WIDE_TILE;
    for t in (0..full).step_by(WIDE_TILE) {
        for p in 0..steps {
            block.extend((t..t + WIDE_TILE).map(|j| w[j * stride + p]));
        }
    }
    for j in full..nw {
        block.extend_from_slice(&w[j * stride..j * stride + steps]);
    }
}

/// A block of a task's weight rows: in place (row `j`'s step `p` at `in_place + j * stride + p`)
/// and, for groups of panels, packed by [`pack_weight_block`].
#[derive(Clone, Copy)]
struct Weights {
    in_place: *const f32,
    stride: usize,
    packed: Option<*const f32>,
}

/// `k`-block `steps` of one panel (`lanes` rows) against `nw` weight rows: tiles of up to 12
/// accumulators (a full panel as two halves of 2 vectors x 6 rows: 4 x 3 would need 17 of AVX2's
/// 16 registers), then single weight rows for what remains. Sums are `[w row][lanes]`.
#[target_feature(enable = "avx2,fma")]
unsafe fn block(xt: *const f32, lanes: usize, w: Weights, nw: usize, steps: usize, sums: *mut f32) {
    macro_rules! tiles {
        ($r:literal, $c:literal, $first:expr) => {{
            let (xt, sums) = (xt.add($first), sums.add($first));
            let mut j = 0;
            while j + $c <= nw {
                let sums = sums.add(j * lanes);
                match w.packed {
                    Some(p) if $c == WIDE_TILE => tile::<$r, $c>(xt, lanes, p.add(j * steps), 1, $c, steps, sums),
                    _ => tile::<$r, $c>(xt, lanes, w.in_place.add(j * w.stride), w.stride, 1, steps, sums),
                }
                j += $c;
            }
            while j < nw {
                let sums = sums.add(j * lanes);
                match w.packed {
                    Some(p) if $c == WIDE_TILE => tile::<$r, 1>(xt, lanes, p.add(j * steps), 0, 1, steps, sums),
                    _ => tile::<$r, 1>(xt, lanes, w.in_place.add(j * w.stride), 0, 1, steps, sums),
                }
                j += 1;
            }
        }};
    }
    match lanes / LANES {
        1 => tiles!(1, 12, 0),
        2 => tiles!(2, 6, 0),
        3 => tiles!(3, 4, 0),
        _ => {
            tiles!(2, 6, 0);
            tiles!(2, 6, 2 * LANES);
        }
    }
}

/// `C` weight rows against `R` vectors of a panel (steps `lanes` apart) for `steps` steps, onto
/// the sums (`C` rows `lanes` apart); weight row `j`'s step `p` at `w + j * row_step + p * step`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile<const R: usize, const C: usize>(
    xt: *const f32,
    lanes: usize,
    w: *const f32,
    row_step: usize,
    step: usize,
    steps: usize,
    sums: *mut f32,
) {
    let mut acc = [[_mm256_setzero_ps(); R]; C];
    for (j, acc) in acc.iter_mut().enumerate() {
        for (r, a) in acc.iter_mut().enumerate() {
            *a = _mm256_loadu_ps(sums.add(j * lanes + r * LANES));
        }
    }
    for p in 0..steps {
        let mut xv = [_mm256_setzero_ps(); R];
        for (r, v) in xv.iter_mut().enumerate() {
            *v = _mm256_loadu_ps(xt.add(p * lanes + r * LANES));
        }
        for (j, acc) in acc.iter_mut().enumerate() {
            let wb = _mm256_broadcast_ss(&*w.add(j * row_step + p * step));
            for (a, &v) in acc.iter_mut().zip(&xv) {
                *a = _mm256_fmadd_ps(v, wb, *a);
            }
        }
    }
    for (j, acc) in acc.iter().enumerate() {
        for (r, &a) in acc.iter().enumerate() {
            _mm256_storeu_ps(sums.add(j * lanes + r * LANES), a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::normal_matrix;

    /// Shapes ragged against every blocking: rows around the vector, panel and group sizes,
    /// weight rows around the tiles and tasks, `k` around the block.
    const SHAPES: [(usize, usize, usize); 10] = [
        (4, 5, 0),
        (1, 1, 1),
        (3, 5, 7),
        (8, 12, 128),
        (9, 13, 129),
        (17, 97, 300),
        (31, 130, 64),
        (33, 200, 257),
        (70, 41, 896),
        (300, 29, 40),
    ];

    fn run(m: usize, n: usize, k: usize, accumulate: bool, f: fn(&mut MatMut<'_>, bool, Mat<'_>, Mat<'_>)) -> Vec<f32> {
        let x = normal_matrix(m, k, 1.0, 1);
        let w = normal_matrix(n, k, 0.1, 2);
        // `y` with a row stride wider than its columns, filled where `accumulate` adds to it.
        let stride = n + 3;
        let mut y: Vec<f32> = (0..m * stride).map(|i| (i as f32 * 0.01).sin()).collect();
        f(&mut MatMut { data: &mut y, rows: m, cols: n, stride }, accumulate, Mat::new(&x, m, k), Mat::new(&w, n, k));
        y
    }

    #[test]
    fn the_product_is_its_references_bits_on_ragged_shapes() {
        if !available() {
            return;
        }
        for (m, n, k) in SHAPES {
            for accumulate in [false, true] {
                let got = run(m, n, k, accumulate, product);
                let want = run(m, n, k, accumulate, reference);
                assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{m}x{n}x{k}, {accumulate}");
            }
        }
    }

    #[test]
    fn the_reference_matches_f64_sums() {
        for (m, n, k) in SHAPES {
            let (x, w) = (normal_matrix(m, k, 1.0, 1), normal_matrix(n, k, 0.1, 2));
            let mut y = vec![0.0f32; m * n];
            reference(&mut MatMut::new(&mut y, m, n), false, Mat::new(&x, m, k), Mat::new(&w, n, k));
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k).map(|p| x[i * k + p] as f64 * w[j * k + p] as f64).sum();
                    let scale: f64 = (0..k).map(|p| (x[i * k + p] as f64 * w[j * k + p] as f64).abs()).sum();
                    assert!(
                        (y[i * n + j] as f64 - want).abs() <= 1e-6 * (scale + 1e-30) * (k as f64).sqrt(),
                        "{m}x{n}x{k} [{i}, {j}]"
                    );
                }
            }
        }
    }

    /// Each row's result is the same bits in a batch of any size and for any thread count.
    #[test]
    fn a_rows_product_does_not_depend_on_the_batch_or_the_threads() {
        if !available() {
            return;
        }
        let (m, n, k) = (45, 140, 300);
        let (x, w) = (normal_matrix(m, k, 1.0, 3), normal_matrix(n, k, 0.1, 4));
        let mut all = vec![0.0f32; m * n];
        product(&mut MatMut::new(&mut all, m, n), false, Mat::new(&x, m, k), Mat::new(&w, n, k));
        for rows in [1, 2, 7, 8, 9, 16, 24, 32, 33, 44] {
            for first in [0, m - rows] {
                let mut part = vec![0.0f32; rows * n];
                let xs = &x[first * k..(first + rows) * k];
                product(&mut MatMut::new(&mut part, rows, n), false, Mat::new(xs, rows, k), Mat::new(&w, n, k));
                assert_eq!(part, all[first * n..(first + rows) * n], "{rows} rows from {first}");
            }
        }
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
            let mut y = vec![0.0f32; m * n];
            pool.install(|| product(&mut MatMut::new(&mut y, m, n), false, Mat::new(&x, m, k), Mat::new(&w, n, k)));
            assert_eq!(y, all, "{threads} threads");
        }
    }
}

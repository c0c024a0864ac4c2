//! Row-major f32 matrix products through the `gemm` crate (the one candle uses: runtime-dispatched
//! AVX-512 / AVX2 / NEON micro-kernels; its AVX-512 ones only with its `x86-v4` feature, which the
//! workspace turns on: on Zen 5's full-width AVX-512 they run 1.75x its AVX2 ones, ~450 GFLOP/s on
//! 2 cores, docs/BENCHMARKS.md "gemm's AVX-512 kernels"). Each output element's reduction runs in
//! one fixed order whatever the thread count (`gemm` splits the output, not the reduction), which
//! keeps the losses deterministic.
//!
//! The three products of a layer `y = x @ w^T`, and of a fused-linear loss (for a chunk of `n`
//! rows, a vocabulary tile of `v` columns, hidden size `h`):
//! - [`matmul_nt`], forward: `z[n, v] = hc[n, h] @ wt[v, h]^T` (into a buffer with any row stride);
//! - [`matmul_nn`], input gradient: `dh[n, h] (+)= dz[n, v] @ wt[v, h]`;
//! - [`matmul_tn`], weight gradient: `dw[v, h] (+)= dz[n, v]^T @ hc[n, h]`.
//!
//! On AVX2 machines without AVX-512 the forward runs [`weight_rows`] instead (the weight read in
//! place: `gemm` packs all of it on every call, a third of a rollout's decode steps there); on
//! AVX-512 machines `gemm`'s wider kernels stay (the weight-rows kernel is AVX2 and not measured
//! against them). Either way one machine computes every forward product with one kernel, so the
//! sampler's products and the update's agree bit for bit.

use gemm::{gemm, Parallelism};

use crate::scratch::with_scratch;

#[cfg(target_arch = "x86_64")]
pub mod weight_rows;

/// A row-major matrix view: `rows x cols` with `stride` elements between rows.
#[derive(Clone, Copy)]
pub struct Mat<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub stride: usize,
}

/// A mutable row-major matrix view.
pub struct MatMut<'a> {
    pub data: &'a mut [f32],
    pub rows: usize,
    pub cols: usize,
    pub stride: usize,
}

impl<'a> Mat<'a> {
    /// A contiguous `rows x cols` matrix.
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self { data, rows, cols, stride: cols }
    }

    fn check(&self) {
        assert!(self.rows == 0 || self.cols == 0 || self.data.len() >= (self.rows - 1) * self.stride + self.cols);
    }
}

impl<'a> MatMut<'a> {
    /// A contiguous `rows x cols` matrix.
    pub fn new(data: &'a mut [f32], rows: usize, cols: usize) -> Self {
        Self { data, rows, cols, stride: cols }
    }

    fn check(&self) {
        assert!(self.rows == 0 || self.cols == 0 || self.data.len() >= (self.rows - 1) * self.stride + self.cols);
    }
}

fn parallelism() -> Parallelism {
    match rayon::current_num_threads() {
        1 => Parallelism::None,
        n => Parallelism::Rayon(n),
    }
}

/// An operand of [`product`]: elements at `data[row * rs + col * cs]`.
#[derive(Clone, Copy)]
struct Strided<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

/// `out (+)= lhs @ rhs`, where `lhs` is `m x k` and `rhs` is `k x n`; `out` is row-major `m x n`
/// with row stride `out.stride`.
fn product(out: &mut MatMut<'_>, accumulate: bool, k: usize, lhs: Strided<'_>, rhs: Strided<'_>) {
    out.check();
    let (m, n) = (out.rows, out.cols);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                out.data[r * out.stride..r * out.stride + n].fill(0.0);
            }
        }
        return;
    }
    assert!(lhs.data.len() > (m - 1) * lhs.rs + (k - 1) * lhs.cs, "lhs too short");
    assert!(rhs.data.len() > (k - 1) * rhs.rs + (n - 1) * rhs.cs, "rhs too short");
    if m < invariant_rows(n) && batch_invariant() {
        return padded(out, accumulate, k, lhs, rhs);
    }
    // SAFETY: the asserts above bound every element `gemm` reads (lhs, rhs) and writes (out)
    // within the slices; the slices do not overlap (`out` is borrowed mutably).
    unsafe {
        gemm(
            m,
            n,
            k,
            out.data.as_mut_ptr(),
            1,
            out.stride as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism(),
        );
    }
}

/// `gemm` computes a single row (matrix-vector) and small products (at most 256 output elements)
/// with other kernels than its matrix ones, whose reduction order differs by a few ulp: a row's
/// product would then depend on how many rows are computed with it, and the rollout's last decode
/// steps (a few rows still generating) would score tokens differently from the update's forward of
/// the same tokens. Products of fewer rows than [`invariant_rows`] are computed as that many rows
/// (zero-padded), which makes every row's result independent of its batch (measured on every
/// `(k, n)` of the models here; tested below).
pub const BATCH_INVARIANT_ROWS: usize = 8;

static BATCH_INVARIANT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Turns the padding of small products on (the default) or off, for the whole process. Off, a
/// decode step of one row runs `gemm`'s matrix-vector kernel: at the Qwen2.5-0.5B shape on this
/// project's 2-core machine, one row generates 2x faster, four rows 1.4x (docs/BENCHMARKS.md), at
/// the price of log-probabilities a few ulp from the update's for the tokens drawn there. Where
/// the forward runs [`weight_rows`] (AVX2 machines) nothing is padded and this changes nothing:
/// that kernel is batch-invariant by construction.
pub fn set_batch_invariant(on: bool) {
    BATCH_INVARIANT.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether small products are padded (see [`set_batch_invariant`]).
pub fn batch_invariant() -> bool {
    BATCH_INVARIANT.load(std::sync::atomic::Ordering::Relaxed)
}

/// The fewest rows a product of `n` columns runs with: at least [`BATCH_INVARIANT_ROWS`], and
/// more than 256 output elements.
pub fn invariant_rows(n: usize) -> usize {
    BATCH_INVARIANT_ROWS.max(256 / n.max(1) + 1)
}

thread_local! {
    /// The padded operands of [`padded`], kept per thread.
    static PADDED: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// [`product`] of `m < invariant_rows(n)` rows through a zero-padded copy of that many rows.
fn padded(out: &mut MatMut<'_>, accumulate: bool, k: usize, lhs: Strided<'_>, rhs: Strided<'_>) {
    let (m, n) = (out.rows, out.cols);
    let rows = invariant_rows(n);
    // `product` below runs gemm's rayon loop, which may re-enter here on this thread.
    with_scratch(&PADDED, |(a, c)| {
        a.clear();
        a.resize(rows * k, 0.0);
        for r in 0..m {
            for (j, x) in a[r * k..(r + 1) * k].iter_mut().enumerate() {
                *x = lhs.data[r * lhs.rs + j * lhs.cs];
            }
        }
        c.clear();
        c.resize(rows * n, 0.0);
        if accumulate {
            for r in 0..m {
                c[r * n..(r + 1) * n].copy_from_slice(&out.data[r * out.stride..r * out.stride + n]);
            }
        }
        product(&mut MatMut::new(c, rows, n), accumulate, k, Strided { data: a, rs: k, cs: 1 }, rhs);
        for r in 0..m {
            out.data[r * out.stride..r * out.stride + n].copy_from_slice(&c[r * n..(r + 1) * n]);
        }
    });
}

/// `z (+)= hc @ wt^T`: e.g. logits of `hc.rows` rows over `wt.rows` vocabulary entries.
pub fn matmul_nt(z: &mut MatMut<'_>, accumulate: bool, hc: Mat<'_>, wt: Mat<'_>) {
    hc.check();
    wt.check();
    assert!(z.rows == hc.rows && z.cols == wt.rows && hc.cols == wt.cols);
    #[cfg(target_arch = "x86_64")]
    if forward_reads_weight_rows() {
        return weight_rows::product(z, accumulate, hc, wt);
    }
    let (lhs, rhs) = (Strided { data: hc.data, rs: hc.stride, cs: 1 }, Strided { data: wt.data, rs: 1, cs: wt.stride });
    product(z, accumulate, hc.cols, lhs, rhs);
}

/// Whether [`matmul_nt`] runs [`weight_rows`] on this thread: at the AVX2 level of the row
/// kernels ([`crate::Isa`]: an AVX2 machine, or `FLASHGRPO_ISA=avx2` / `with_isa` on a better one).
#[cfg(target_arch = "x86_64")]
pub fn forward_reads_weight_rows() -> bool {
    crate::cpu::isa::current() == crate::Isa::Avx2
}

/// `dh (+)= dz @ wt`.
pub fn matmul_nn(dh: &mut MatMut<'_>, accumulate: bool, dz: Mat<'_>, wt: Mat<'_>) {
    dz.check();
    wt.check();
    assert!(dh.rows == dz.rows && dz.cols == wt.rows && dh.cols == wt.cols);
    let (lhs, rhs) = (Strided { data: dz.data, rs: dz.stride, cs: 1 }, Strided { data: wt.data, rs: wt.stride, cs: 1 });
    product(dh, accumulate, dz.cols, lhs, rhs);
}

/// `dw (+)= dz^T @ hc`.
pub fn matmul_tn(dw: &mut MatMut<'_>, accumulate: bool, dz: Mat<'_>, hc: Mat<'_>) {
    dz.check();
    hc.check();
    assert!(dw.rows == dz.cols && dz.rows == hc.rows && dw.cols == hc.cols);
    let (lhs, rhs) = (Strided { data: dz.data, rs: 1, cs: dz.stride }, Strided { data: hc.data, rs: hc.stride, cs: 1 });
    product(dw, accumulate, dz.rows, lhs, rhs);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::normal_matrix;

    fn naive(
        a: &[f32],
        b: &[f32],
        m: usize,
        k: usize,
        n: usize,
        at: impl Fn(&[f32], usize, usize) -> f32,
        bt: impl Fn(&[f32], usize, usize) -> f32,
    ) -> Vec<f64> {
        (0..m * n).map(|x| (0..k).map(|p| at(a, x / n, p) as f64 * bt(b, p, x % n) as f64).sum()).collect()
    }

    #[test]
    fn the_three_products_match_naive_loops() {
        let (n, h, v) = (5, 7, 11);
        let hc: Vec<f32> = (0..n * h).map(|i| (i as f32 * 0.37).sin()).collect();
        let wt: Vec<f32> = (0..v * h).map(|i| (i as f32 * 0.11).cos()).collect();
        let dz: Vec<f32> = (0..n * v).map(|i| (i as f32 * 0.23).sin()).collect();
        let close = |got: &[f32], want: &[f64]| got.iter().zip(want).all(|(g, w)| (*g as f64 - w).abs() < 1e-4);

        let mut z = vec![0.0; n * v];
        matmul_nt(
            &mut MatMut { data: &mut z, rows: n, cols: v, stride: v },
            false,
            Mat { data: &hc, rows: n, cols: h, stride: h },
            Mat { data: &wt, rows: v, cols: h, stride: h },
        );
        assert!(close(&z, &naive(&hc, &wt, n, h, v, |a, i, p| a[i * h + p], |b, p, j| b[j * h + p])));

        let mut dh = vec![1.0; n * h];
        matmul_nn(
            &mut MatMut { data: &mut dh, rows: n, cols: h, stride: h },
            true,
            Mat { data: &dz, rows: n, cols: v, stride: v },
            Mat { data: &wt, rows: v, cols: h, stride: h },
        );
        let want: Vec<f64> = naive(&dz, &wt, n, v, h, |a, i, p| a[i * v + p], |b, p, j| b[p * h + j])
            .into_iter()
            .map(|x| x + 1.0)
            .collect();
        assert!(close(&dh, &want));

        let mut dw = vec![0.0; v * h];
        matmul_tn(
            &mut MatMut { data: &mut dw, rows: v, cols: h, stride: h },
            false,
            Mat { data: &dz, rows: n, cols: v, stride: v },
            Mat { data: &hc, rows: n, cols: h, stride: h },
        );
        assert!(close(&dw, &naive(&dz, &hc, v, n, h, |a, j, p| a[p * v + j], |b, p, k| b[p * h + k])));
    }

    /// Every row's product is the same bits whatever the number of rows computed with it (the
    /// rollout's decode batches shrink to one row; the update computes hundreds).
    #[test]
    fn a_rows_product_does_not_depend_on_the_batch() {
        // Every level: `gemm` padded (generic, AVX-512) and the weight-rows kernel (AVX2).
        for isa in crate::Isa::available() {
            crate::with_isa(isa, a_rows_product_does_not_depend_on_the_batch_at_this_level);
        }
    }

    fn a_rows_product_does_not_depend_on_the_batch_at_this_level() {
        // The last three: Qwen2.5-0.5B's key / value, MLP up and MLP down products (gemm's
        // AVX-512 kernels, since its `x86-v4` feature is on, block differently from its AVX2 ones).
        let shapes =
            [(32, 97), (64, 300), (32, 16), (64, 32), (128, 64), (896, 1000), (896, 128), (896, 4864), (4864, 896)];
        for (h, v) in shapes {
            let m = 40;
            let x = normal_matrix(m, h, 1.0, 1);
            let w = normal_matrix(v, h, 0.1, 2);
            let mut all = vec![0.0f32; m * v];
            matmul_nt(&mut MatMut::new(&mut all, m, v), false, Mat::new(&x, m, h), Mat::new(&w, v, h));
            for rows in 1..m {
                let mut part = vec![0.0f32; rows * v];
                matmul_nt(
                    &mut MatMut::new(&mut part, rows, v),
                    false,
                    Mat::new(&x[..rows * h], rows, h),
                    Mat::new(&w, v, h),
                );
                assert_eq!(part, all[..rows * v], "h = {h}, v = {v}, {rows} rows");
                // Accumulating into a row with a stride, too.
                let mut acc = vec![1.0f32; rows * (v + 3)];
                let mut out = MatMut { data: &mut acc, rows, cols: v, stride: v + 3 };
                matmul_nt(&mut out, true, Mat::new(&x[..rows * h], rows, h), Mat::new(&w, v, h));
                for r in 0..rows {
                    let want: Vec<f32> = all[r * v..(r + 1) * v].iter().map(|z| z + 1.0).collect();
                    let got = &acc[r * (v + 3)..r * (v + 3) + v];
                    let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                    assert!(worst <= 1e-5, "{worst}");
                }
            }
        }
    }
}

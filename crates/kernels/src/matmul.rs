//! Row-major f32 matrix products through the `gemm` crate (the one candle uses: runtime-dispatched
//! AVX-512 / AVX2 / NEON micro-kernels, ~200 GFLOP/s on this project's 2-core machine). Each output
//! element's reduction runs in one fixed order whatever the thread count (`gemm` splits the
//! output, not the reduction), which keeps the losses deterministic.
//!
//! The three products of a layer `y = x @ w^T`, and of a fused-linear loss (for a chunk of `n`
//! rows, a vocabulary tile of `v` columns, hidden size `h`):
//! - [`matmul_nt`], forward: `z[n, v] = hc[n, h] @ wt[v, h]^T` (into a buffer with any row stride);
//! - [`matmul_nn`], input gradient: `dh[n, h] (+)= dz[n, v] @ wt[v, h]`;
//! - [`matmul_tn`], weight gradient: `dw[v, h] (+)= dz[n, v]^T @ hc[n, h]`.

use gemm::{gemm, Parallelism};

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

/// `out (+)= lhs @ rhs`, where `lhs` is `m x k` with element strides `(lhs_rs, lhs_cs)` and `rhs`
/// is `k x n` with `(rhs_rs, rhs_cs)`; `out` is row-major `m x n` with row stride `out.stride`.
#[allow(clippy::too_many_arguments)]
fn product(
    out: &mut MatMut<'_>,
    accumulate: bool,
    k: usize,
    lhs: &[f32],
    lhs_rs: usize,
    lhs_cs: usize,
    rhs: &[f32],
    rhs_rs: usize,
    rhs_cs: usize,
) {
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
    assert!(lhs.len() > (m - 1) * lhs_rs + (k - 1) * lhs_cs, "lhs too short");
    assert!(rhs.len() > (k - 1) * rhs_rs + (n - 1) * rhs_cs, "rhs too short");
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
            lhs.as_ptr(),
            lhs_cs as isize,
            lhs_rs as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism(),
        );
    }
}

/// `z (+)= hc @ wt^T`: e.g. logits of `hc.rows` rows over `wt.rows` vocabulary entries.
pub fn matmul_nt(z: &mut MatMut<'_>, accumulate: bool, hc: Mat<'_>, wt: Mat<'_>) {
    hc.check();
    wt.check();
    assert!(z.rows == hc.rows && z.cols == wt.rows && hc.cols == wt.cols);
    product(z, accumulate, hc.cols, hc.data, hc.stride, 1, wt.data, 1, wt.stride);
}

/// `dh (+)= dz @ wt`.
pub fn matmul_nn(dh: &mut MatMut<'_>, accumulate: bool, dz: Mat<'_>, wt: Mat<'_>) {
    dz.check();
    wt.check();
    assert!(dh.rows == dz.rows && dz.cols == wt.rows && dh.cols == wt.cols);
    product(dh, accumulate, dz.cols, dz.data, dz.stride, 1, wt.data, wt.stride, 1);
}

/// `dw (+)= dz^T @ hc`.
pub fn matmul_tn(dw: &mut MatMut<'_>, accumulate: bool, dz: Mat<'_>, hc: Mat<'_>) {
    dz.check();
    hc.check();
    assert!(dw.rows == dz.cols && dz.rows == hc.rows && dw.cols == hc.cols);
    product(dw, accumulate, dz.rows, dz.data, 1, dz.stride, hc.data, hc.stride, 1);
}

#[cfg(test)]
mod tests {
    use super::*;

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
}

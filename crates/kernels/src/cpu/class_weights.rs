//! Cross-entropy's class weights `c` in the row passes (LOSSES.md, "Class weights"): with label
//! smoothing, each row's `sum_j c_j u_j` and the gradient's last term `d c_j`, column by column.
//!
//! Passes of their own over a row, as the argmax's (`argmax.rs`): the statistics and gradient
//! loops, bound by their FP operations, stay as they are, and a loss without class weights (or
//! without label smoothing, where the weights are each row's `c_y`, a scalar) pays nothing.
//! Asked for, the sum reads the row once more and the gradient term rereads and rewrites the
//! row's gradient, both while the row is in cache (the sweep then writes the gradient with plain
//! stores, not streaming ones). A 16-bit row goes through f32 scratch rows (widened, the f32
//! kernels, the term added, rounded once), as a soft-capped row does: the term nearly cancels the
//! rest on near-uniform rows (`p_j b` against `d c_j`, both ~`s c_j / V`), where a gradient rounded to
//! bf16 before the term was added lost most of its digits.

use super::softcap::with_rows;
use super::{Finish, GradientTarget, Kernels, RowMax, Wanted};
use crate::element::Element;
use crate::objective::RowGradient;

/// Products summed at once: one AVX-512 vector of f32.
const LANES: usize = 16;
/// Columns summed in f32 lanes before their sum joins the row's in f64.
const BLOCK: usize = 1024;

/// `sum_j c_j x_j` over a row part, the products in f32, summed in 16 f32 lanes per block of
/// 1024 columns and the blocks' sums in f64 (two loops LLVM vectorises).
#[inline(always)]
pub(super) fn weighted_sum<T: Element>(row: &[T], weights: &[f32]) -> f32 {
    debug_assert_eq!(row.len(), weights.len());
    let mut total = 0.0f64;
    for (x, c) in row.chunks(BLOCK).zip(weights.chunks(BLOCK)) {
        let mut lanes = [0.0f32; LANES];
        let (mut xs, mut cs) = (x.chunks_exact(LANES), c.chunks_exact(LANES));
        for (x, c) in (&mut xs).zip(&mut cs) {
            for ((l, x), c) in lanes.iter_mut().zip(x).zip(c) {
                *l += x.to_f32() * c;
            }
        }
        let rest = xs.remainder().iter().zip(cs.remainder()).map(|(x, &c)| x.to_f32() * c);
        total += lanes.into_iter().chain(rest).fold(0.0f64, |acc, v| acc + v as f64);
    }
    total as f32
}

/// `out_j += d c_j`, in f32, rounded to the gradient's dtype.
#[inline(always)]
pub(super) fn add_weighted<T: Element>(out: &mut [T], d: f32, weights: &[f32]) {
    debug_assert_eq!(out.len(), weights.len());
    for (o, &c) in out.iter_mut().zip(weights) {
        *o = T::from_f32(o.to_f32() + d * c);
    }
}

/// A row widened to f32.
#[inline(always)]
pub(super) fn widen<T: Element>(row: &[T], out: &mut [f32]) {
    for (o, x) in out.iter_mut().zip(row) {
        *o = x.to_f32();
    }
}

/// f32 values rounded to the row's dtype.
#[inline(always)]
pub(super) fn narrow<T: Element>(values: &[f32], out: &mut [T]) {
    for (o, &v) in out.iter_mut().zip(values) {
        *o = T::from_f32(v);
    }
}

impl<T: Element> Kernels<T> {
    /// Step 3 on a row part whose `d` term is `d c_j` (`weights`: its columns' class weights):
    /// the row kernel's gradient without it, then the term added, in place for f32; through f32
    /// scratch rows for 16-bit dtypes, rounded once (`k32`: the f32 kernels of the same
    /// instruction set).
    #[allow(clippy::too_many_arguments)] // the row kernel's own arguments, and the weights
    pub(super) fn weighted_gradient(
        &self,
        k32: &Kernels<f32>,
        dst: GradientTarget<'_, T>,
        g: &RowGradient,
        inv_t: f32,
        target: Option<usize>,
        weights: &[f32],
        large: bool,
    ) {
        let (src, out) = dst.into_parts();
        if std::mem::size_of::<T>() == 4 || g.is_zero() {
            self.gradient(GradientTarget::of_parts(src, &mut *out), &g.without_d(), inv_t, target, large);
            self.add_weighted(out, g.d, weights);
            return;
        }
        with_rows(out.len(), |u, grad| {
            self.widen(src.unwrap_or(out), u);
            k32.gradient(GradientTarget::Into { logits: u, out: grad }, &g.without_d(), inv_t, target, false);
            k32.add_weighted(grad, g.d, weights);
            self.narrow(grad, out);
        })
    }

    /// [`Kernels::sweep_wanted`] of a whole row with class weights (in `wanted`). For 16-bit
    /// dtypes in two steps: the row kernel's statistics (as the forward-only pass takes them, so
    /// the loss is the same bits with or without a gradient), then [`Self::weighted_gradient`].
    #[allow(clippy::too_many_arguments)] // the row kernel's own arguments, and the weights
    pub(super) fn weighted_sweep(
        &self,
        k32: &Kernels<f32>,
        dst: GradientTarget<'_, T>,
        inv_t: f32,
        target: Option<usize>,
        wanted: Wanted<'_>,
        weights: &[f32],
        finish: Finish<'_>,
    ) -> bool {
        if std::mem::size_of::<T>() == 4 {
            return self.sweep_wanted(dst, inv_t, target, wanted, false, finish);
        }
        let (src, out) = dst.into_parts();
        let row = src.unwrap_or(out);
        let stats = self.statistics(row, inv_t, target, wanted.kernel_sum_u(), RowMax::Unneeded);
        let Some(g) = finish(self.extras(row, 0, wanted, inv_t).apply(stats)) else { return false };
        self.weighted_gradient(k32, GradientTarget::of_parts(src, out), &g, inv_t, target, weights, false);
        true
    }

    /// A row widened to f32, into `out`.
    fn widen(&self, row: &[T], out: &mut [f32]) {
        // SAFETY: `select` only picks kernels whose features `Isa::detected` found on this CPU.
        unsafe { (self.widen)(row, out) }
    }

    /// f32 values rounded into `out`.
    fn narrow(&self, values: &[f32], out: &mut [T]) {
        // SAFETY: as for `widen`.
        unsafe { (self.narrow)(values, out) }
    }

    /// `sum_j c_j x_j` of a row part, `weights` its columns' class weights.
    pub(super) fn weighted_sum(&self, row: &[T], weights: &[f32]) -> f32 {
        // SAFETY: `select` only picks kernels whose features `Isa::detected` found on this CPU.
        unsafe { (self.weighted_sum)(row, weights) }
    }

    /// Adds `d c_j` to a row part's gradient, `weights` its columns' class weights.
    pub(super) fn add_weighted(&self, out: &mut [T], d: f32, weights: &[f32]) {
        // SAFETY: as for `weighted_sum`.
        unsafe { (self.add_weighted)(out, d, weights) }
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;

    #[test]
    fn weighted_sum_matches_f64_on_ragged_rows() {
        for len in [0, 1, 15, 16, 17, 1023, 1024, 1025, 5000] {
            let x: Vec<bf16> = (0..len).map(|j| bf16::from_f32(((j * 7919) % 97) as f32 * 0.25 - 12.0)).collect();
            let c: Vec<f32> = (0..len).map(|j| ((j * 31) % 11) as f32 * 0.5 - 1.0).collect();
            let want: f64 = x.iter().zip(&c).map(|(x, &c)| x.to_f64() * c as f64).sum();
            let got = weighted_sum(&x, &c) as f64;
            assert!((got - want).abs() <= 1e-6 * want.abs().max(1.0), "len {len}: {got} vs {want}");
        }
    }

    #[test]
    fn add_weighted_adds_each_columns_term() {
        let mut out = vec![1.0f32, -2.0, 0.5];
        add_weighted(&mut out, 0.25, &[4.0, 0.0, -2.0]);
        assert_eq!(out, vec![2.0, -2.0, 0.0]);
    }
}

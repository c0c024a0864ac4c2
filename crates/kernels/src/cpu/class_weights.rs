//! Cross-entropy's class weights `c` in the row passes (LOSSES.md, "Class weights"): with label
//! smoothing, each row's `sum_j c_j u_j` and the gradient's last term `d c_j`, column by column.
//!
//! A loss without class weights, or without label smoothing (where the weights are each row's
//! `c_y`, a scalar of the objective), pays nothing. With both: the weighted sum is a pass of its
//! own over the row, as the argmax's (`argmax.rs`), whose statistics loop is bound by its FP
//! operations; then, instead of the one-pass sweep, the row kernel's statistics and its
//! gradient pass with `d c_j` added to each value (one load and one FMA more per 16 logits)
//! before the value's one rounding (`row::gradient_weighted`), the row reread from cache and
//! written with plain stores. One rounding matters: on near-uniform rows the term nearly cancels
//! the rest (`p_j b` against `d c_j`, both ~`s c_j / V`), and a bf16 gradient rounded before the
//! term was added was off by 0.16 in relative norm (`near_uniform_rows_round_once`). A soft-capped
//! row takes the same passes on its f32 scratch row, before the cap's chain rule.

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

impl<T: Element> Kernels<T> {
    /// Step 3 on a row part whose `d` term is `d c_j` (`weights`: its columns' class weights),
    /// each value rounded once ([`super::row::gradient_weighted`]).
    pub(super) fn weighted_gradient(
        &self,
        dst: GradientTarget<'_, T>,
        g: &RowGradient,
        inv_t: f32,
        target: Option<usize>,
        weights: &[f32],
    ) {
        // SAFETY: `select` only picks kernels whose features `Isa::detected` found on this CPU.
        unsafe { (self.gradient_weighted)(dst, g, inv_t, target, weights) }
    }

    /// Steps 1 to 3 on a whole row with class weights (in `wanted`): the row kernel's statistics,
    /// as the forward-only pass takes them (so the loss is the same bits with or without a
    /// gradient), with what `wanted` adds, then [`Self::weighted_gradient`] rereading the row from
    /// cache; false, writing nothing, when `finish` refuses the statistics.
    pub(super) fn weighted_sweep(
        &self,
        dst: GradientTarget<'_, T>,
        inv_t: f32,
        target: Option<usize>,
        wanted: Wanted<'_>,
        weights: &[f32],
        finish: Finish<'_>,
    ) -> bool {
        let (src, out) = dst.into_parts();
        let row = src.unwrap_or(out);
        let stats = self.statistics(row, inv_t, target, wanted.kernel_sum_u(), RowMax::Unneeded);
        let Some(g) = finish(self.extras(row, 0, wanted, inv_t).apply(stats)) else { return false };
        self.weighted_gradient(GradientTarget::of_parts(src, out), &g, inv_t, target, weights);
        true
    }

    /// `sum_j c_j x_j` of a row part, `weights` its columns' class weights.
    pub(super) fn weighted_sum(&self, row: &[T], weights: &[f32]) -> f32 {
        // SAFETY: `select` only picks kernels whose features `Isa::detected` found on this CPU.
        unsafe { (self.weighted_sum)(row, weights) }
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
}

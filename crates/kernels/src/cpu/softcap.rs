//! Soft-capped logits (Gemma 2's final logit soft-capping, Liger's `softcap`): with `softcap = c`
//! every loss sees `u = c tanh(x / c) / T` instead of `x / T`, and the gradient with respect to
//! the logits is the gradient with respect to `c tanh(x / c)` times `sech^2(x / c)`.
//!
//! The row kernels are not changed for it: a row's capped values are written, in f32, into a
//! per-thread scratch row, the f32 kernels of the same instruction set run on that row as on any
//! logits (statistics, gradient, or both in one sweep), and their gradient, written into a second
//! scratch row, is multiplied by the slope and rounded into the gradient buffer. Two scratch rows
//! (1.2 MiB a thread at V = 151936).
//!
//! `tanh` and the slope are computed in f32 by plain arithmetic ([`tanh_and_slope`]: one
//! vectorisable `exp`, or a Taylor polynomial near 0), compiled per instruction set with the row
//! kernels so that LLVM turns the loops into SIMD; libm's `tanh` is one call a logit (46x the
//! uncapped step at N = 1024, V = 151936). `tests::capped` and `tests::slope` in f64 are their reference.

use std::cell::RefCell;

use super::simd::Simd;
use super::{Finish, GradientTarget, Kernels, RowMax, Wanted};
use crate::element::Element;
use crate::objective::RowGradient;
use crate::stats::PartialRowStats;

thread_local! {
    /// The row's capped values and the gradient with respect to them; grow to the widest row seen.
    static ROWS: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Taylor coefficients of `tanh z = z + z^3 (c3 + z^2 (c5 + ...))`, highest degree first (z^17
/// down to z^3): below [`TAYLOR_BELOW`] the first term left out is under 6e-9 of `tanh z`.
const TANH_TAYLOR: [f32; 8] = [
    5.900_274e-4,    // z^17: 6404582 / 10854718875
    -1.455_834_4e-3, // z^15: -929569 / 638512875
    3.592_128e-3,    // z^13: 21844 / 6081075
    -8.863_236e-3,   // z^11: -1382 / 155925
    2.186_948_8e-2,  // z^9: 62 / 2835
    -5.396_825_4e-2, // z^7: -17 / 315
    1.333_333_4e-1,  // z^5: 2 / 15
    -3.333_333_4e-1, // z^3: -1 / 3
];

/// Where `tanh |z|` switches from the Taylor polynomial to `(1 - e) / (1 + e)`: above it `e =
/// exp(-2|z|) < 1/3`, so `1 - e` cancels less than one bit of `e`'s error.
const TAYLOR_BELOW: f32 = 0.55;

/// `tanh z` and `sech^2 z` for `z = x / c` (`inv_cap = 1 / c`) in f32 from one `exp`: `e =
/// exp(-2|z|)`, `tanh |z| = (1 - e) / (1 + e)` (the Taylor polynomial below [`TAYLOR_BELOW`], where
/// that cancels), `sech^2 z = 4 e / (1 + e)^2` (no cancellation where `tanh` saturates, as `1 -
/// tanh^2` would have). Within a few ulp of f64 (`tests::f32_tanh_and_slope_match_f64`). A NaN or
/// infinite logit gives NaN for both; a finite one whose `z` would overflow (`c < 1`, `x` near
/// f32's limits: a masking value) is clamped to `|z| <= 64`, where `tanh` is 1 and the slope 0.
#[inline(always)]
pub(super) fn tanh_and_slope<S: Simd>(s: S, x: f32, inv_cap: f32) -> (f32, f32) {
    let z = (x * inv_cap).clamp(-64.0, 64.0);
    let a = z.abs();
    let e = s.scalar_exp(-2.0 * a);
    let one_plus = 1.0 + e;
    let a2 = a * a;
    let mut p = TANH_TAYLOR[0];
    for &c in &TANH_TAYLOR[1..] {
        p = s.scalar_mul_add(p, a2, c);
    }
    let near_zero = s.scalar_mul_add(p * a2, a, a);
    let t = if a < TAYLOR_BELOW { near_zero } else { (1.0 - e) / one_plus };
    let slope = 4.0 * e / (one_plus * one_plus);
    if x.is_finite() {
        (t.copysign(z), slope)
    } else {
        (f32::NAN, f32::NAN)
    }
}

/// `u_j = c tanh(x_j / c)` of a row, in f32, into `out` (same length).
#[inline(always)]
pub(super) fn cap_row<S: Simd, T: Element>(s: S, row: &[T], cap: f32, out: &mut [f32]) {
    let inv_cap = 1.0 / cap;
    for (o, x) in out.iter_mut().zip(row) {
        *o = cap * tanh_and_slope(s, x.to_f32(), inv_cap).0;
    }
}

/// `out_j = grad_j * sech^2(x_j / c)`, rounded once into `out`'s type; `logits = None`: `out` holds
/// the logits and is overwritten (each element read before it is written).
#[inline(always)]
pub(super) fn chain_row<S: Simd, T: Element>(s: S, grad: &[f32], logits: Option<&[T]>, out: &mut [T], cap: f32) {
    let inv_cap = 1.0 / cap;
    match logits {
        Some(x) => {
            for ((o, &g), x) in out.iter_mut().zip(grad).zip(x) {
                *o = s.round_t(g * tanh_and_slope(s, x.to_f32(), inv_cap).1);
            }
        }
        None => {
            for (o, &g) in out.iter_mut().zip(grad) {
                *o = s.round_t(g * tanh_and_slope(s, o.to_f32(), inv_cap).1);
            }
        }
    }
}

impl<T: Element> Kernels<T> {
    /// Step 1 on the capped values of `row` (`k32`: the f32 kernels of the same instruction set),
    /// with what `wanted` adds, of the capped values (the part's first column: `first`).
    #[allow(clippy::too_many_arguments)] // the row kernel's own arguments, and the cap
    pub(super) fn capped_statistics(
        &self,
        k32: &Kernels<f32>,
        row: &[T],
        cap: f32,
        inv_t: f32,
        target: Option<usize>,
        first: usize,
        wanted: Wanted<'_>,
        max: RowMax,
    ) -> PartialRowStats {
        with_rows(row.len(), |u, _| {
            self.cap(row, cap, u);
            let p = k32.statistics(u, inv_t, target, wanted.kernel_sum_u(), max);
            k32.extras(u, first, wanted, inv_t).apply(p)
        })
    }

    /// Step 3: the f32 kernel's gradient with respect to the capped values (its `d` term times
    /// the columns' `class_weights`, when given), times the slope.
    #[allow(clippy::too_many_arguments)] // the row kernel's own arguments, and the cap
    pub(super) fn capped_gradient(
        &self,
        k32: &Kernels<f32>,
        dst: GradientTarget<'_, T>,
        g: &RowGradient,
        inv_t: f32,
        target: Option<usize>,
        cap: f32,
        class_weights: Option<&[f32]>,
    ) {
        let (src, out) = dst.into_parts();
        with_rows(out.len(), |u, grad| {
            self.cap(src.unwrap_or(out), cap, u);
            let into = GradientTarget::Into { logits: u, out: grad };
            match class_weights {
                Some(c) => k32.weighted_gradient(into, g, inv_t, target, c),
                None => k32.gradient(into, g, inv_t, target, false),
            }
            self.chain(grad, src, out, cap);
        })
    }

    /// Steps 1 to 3 on the capped values of a whole row ([`Kernels::sweep`]), with what `wanted`
    /// adds, of the capped values; false, writing nothing, when `finish` refuses the statistics.
    #[allow(clippy::too_many_arguments)] // the row kernel's own arguments, and the cap
    pub(super) fn capped_sweep(
        &self,
        k32: &Kernels<f32>,
        dst: GradientTarget<'_, T>,
        inv_t: f32,
        target: Option<usize>,
        wanted: Wanted<'_>,
        cap: f32,
        finish: Finish<'_>,
    ) -> bool {
        let (src, out) = dst.into_parts();
        with_rows(out.len(), |u, grad| {
            self.cap(src.unwrap_or(out), cap, u);
            let into = GradientTarget::Into { logits: u, out: grad };
            let done = match wanted.sum_u.weights() {
                Some(c) => k32.weighted_sweep(into, inv_t, target, wanted, c, finish),
                None => k32.sweep_wanted(into, inv_t, target, wanted, false, finish),
            };
            if done {
                self.chain(grad, src, out, cap);
            }
            done
        })
    }
}

/// Runs `f` on this thread's two scratch rows of `len` (the capped values, a gradient with
/// respect to them).
fn with_rows<R>(len: usize, f: impl FnOnce(&mut [f32], &mut [f32]) -> R) -> R {
    // Taken out of the thread-local and put back after: `f` runs the row kernels, which use
    // thread-locals of their own.
    let (mut u, mut g) = ROWS.with_borrow_mut(std::mem::take);
    u.resize(len, 0.0);
    g.resize(len, 0.0);
    let result = f(&mut u, &mut g);
    ROWS.with_borrow_mut(|rows| *rows = (u, g));
    result
}

#[cfg(test)]
mod tests {
    use super::super::simd::Portable;
    use super::*;

    /// `c tanh(x / c)` in f64. A NaN or infinite logit gives NaN, so the row is still refused as
    /// having a non-finite logit (a cap would otherwise hide an infinity).
    fn capped(x: f64, cap: f64) -> f64 {
        if x.is_finite() {
            cap * (x / cap).tanh()
        } else {
            f64::NAN
        }
    }

    /// `d capped / dx = sech^2(x / c) = 4 e / (1 + e)^2` with `e = exp(-2 |x / c|)`: no cancellation
    /// where the cap saturates (`1 - tanh^2` would lose the slope's digits there).
    fn slope(x: f64, cap: f64) -> f64 {
        let e = (-2.0 * (x / cap).abs()).exp();
        4.0 * e / ((1.0 + e) * (1.0 + e))
    }

    /// The f32 `tanh` within 2 ulp of f64's and the slope within 4e-7 relative (or 1e-37
    /// absolute, where `exp` flushes), over a dense sweep and near 0, with and without FMA.
    fn f32_matches_f64<S: Simd>(s: S) {
        let mut zs: Vec<f32> = (-600_000..=600_000).map(|i| i as f32 * 1e-4).collect();
        zs.extend(
            [1e-30, 1e-8, 1e-4, 0.549_999_9, 0.55, 0.550_000_1, 44.0, 90.0, 1e4, f32::MAX]
                .iter()
                .flat_map(|&z| [z, -z]),
        );
        for z in zs {
            let (t, slope) = tanh_and_slope(s, z, 1.0);
            let want = (z as f64).tanh();
            let ulp = (want.abs() as f32).max(f32::MIN_POSITIVE);
            let ulp = (f32::from_bits(ulp.to_bits() + 1) - ulp) as f64;
            assert!((t as f64 - want).abs() <= 2.0 * ulp, "tanh({z}) = {t}, f64 {want}");
            let want = 1.0 - want * want;
            let want = if want < 1e-6 {
                4.0 * (-2.0 * (z as f64).abs()).exp() / (1.0 + (-2.0 * (z as f64).abs()).exp()).powi(2)
            } else {
                want
            };
            assert!((slope as f64 - want).abs() <= (4e-7 * want).max(1e-37), "slope({z}) = {slope}, f64 {want}");
        }
        for z in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let (t, slope) = tanh_and_slope(s, z, 1.0);
            assert!(t.is_nan() && slope.is_nan(), "{z}");
        }
        assert_eq!(tanh_and_slope(s, 0.0, 1.0), (0.0, 1.0));
        // A finite masking value under a cap below 1: capped to -c, slope 0, not refused.
        assert_eq!(tanh_and_slope(s, f32::MIN, 1.0 / 0.5), (-1.0, 0.0));
    }

    #[test]
    fn f32_tanh_and_slope_match_f64() {
        f32_matches_f64(Portable::<false>);
        f32_matches_f64(Portable::<true>);
    }

    #[test]
    fn slope_is_the_derivative_of_the_cap() {
        for cap in [0.5, 3.0, 30.0] {
            for x in [-200.0, -40.0, -3.0, -0.1, 0.0, 1e-6, 0.7, 5.0, 29.0, 31.0, 90.0] {
                let h = 1e-5 * cap;
                let fd = (capped(x + h, cap) - capped(x - h, cap)) / (2.0 * h);
                let exact = 1.0 - (x / cap).tanh().powi(2);
                assert!((slope(x, cap) - exact).abs() <= 1e-15, "cap {cap} x {x}");
                assert!((slope(x, cap) - fd).abs() <= 1e-8, "cap {cap} x {x}: {} vs {fd}", slope(x, cap));
            }
        }
        // Far in the tail the slope keeps its relative accuracy (1 - tanh^2 would be 0).
        let far = slope(40.0, 1.0);
        assert!(far > 0.0 && (far / (4.0 * (-80.0f64).exp()) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn non_finite_logits_stay_non_finite() {
        assert!(capped(f64::INFINITY, 30.0).is_nan());
        assert!(capped(f64::NEG_INFINITY, 30.0).is_nan());
        assert!(capped(f64::NAN, 30.0).is_nan());
        assert_eq!(capped(0.0, 30.0), 0.0);
        assert!((capped(1e4, 30.0) - 30.0).abs() < 1e-12);
    }
}

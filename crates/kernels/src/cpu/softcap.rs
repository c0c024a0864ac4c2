//! Soft-capped logits (Gemma 2's final logit soft-capping, Liger's `softcap`): with `softcap = c`
//! every loss sees `u = c tanh(x / c) / T` instead of `x / T`, and the gradient with respect to
//! the logits is the gradient with respect to `c tanh(x / c)` times `sech^2(x / c)`.
//!
//! The row kernels are not changed for it: a row's capped values are written, in f32, into a
//! per-thread scratch row, the f32 kernels of the same instruction set run on that row as on any
//! logits (statistics, gradient, or both in one sweep), and their gradient, written into a second
//! scratch row, is multiplied by the slope and rounded into the gradient buffer. Two scratch rows
//! (1.2 MiB a thread at V = 151936) and one `tanh` a logit per pass, scalar, in f64: correct to
//! f32's rounding of `u` before fast, since the cap is an option most models do not use.

use std::cell::RefCell;

use super::{Finish, GradientTarget, Kernels, RowMax};
use crate::element::Element;
use crate::objective::RowGradient;
use crate::stats::PartialRowStats;

thread_local! {
    /// The row's capped values and the gradient with respect to them; grow to the widest row seen.
    static ROWS: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// `c tanh(x / c)` in f64. A NaN or infinite logit gives NaN, so the row is still refused as
/// having a non-finite logit (a cap would otherwise hide an infinity).
pub(crate) fn capped(x: f64, cap: f64) -> f64 {
    if x.is_finite() {
        cap * (x / cap).tanh()
    } else {
        f64::NAN
    }
}

/// `d capped / dx = sech^2(x / c) = 4 e / (1 + e)^2` with `e = exp(-2 |x / c|)`: no cancellation
/// where the cap saturates (`1 - tanh^2` would lose the slope's digits there).
pub(crate) fn slope(x: f64, cap: f64) -> f64 {
    let e = (-2.0 * (x / cap).abs()).exp();
    4.0 * e / ((1.0 + e) * (1.0 + e))
}

impl Kernels<f32> {
    /// Step 1 on the capped values of `row`.
    pub(super) fn capped_statistics<T: Element>(
        &self,
        row: &[T],
        cap: f64,
        inv_t: f32,
        target: Option<usize>,
        sum_u: bool,
        max: RowMax,
    ) -> PartialRowStats {
        with_rows(|u, _| {
            cap_into(row, cap, u);
            self.statistics(u, inv_t, target, sum_u, max)
        })
    }

    /// Step 3: the f32 kernel's gradient with respect to the capped values, times the slope.
    pub(super) fn capped_gradient<T: Element>(
        &self,
        dst: GradientTarget<'_, T>,
        g: &RowGradient,
        inv_t: f32,
        target: Option<usize>,
        cap: f64,
    ) {
        let (src, out) = dst.into_parts();
        with_rows(|u, grad| {
            cap_into(src.unwrap_or(out), cap, u);
            grad.resize(u.len(), 0.0);
            self.gradient(GradientTarget::Into { logits: u, out: grad }, g, inv_t, target, false);
            chain(grad, src, out, cap);
        })
    }

    /// Steps 1 to 3 on the capped values of a whole row ([`Kernels::sweep`]); false, writing
    /// nothing, when `finish` refuses the statistics.
    pub(super) fn capped_sweep<T: Element>(
        &self,
        dst: GradientTarget<'_, T>,
        inv_t: f32,
        target: Option<usize>,
        sum_u: bool,
        cap: f64,
        finish: Finish<'_>,
    ) -> bool {
        let (src, out) = dst.into_parts();
        with_rows(|u, grad| {
            cap_into(src.unwrap_or(out), cap, u);
            grad.resize(u.len(), 0.0);
            let done = self.sweep(GradientTarget::Into { logits: u, out: grad }, inv_t, target, sum_u, false, finish);
            if done {
                chain(grad, src, out, cap);
            }
            done
        })
    }
}

/// Runs `f` on this thread's two scratch rows (the capped values, a gradient with respect to them).
fn with_rows<R>(f: impl FnOnce(&mut Vec<f32>, &mut Vec<f32>) -> R) -> R {
    // Taken out of the thread-local and put back after: `f` runs the row kernels, which use
    // thread-locals of their own.
    let (mut u, mut g) = ROWS.with_borrow_mut(std::mem::take);
    let result = f(&mut u, &mut g);
    ROWS.with_borrow_mut(|rows| *rows = (u, g));
    result
}

/// The capped values of `row`, rounded to f32, into `u`.
fn cap_into<T: Element>(row: &[T], cap: f64, u: &mut Vec<f32>) {
    u.clear();
    u.extend(row.iter().map(|x| capped(x.to_f32() as f64, cap) as f32));
}

/// `out_j = grad_j * slope(x_j)`, rounded once into `out`'s type; `logits = None`: `out` holds
/// the logits and is overwritten (each element read before it is written).
fn chain<T: Element>(grad: &[f32], logits: Option<&[T]>, out: &mut [T], cap: f64) {
    debug_assert_eq!(grad.len(), out.len());
    match logits {
        Some(x) => {
            for ((o, &g), x) in out.iter_mut().zip(grad).zip(x) {
                *o = T::from_f32((g as f64 * slope(x.to_f32() as f64, cap)) as f32);
            }
        }
        None => {
            for (o, &g) in out.iter_mut().zip(grad) {
                *o = T::from_f32((g as f64 * slope(o.to_f32() as f64, cap)) as f32);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

//! The two passes over one row of logits (or one vocabulary shard of it), tile by tile.
//!
//! A tile of `TILE` elements is widened to f32 (and divided by the temperature) once into a
//! stack buffer, then swept from L1. Sums run in `LANES` independent accumulators in a fixed
//! order, so the result is the same bits whatever SIMD width the loop is compiled to, and the
//! f32 rounding error grows with `TILE / LANES` rather than with the vocabulary size.

use super::math::exp;
use super::GradientTarget;
use crate::element::Element;
use crate::objective::RowGradient;
use crate::stats::PartialRowStats;

pub(crate) const LANES: usize = 16;
pub(crate) const TILE: usize = 2048;

/// Loads `src` into `dst` as `u = x * inv_t`.
#[inline(always)]
fn load<T: Element>(src: &[T], dst: &mut [f32], inv_t: f32) {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = x.to_f32() * inv_t;
    }
}

// Explicit lane indices are the point: they fix the summation order.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn lanes_max(u: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = u.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for k in 0..LANES {
            acc[k] = if c[k] > acc[k] { c[k] } else { acc[k] };
        }
    }
    for (k, &x) in rest.iter().enumerate() {
        acc[k] = if x > acc[k] { x } else { acc[k] };
    }
    acc.iter().fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m })
}

/// Pairwise sum of the lane accumulators.
#[inline(always)]
fn lanes_sum(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for k in 0..width {
            acc[k] += acc[k + width];
        }
    }
    acc[0]
}

/// Statistics of one tile relative to its own maximum.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn tile_stats(u: &[f32]) -> PartialRowStats {
    let m = lanes_max(u);
    let mut s = [0.0f32; LANES];
    let mut e = [0.0f32; LANES];
    let mut su = [0.0f32; LANES];
    let mut step = |k: usize, x: f32| {
        let d = x - m;
        let p = exp(d);
        s[k] += p;
        e[k] += p * d;
        su[k] += x;
    };
    let chunks = u.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for k in 0..LANES {
            step(k, c[k]);
        }
    }
    for (k, &x) in rest.iter().enumerate() {
        step(k, x);
    }
    PartialRowStats {
        max: m,
        sum_exp: lanes_sum(s),
        sum_exp_shifted: lanes_sum(e),
        sum_u: lanes_sum(su),
        target_u: None,
    }
}

/// Step 1 on one row part: `target` is the target's index within `row`, if it falls there.
#[inline(always)]
pub(crate) fn statistics<T: Element>(row: &[T], inv_t: f32, target: Option<usize>) -> PartialRowStats {
    let mut buf = [0.0f32; TILE];
    let mut acc = PartialRowStats::EMPTY;
    for tile in row.chunks(TILE) {
        let u = &mut buf[..tile.len()];
        load(tile, u, inv_t);
        acc = acc.combine(tile_stats(u));
    }
    acc.target_u = target.map(|y| row[y].to_f32() * inv_t);
    acc
}

/// Step 3 on one row part: `dlogits_j = a*[j = y] + p_j * (b + c * log p_j) + d`.
#[inline(always)]
pub(crate) fn gradient<T: Element>(dst: GradientTarget<'_, T>, g: &RowGradient, inv_t: f32, target: Option<usize>) {
    let (src, out): (Option<&[T]>, &mut [T]) = match dst {
        GradientTarget::Into { logits, out } => (Some(logits), out),
        GradientTarget::InPlace(row) => (None, row),
    };
    if g.is_zero() {
        out.fill(T::default());
        return;
    }
    let mut buf = [0.0f32; TILE];
    let len = out.len();
    for start in (0..len).step_by(TILE) {
        let end = (start + TILE).min(len);
        let u = &mut buf[..end - start];
        load(src.map_or(&out[start..end], |s| &s[start..end]), u, inv_t);
        if g.c == 0.0 {
            for x in u.iter_mut() {
                *x = exp(*x - g.lse) * g.b + g.d;
            }
        } else {
            for x in u.iter_mut() {
                let log_p = *x - g.lse;
                *x = exp(log_p) * (g.b + g.c * log_p) + g.d;
            }
        }
        if let Some(y) = target.filter(|y| (start..end).contains(y)) {
            u[y - start] += g.a;
        }
        for (o, &v) in out[start..end].iter_mut().zip(u.iter()) {
            *o = T::from_f32(v);
        }
    }
}

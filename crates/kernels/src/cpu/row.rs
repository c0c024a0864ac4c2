//! The passes over one row of logits (or one vocabulary shard of it), tile by tile.
//!
//! A tile of `TILE` elements is swept in 16-lane vectors ([`Simd`]), widened to f32 (and divided
//! by the temperature) in registers. Sums run in 16 independent lanes in a fixed order, reduced
//! pairwise per tile, so the f32 rounding error grows with `TILE / 16` rather than with the
//! vocabulary size, and the result does not depend on threads.
//!
//! Two ways to produce a row's gradient:
//! - [`gradient`] recomputes `p_j = exp(u_j - lse)` from the logits (after all rows' statistics,
//!   for sequence-level objectives and vocabulary shards);
//! - [`sweep`] keeps `exp(u_j - m_tile)` from the statistics pass in a per-thread scratch row
//!   and rescales it once the objective has given `lse` and the row's scalars: one `exp` per
//!   element instead of two, and the logits are read from memory once.
//!
//! Everything is `#[inline(always)]` and generic: `mod.rs` compiles it once per instruction set.
//! (Non-temporal stores for new gradient buffers were tried and measured no faster here; see
//! docs/BENCHMARKS.md.)
//!
//! Every sweep that reads logits from memory asks for them [`PREFETCH_AHEAD`] bytes ahead, and
//! every write of a gradient asks for its destination lines as well (a read prefetch: a line no
//! other core holds arrives exclusive anyway, and `prefetchw` measured slower on a new buffer,
//! f32 `fused` 0.054 -> 0.059-0.062 s): on the Intel server CPU of
//! docs/BENCHMARKS.md the hardware prefetchers alone left the row kernels waiting on memory
//! between bursts of compute (one thread: 70 ms at N=1024 bf16, the sum of its in-cache compute
//! and its copy time), and these hints overlap the two (1.3-2x faster logits-level losses).

use std::cell::RefCell;

use super::simd::{Simd, LANES};
use super::GradientTarget;
use crate::element::Element;
use crate::objective::RowGradient;
use crate::stats::PartialRowStats;

pub(crate) const TILE: usize = 2048;

/// How far ahead (in bytes) the sweeps prefetch the logits they read and the gradient lines they
/// write. 2, 4 and 8 KiB measured alike at N=1024 (bf16 and f32); a few DRAM latencies' worth of
/// compute, and past the next 4 KiB page, where the hardware's stream prefetch stops.
const PREFETCH_AHEAD: usize = 4096;

/// Loads `src` into `dst` as `u = x * inv_t`, prefetching [`PREFETCH_AHEAD`] bytes ahead.
#[inline(always)]
fn load<S: Simd, T: Element>(s: S, src: &[T], dst: &mut [f32], inv_t: f32) {
    // `inv_t == 1` decided here, not per vector (LLVM does not hoist the test).
    if inv_t == 1.0 {
        load_scaled::<S, T, false>(s, src, dst, inv_t)
    } else {
        load_scaled::<S, T, true>(s, src, dst, inv_t)
    }
}

#[inline(always)]
fn load_scaled<S: Simd, T: Element, const SCALED: bool>(s: S, src: &[T], dst: &mut [f32], inv_t: f32) {
    let full = src.len() / LANES * LANES;
    for j in (0..full).step_by(LANES) {
        s.prefetch(ahead(&src[j..]));
        s.store(load_u::<S, T, SCALED>(s, &src[j..], inv_t), &mut dst[j..]);
    }
    for j in full..src.len() {
        dst[j] = src[j].to_f32() * inv_t;
    }
}

/// The address [`PREFETCH_AHEAD`] bytes past the start of `x` (it may lie past the end of the
/// row: a prefetch never faults).
#[inline(always)]
fn ahead<T>(x: &[T]) -> *const T {
    x.as_ptr().wrapping_add(PREFETCH_AHEAD / std::mem::size_of::<T>())
}

/// Pairwise sum of 16 lanes.
#[inline(always)]
fn pairwise(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for k in 0..width {
            acc[k] += acc[k + width];
        }
    }
    acc[0]
}

/// `x * inv_t` for 16 logits; without `SCALED` (no temperature: `inv_t == 1`) the exact
/// multiply by one is skipped. A const parameter, so that the test is made once per row.
#[inline(always)]
fn load_u<S: Simd, T: Element, const SCALED: bool>(s: S, src: &[T], inv_t: f32) -> S::V {
    let x = s.load_t(src);
    if SCALED {
        s.mul(x, s.splat(inv_t))
    } else {
        x
    }
}

#[inline(always)]
fn lanes_max<S: Simd, T: Element, const SCALED: bool>(s: S, tile: &[T], inv_t: f32) -> f32 {
    let full = tile.len() / LANES * LANES;
    let mut acc = s.splat(f32::NEG_INFINITY);
    for c in tile[..full].chunks_exact(LANES) {
        s.prefetch(ahead(c));
        acc = s.max(acc, load_u::<S, T, SCALED>(s, c, inv_t));
    }
    let mut a = s.to_array(acc);
    for (k, x) in tile[full..].iter().enumerate() {
        let x = x.to_f32() * inv_t;
        a[k] = if a[k] >= x { a[k] } else { x };
    }
    a.iter().fold(f32::NEG_INFINITY, |m, &x| if m >= x { m } else { x })
}

/// A tile's sums relative to a reference `m`, and its maximum.
struct TileSums {
    sum_exp: f32,
    sum_exp_shifted: f32,
    sum_u: f32,
    max: f32,
}

/// `sum exp(u - m)`, `sum exp(u - m) (u - m)`, `sum u` (only with `SUM_U`: label smoothing is its
/// one user) and `max u` over a tile, in one sweep; with `STORE`, `exp(u - m)` is also written to
/// `scratch`. `m` need not be the tile's maximum:
/// the caller only requires `max u <= m + HEADROOM`.
#[inline(always)]
fn tile_sums<S: Simd, T: Element, const STORE: bool, const SUM_U: bool, const SCALED: bool>(
    s: S,
    tile: &[T],
    inv_t: f32,
    m: f32,
    scratch: &mut [f32],
) -> TileSums {
    let full = tile.len() / LANES * LANES;
    let mv = s.splat(m);
    let (mut sv, mut ev, mut uv) = (s.splat(0.0), s.splat(0.0), s.splat(0.0));
    let mut maxv = s.splat(f32::NEG_INFINITY);
    for (j, c) in tile[..full].chunks_exact(LANES).enumerate() {
        s.prefetch(ahead(c));
        let x = load_u::<S, T, SCALED>(s, c, inv_t);
        maxv = s.max(maxv, x);
        let d = s.sub(x, mv);
        let p = s.exp(d);
        if STORE {
            s.store(p, &mut scratch[j * LANES..]);
        }
        sv = s.add(sv, p);
        ev = s.mul_add(p, d, ev);
        if SUM_U {
            uv = s.add(uv, x);
        }
    }
    let (mut sa, mut ea, mut ua, mut ma) = (s.to_array(sv), s.to_array(ev), s.to_array(uv), s.to_array(maxv));
    for (k, x) in tile[full..].iter().enumerate() {
        let x = x.to_f32() * inv_t;
        ma[k] = if ma[k] >= x { ma[k] } else { x };
        let d = x - m;
        let p = s.scalar_exp(d);
        if STORE {
            scratch[full + k] = p;
        }
        sa[k] += p;
        ea[k] = s.scalar_mul_add(p, d, ea[k]);
        if SUM_U {
            ua[k] += x;
        }
    }
    TileSums {
        sum_exp: pairwise(sa),
        sum_exp_shifted: pairwise(ea),
        sum_u: pairwise(ua),
        max: ma.iter().fold(f32::NEG_INFINITY, |a, &x| if a >= x { a } else { x }),
    }
}

/// How far above the reference a tile's values may go before the tile is redone relative to its
/// own maximum: `exp(8)` is far from overflow, and the rounding it costs the entropy is ~8 ulp.
const HEADROOM: f32 = 8.0;

/// Step 1 on one row part; `target` is the target's index within `row`, if it falls there.
///
/// The sums are kept relative to a reference `m`: the first tile's maximum, raised only when a
/// later tile exceeds it by more than [`HEADROOM`] (that tile is then summed again relative to
/// its own maximum, and the running sums rescaled — `stats.rs` explains the shifted entropy
/// accumulator). So each element is read once per tile, with its maximum found in the same sweep.
/// With `STORE`, each tile's `exp(u - m)` goes to `scratch` and the `m` it used to `tile_max`.
#[inline(always)]
fn statistics_impl<S: Simd, T: Element, const STORE: bool, const SUM_U: bool, const SCALED: bool>(
    s: S,
    row: &[T],
    inv_t: f32,
    target: Option<usize>,
    scratch: &mut [f32],
    tile_max: &mut [f32],
) -> PartialRowStats {
    let (mut m, mut sum, mut e, mut su, mut max) = (f32::NEG_INFINITY, 0.0f32, 0.0f32, 0.0f32, f32::NEG_INFINITY);
    for (t, tile) in row.chunks(TILE).enumerate() {
        if m == f32::NEG_INFINITY {
            m = lanes_max::<S, T, SCALED>(s, tile, inv_t);
        }
        let scratch_tile: &mut [f32] = if STORE { &mut scratch[t * TILE..t * TILE + tile.len()] } else { &mut [] };
        let mut sums = tile_sums::<S, T, STORE, SUM_U, SCALED>(s, tile, inv_t, m, scratch_tile);
        if sums.max > m + HEADROOM {
            let shift = m - sums.max;
            let k = s.scalar_exp(shift);
            e = s.scalar_mul_add(shift, sum, e) * k;
            sum *= k;
            m = sums.max;
            sums = tile_sums::<S, T, STORE, SUM_U, SCALED>(s, tile, inv_t, m, scratch_tile);
        }
        if STORE {
            tile_max[t] = m;
        }
        max = if max >= sums.max { max } else { sums.max };
        sum += sums.sum_exp;
        e += sums.sum_exp_shifted;
        su += sums.sum_u;
    }
    if m == f32::NEG_INFINITY && !row.is_empty() {
        // Every value was -inf or NaN: make the row non-finite for the caller's check.
        sum = f32::NAN;
    }
    // Report the sums relative to the row's true maximum, as `PartialRowStats` defines them.
    if max > m && sum != 0.0 {
        let shift = m - max;
        let k = s.scalar_exp(shift);
        e = s.scalar_mul_add(shift, sum, e) * k;
        sum *= k;
        m = max;
    }
    PartialRowStats {
        max: m,
        sum_exp: sum,
        sum_exp_shifted: e,
        sum_u: su,
        target_u: target.map(|y| row[y].to_f32() * inv_t),
    }
}

#[inline(always)]
pub(crate) fn statistics<S: Simd, T: Element>(
    s: S,
    row: &[T],
    inv_t: f32,
    target: Option<usize>,
    sum_u: bool,
) -> PartialRowStats {
    statistics_for::<S, T, false>(s, row, inv_t, target, sum_u, &mut [], &mut [])
}

/// [`statistics_impl`] with `sum_u` and `inv_t != 1` made compile-time constants.
#[inline(always)]
fn statistics_for<S: Simd, T: Element, const STORE: bool>(
    s: S,
    row: &[T],
    inv_t: f32,
    target: Option<usize>,
    sum_u: bool,
    scratch: &mut [f32],
    tile_max: &mut [f32],
) -> PartialRowStats {
    match (sum_u, inv_t != 1.0) {
        (true, true) => statistics_impl::<S, T, STORE, true, true>(s, row, inv_t, target, scratch, tile_max),
        (true, false) => statistics_impl::<S, T, STORE, true, false>(s, row, inv_t, target, scratch, tile_max),
        (false, true) => statistics_impl::<S, T, STORE, false, true>(s, row, inv_t, target, scratch, tile_max),
        (false, false) => statistics_impl::<S, T, STORE, false, false>(s, row, inv_t, target, scratch, tile_max),
    }
}

/// Writes one tile of gradient values (`u`, f32) to `dst` in its dtype, asking ahead for the lines
/// it will write (a new gradient buffer is not in cache).
#[inline(always)]
fn store_tile<S: Simd, T: Element>(s: S, u: &[f32], dst: &mut [T]) {
    let full = dst.len() / LANES * LANES;
    for j in (0..full).step_by(LANES) {
        s.prefetch(ahead(&dst[j..]));
        s.store_t(s.load(&u[j..]), &mut dst[j..]);
    }
    for j in full..dst.len() {
        dst[j] = T::from_f32(u[j]);
    }
}

/// Where a tile's probabilities come from.
#[derive(Clone, Copy)]
enum Probabilities<'a> {
    /// `p = exp(log p)`, recomputed.
    Recompute,
    /// `p = kept * k`, from the statistics pass.
    Kept { kept: &'a [f32], k: f32 },
}

/// `u <- p (b + c log p) + d` over a tile of `u` values, with `log p = u - lse`.
/// (No closure here: closures are not compiled with the kernels' target features.)
#[allow(clippy::needless_range_loop)] // `j` indexes `u` and the kept values
#[inline(always)]
fn combine_tile<S: Simd>(s: S, g: &RowGradient, u: &mut [f32], probabilities: Probabilities<'_>) {
    let full = u.len() / LANES * LANES;
    let (lse, b, c, d) = (s.splat(g.lse), s.splat(g.b), s.splat(g.c), s.splat(g.d));
    for j in (0..full).step_by(LANES) {
        let log_p = s.sub(s.load(&u[j..]), lse);
        let p = match probabilities {
            Probabilities::Recompute => s.exp(log_p),
            Probabilities::Kept { kept, k } => s.mul(s.load(&kept[j..]), s.splat(k)),
        };
        let out = if g.c == 0.0 { s.mul_add(p, b, d) } else { s.mul_add(p, s.mul_add(c, log_p, b), d) };
        s.store(out, &mut u[j..]);
    }
    for j in full..u.len() {
        let log_p = u[j] - g.lse;
        let p = match probabilities {
            Probabilities::Recompute => s.scalar_exp(log_p),
            Probabilities::Kept { kept, k } => kept[j] * k,
        };
        u[j] = s.scalar_mul_add(p, s.scalar_mul_add(g.c, log_p, g.b), g.d);
    }
}

/// Splits a gradient target into what is read (`None`: the row itself) and what is written.
#[inline(always)]
fn parts<'a, T>(dst: GradientTarget<'a, T>) -> (Option<&'a [T]>, &'a mut [T]) {
    match dst {
        GradientTarget::Into { logits, out } => (Some(logits), out),
        GradientTarget::InPlace(row) => (None, row),
    }
}

/// Step 3 on one row part, recomputing `p` from the logits:
/// `dlogits_j = a*[j = y] + p_j * (b + c * log p_j) + d`.
#[inline(always)]
pub(crate) fn gradient<S: Simd, T: Element>(
    s: S,
    dst: GradientTarget<'_, T>,
    g: &RowGradient,
    inv_t: f32,
    target: Option<usize>,
) {
    let (src, out) = parts(dst);
    let mut buf = [0.0f32; TILE];
    for start in (0..out.len()).step_by(TILE) {
        let end = (start + TILE).min(out.len());
        let u = &mut buf[..end - start];
        if g.is_zero() {
            u.fill(0.0);
        } else {
            load(s, src.map_or(&out[start..end], |l| &l[start..end]), u, inv_t);
            combine_tile(s, g, u, Probabilities::Recompute);
            if let Some(y) = target.filter(|y| (start..end).contains(y)) {
                u[y - start] += g.a;
            }
        }
        store_tile(s, u, &mut out[start..end]);
    }
}

thread_local! {
    /// Per-thread scratch of [`sweep`]: `exp(u - m_tile)` of the row being processed, and the
    /// `m_tile` of each tile. Grows to the widest row seen; a 151936-wide row takes 594 KiB.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Steps 1 to 3 on one whole row: the statistics (keeping `exp(u - m_tile)`), then `finish`
/// (the objective) turns them into the row's gradient scalars, then the gradient from the kept
/// values. Returns false, writing nothing, when `finish` refuses the statistics (NaN or Inf).
#[inline(always)]
pub(crate) fn sweep<S: Simd, T: Element>(
    s: S,
    dst: GradientTarget<'_, T>,
    inv_t: f32,
    target: Option<usize>,
    sum_u: bool,
    finish: &mut dyn FnMut(PartialRowStats) -> Option<RowGradient>,
) -> bool {
    let (src, out) = parts(dst);
    let len = out.len();
    // Taken out of the thread-local and put back after, so that the work below is compiled in
    // this function (with its target features), not in a closure of `LocalKey::with`.
    let (mut scratch, mut tile_max) = SCRATCH.with_borrow_mut(std::mem::take);
    scratch.resize(scratch.len().max(len), 0.0);
    tile_max.resize(tile_max.len().max(len.div_ceil(TILE)), 0.0);
    let done = 'row: {
        let row = src.unwrap_or(out);
        let stats = statistics_for::<S, T, true>(s, row, inv_t, target, sum_u, &mut scratch, &mut tile_max);
        let Some(g) = finish(stats) else { break 'row false };
        let mut buf = [0.0f32; TILE];
        for (t, start) in (0..len).step_by(TILE).enumerate() {
            let end = (start + TILE).min(len);
            let u = &mut buf[..end - start];
            if g.is_zero() {
                u.fill(0.0);
            } else {
                // p_j = exp(u_j - m_t) * exp(m_t - lse), the first factor kept by the statistics.
                let k = s.scalar_exp(tile_max[t] - g.lse);
                let kept = &scratch[start..end];
                if g.c == 0.0 {
                    // No log p needed: out = kept * (k b) + d, rounded straight into the output.
                    let (kb, d) = (k * g.b, g.d);
                    let dst = &mut out[start..end];
                    rescale_tile(s, kept, kb, d, dst);
                    if let Some(y) = target.filter(|y| (start..end).contains(y)) {
                        dst[y - start] = T::from_f32(s.scalar_mul_add(kept[y - start], kb, d) + g.a);
                    }
                    continue;
                } else {
                    load(s, src.map_or(&out[start..end], |l| &l[start..end]), u, inv_t);
                    combine_tile(s, &g, u, Probabilities::Kept { kept, k });
                }
                if let Some(y) = target.filter(|y| (start..end).contains(y)) {
                    u[y - start] += g.a;
                }
            }
            store_tile(s, u, &mut out[start..end]);
        }
        true
    };
    SCRATCH.with_borrow_mut(|slot| *slot = (scratch, tile_max));
    done
}

/// `out = kept * kb + d`, rounded to `T`.
#[inline(always)]
fn rescale_tile<S: Simd, T: Element>(s: S, kept: &[f32], kb: f32, d: f32, out: &mut [T]) {
    let full = out.len() / LANES * LANES;
    let (kbv, dv) = (s.splat(kb), s.splat(d));
    for j in (0..full).step_by(LANES) {
        s.prefetch(ahead(&out[j..]));
        s.store_t(s.mul_add(s.load(&kept[j..]), kbv, dv), &mut out[j..]);
    }
    for j in full..out.len() {
        out[j] = T::from_f32(s.scalar_mul_add(kept[j], kb, d));
    }
}

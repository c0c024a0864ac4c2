//! The passes over one row of logits (or one vocabulary shard of it), tile by tile.
//!
//! A tile of `TILE` elements is swept in 16-lane vectors ([`Simd`]), widened to f32 (and divided
//! by the temperature) in registers. Sums run in 16 independent lanes in a fixed order, reduced
//! pairwise per tile, so the f32 rounding error grows with `TILE / 16` rather than with the
//! vocabulary size, and the result does not depend on threads.
//!
//! Two ways to produce a row's gradient:
//! - [`gradient`] recomputes `p_j = exp(u_j - lse)` from the logits (after all rows' statistics,
//!   for sequence-level objectives and vocabulary shards; in base 2 for 16-bit outputs on
//!   AVX-512 and AVX2, `gradient_writes::Recompute`);
//! - [`sweep`] keeps `exp(u_j - m_tile)` from the statistics pass in a per-thread scratch row
//!   (`m_tile` the reference the tile was summed against; on AVX-512 and AVX2 the kept values
//!   are `2^t`, `statistics_pass::Base2`) and rescales it once the objective has given `lse` and the row's
//!   scalars: one exponential per element instead of two, and the logits are read from memory
//!   once.
//!
//! Everything is `#[inline(always)]` and generic: `cpu/mod.rs` compiles it once per instruction set.
//! A gradient (16-bit; f32 too on AMD CPUs) written into a new buffer of 64 MiB or more (the
//! `fused` variant, by [`sweep`] or by [`gradient`]'s recomputing pass; `cpu::STREAM_MIN_BYTES`)
//! goes there by non-temporal stores on AVX-512 and AVX2 ([`write_tile`]): a plain store first
//! reads each line it writes.
//! On AMD Zen 4 that took 19-25% off the bf16 `fused` step (7% off sequence-level GSPO's, which
//! computes more per byte) and 12-21% off the f32 one; on an Intel server CPU it had measured
//! neither faster nor slower in bf16, slower in f32, so f32 streams on AMD CPUs only
//! (`simd::streamed_dtype`; docs/BENCHMARKS.md; AVX2, timed on Zen 4 with `FLASHGRPO_ISA=avx2`:
//! bf16 `fused` 12-13% faster, f32 6%). The zeros of a row without a gradient ([`zero_row`])
//! stream in such a buffer in place too: its logits are never read.
//!
//! Every sweep that reads logits from memory asks for them [`PREFETCH_AHEAD`] bytes ahead, and
//! every plain write of a gradient asks for its destination lines as well (a read prefetch: a line no
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
    debug_assert_eq!(src.len(), dst.len());
    let full = src.len() / LANES * LANES;
    for (x, u) in src[..full].chunks_exact(LANES).zip(dst[..full].chunks_exact_mut(LANES)) {
        s.prefetch(ahead(x));
        s.store(load_u::<S, T, SCALED>(s, x, inv_t), u);
    }
    for (x, u) in src[full..].iter().zip(&mut dst[full..]) {
        *u = x.to_f32() * inv_t;
    }
}

/// The address [`PREFETCH_AHEAD`] bytes past the start of `x` (it may lie past the end of the
/// row: a prefetch never faults).
#[inline(always)]
fn ahead<T>(x: &[T]) -> *const T {
    x.as_ptr().wrapping_add(PREFETCH_AHEAD / std::mem::size_of::<T>())
}

/// The end of a tile's whole 32-value pairs (`statistics_pass::tile_sums` reads them with
/// [`Simd::load_pair_t`], then 16 at a time, then one at a time).
#[inline(always)]
fn pair_end(len: usize) -> usize {
    len / (2 * LANES) * (2 * LANES)
}

/// Where a tile's element `q` lies among the values `statistics_pass::tile_sums` kept (of `len`): in a whole
/// pair, where [`Simd::load_pair_t`] put it; after them, in place.
#[inline(always)]
fn kept_index<S: Simd, T: Element>(s: S, q: usize, len: usize) -> usize {
    if q < pair_end(len) {
        q / (2 * LANES) * (2 * LANES) + s.pair_lane::<T>(q % (2 * LANES))
    } else {
        q
    }
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

mod gradient_writes;
mod statistics_pass;

use gradient_writes::{combine_tile, write_rescaled_pairs, write_tile, Computed, Rescaled};
pub(crate) use gradient_writes::{gradient, gradient_weighted, zero_row};
pub(crate) use statistics_pass::statistics;
use statistics_pass::statistics_for;

thread_local! {
    /// Per-thread scratch of [`sweep`]: the kept values of the row being processed (`exp(u -
    /// m_tile)`, or `2^t` on the base-2 path), and each tile's reference `m_tile` in the units of
    /// `u` (f64: see `statistics_pass::Base2`). Grows to the widest row seen; a 151936-wide row takes 594 KiB.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f64>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Steps 1 to 3 on one whole row: the statistics (keeping `exp(u - m_tile)` or `2^t`), then `finish`
/// (the objective) turns them into the row's gradient scalars, then the gradient from the kept
/// values. Returns false, writing nothing, when `finish` refuses the statistics (NaN or Inf).
/// `finish` also gets the row, still in cache, for what the caller adds to its statistics.
/// With `large` (a buffer larger than the caches), a gradient written into another buffer goes
/// there by non-temporal stores where the instruction set has them for `T` ([`write_tile`]).
#[inline(always)]
pub(crate) fn sweep<S: Simd, T: Element>(
    s: S,
    dst: GradientTarget<'_, T>,
    inv_t: f32,
    target: Option<usize>,
    sum_u: bool,
    large: bool,
    finish: &mut dyn FnMut(PartialRowStats, &[T]) -> Option<RowGradient>,
) -> bool {
    let (src, out) = dst.into_parts();
    let stream = large && src.is_some() && s.streams::<T>();
    let len = out.len();
    // Taken out of the thread-local and put back after, so that the work below is compiled in
    // this function (with its target features), not in a closure of `LocalKey::with`.
    let (mut scratch, mut tile_ref) = SCRATCH.with_borrow_mut(std::mem::take);
    scratch.resize(scratch.len().max(len), 0.0);
    tile_ref.resize(tile_ref.len().max(len.div_ceil(TILE)), 0.0);
    let done = 'row: {
        let row = src.unwrap_or(out);
        let stats = statistics_for::<S, T, true, false>(s, row, inv_t, target, sum_u, &mut scratch, &mut tile_ref);
        let Some(g) = finish(stats, row) else { break 'row false };
        if g.is_zero() {
            zero_row(s, out, stream);
            break 'row true;
        }
        let mut buf = [0.0f32; TILE];
        for (t, start) in (0..len).step_by(TILE).enumerate() {
            let end = (start + TILE).min(len);
            let u = &mut buf[..end - start];
            // p_j = exp(u_j - m_t) * exp(m_t - lse), the first factor kept by the statistics
            // (relative to the tile's reference m_t, in f64: see `Base2`).
            let k = (tile_ref[t] - g.lse as f64).exp() as f32;
            let kept = &scratch[start..end];
            if g.c == 0.0 {
                // No log p needed: out = kept * (k b) + d, rounded straight into the output;
                // where the statistics kept even and odd positions apart, put in order as 32
                // values are rounded at once.
                let (kb, d) = (k * g.b, g.d);
                let dst = &mut out[start..end];
                if s.splits::<T>() {
                    write_rescaled_pairs(s, kept, kb, d, dst, stream);
                } else {
                    write_tile(s, &Rescaled { kept, kb, d }, dst, stream);
                }
                if let Some(y) = target.filter(|y| (start..end).contains(y)) {
                    if stream {
                        s.stream_fence(); // the streamed line before the store over it
                    }
                    let kept_y = kept[kept_index::<S, T>(s, y - start, end - start)];
                    dst[y - start] = s.round_t(s.scalar_mul_add(kept_y, kb, d) + g.a);
                }
                continue;
            }
            load(s, src.map_or(&out[start..end], |l| &l[start..end]), u, inv_t);
            combine_tile::<S, T>(s, &g, u, kept, k);
            if let Some(y) = target.filter(|y| (start..end).contains(y)) {
                u[y - start] += g.a;
            }
            write_tile(s, &Computed(u), &mut out[start..end], stream);
        }
        if stream {
            s.stream_fence();
        }
        true
    };
    SCRATCH.with_borrow_mut(|slot| *slot = (scratch, tile_ref));
    done
}

#[cfg(test)]
mod tests;

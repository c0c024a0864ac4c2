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
//!   AVX-512 and AVX2, [`Recompute`]);
//! - [`sweep`] keeps `exp(u_j - m_tile)` from the statistics pass in a per-thread scratch row
//!   (`m_tile` the reference the tile was summed against; on AVX-512 and AVX2 the kept values
//!   are `2^t`, [`Base2`]) and rescales it once the objective has given `lse` and the row's
//!   scalars: one exponential per element instead of two, and the logits are read from memory
//!   once.
//!
//! Everything is `#[inline(always)]` and generic: `mod.rs` compiles it once per instruction set.
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
use super::{GradientTarget, RowMax};
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

/// The end of a tile's whole 32-value pairs ([`tile_sums`] reads them with
/// [`Simd::load_pair_t`], then 16 at a time, then one at a time).
#[inline(always)]
fn pair_end(len: usize) -> usize {
    len / (2 * LANES) * (2 * LANES)
}

/// Where a tile's element `q` lies among the values [`tile_sums`] kept (of `len`): in a whole
/// pair, where [`Simd::load_pair_t`] put it; after them, in place.
#[inline(always)]
fn kept_index<S: Simd, T: Element>(s: S, q: usize, len: usize) -> usize {
    if q < pair_end(len) {
        q / (2 * LANES) * (2 * LANES) + s.pair_lane::<T>(q % (2 * LANES))
    } else {
        q
    }
}

/// Writes `kept * kb + d` ([`Rescaled`]) over a tile kept in [`Simd::load_pair_t`]'s layout:
/// each pair rescaled and stored in order by [`Simd::store_pair_t`] (where [`Simd::splits`] `T`:
/// the even and odd positions rounded and interleaved at once), or with `stream` by
/// [`Simd::stream_rescaled_pairs`]; the values after the pairs as [`plain_stores`].
#[inline(always)]
fn write_rescaled_pairs<S: Simd, T: Element>(s: S, kept: &[f32], kb: f32, d: f32, dst: &mut [T], stream: bool) {
    let pairs = pair_end(dst.len());
    if stream {
        s.stream_rescaled_pairs(&kept[..pairs], kb, d, &mut dst[..pairs]);
    } else {
        let (kbv, dv) = (s.splat(kb), s.splat(d));
        for (k, out) in kept[..pairs].chunks_exact(2 * LANES).zip(dst[..pairs].chunks_exact_mut(2 * LANES)) {
            let a = s.mul_add(s.load(&k[..LANES]), kbv, dv);
            let b = s.mul_add(s.load(&k[LANES..]), kbv, dv);
            s.prefetch(ahead(out));
            s.store_pair_t(a, b, out);
        }
    }
    plain_stores(s, &Rescaled { kept: &kept[pairs..], kb, d }, &mut dst[pairs..], 0);
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

/// The largest raw logit of a tile (a NaN may or may not come through: the sums catch NaN).
/// With `inv_t > 0`, `lanes_max * inv_t` is the largest `u = x * inv_t` as the sweeps round it
/// (rounding is monotonic).
#[inline(always)]
fn lanes_max<S: Simd, T: Element>(s: S, tile: &[T]) -> f32 {
    let full = tile.len() / LANES * LANES;
    let mut acc = s.splat(f32::NEG_INFINITY);
    for c in tile[..full].chunks_exact(LANES) {
        s.prefetch(ahead(c));
        acc = s.max(acc, s.load_t(c));
    }
    let mut a = s.to_array(acc);
    for (k, x) in tile[full..].iter().enumerate() {
        let x = x.to_f32();
        a[k] = if a[k] >= x { a[k] } else { x };
    }
    a.iter().fold(f32::NEG_INFINITY, |m, &x| if m >= x { m } else { x })
}

/// How a tile's sweep takes a logit `x` to the exponent its sums are taken in: natural units
/// (`d = u - m`, `exp`; [`Natural`]) or base 2 (`t = x a - r`, `exp2`; [`Base2At`]). Each also
/// names the value the sweep sums and takes the maximum of (`u`, or the raw `x` in base 2).
trait Exponent<S: Simd>: Copy {
    /// `(value, exponent)` of 16 logits.
    fn split(self, s: S, x: S::V) -> (S::V, S::V);
    /// The same for one logit (the scalar tails).
    fn split_scalar(self, s: S, x: f32) -> (f32, f32);
    fn exp(self, s: S, d: S::V) -> S::V;
    fn exp_scalar(self, s: S, d: f32) -> f32;
}

/// Natural units relative to `m`: `u = x inv_t` (the multiply skipped without `SCALED`), `d = u - m`.
#[derive(Clone, Copy)]
struct Natural<const SCALED: bool> {
    inv_t: f32,
    m: f32,
}

impl<S: Simd, const SCALED: bool> Exponent<S> for Natural<SCALED> {
    #[inline(always)]
    fn split(self, s: S, x: S::V) -> (S::V, S::V) {
        let u = if SCALED { s.mul(x, s.splat(self.inv_t)) } else { x };
        (u, s.sub(u, s.splat(self.m)))
    }
    #[inline(always)]
    fn split_scalar(self, _: S, x: f32) -> (f32, f32) {
        let u = x * self.inv_t;
        (u, u - self.m)
    }
    #[inline(always)]
    fn exp(self, s: S, d: S::V) -> S::V {
        s.exp(d)
    }
    #[inline(always)]
    fn exp_scalar(self, s: S, d: f32) -> f32 {
        s.scalar_exp(d)
    }
}

/// Base 2 relative to `r`: `t = x a - r` in one FMA ([`Base2`]).
#[derive(Clone, Copy)]
struct Base2At {
    a: f32,
    r: f32,
}

impl<S: Simd> Exponent<S> for Base2At {
    #[inline(always)]
    fn split(self, s: S, x: S::V) -> (S::V, S::V) {
        (x, s.mul_add(x, s.splat(self.a), s.splat(-self.r)))
    }
    #[inline(always)]
    fn split_scalar(self, s: S, x: f32) -> (f32, f32) {
        (x, s.scalar_mul_add(x, self.a, -self.r))
    }
    #[inline(always)]
    fn exp(self, s: S, t: S::V) -> S::V {
        s.exp2(t)
    }
    #[inline(always)]
    fn exp_scalar(self, s: S, t: f32) -> f32 {
        s.scalar_exp2(t)
    }
}

/// A tile's sums in the units of an [`Exponent`] `e`.
struct TileSums {
    /// `sum e^d` (`sum 2^t` in base 2).
    sum: f32,
    /// `sum e^d d`.
    sum_d: f32,
    /// `sum` of the values (only with `SUM_U`: label smoothing is its one user).
    sum_v: f32,
    /// `max` of the values (only with `MAX`, else -inf).
    max: f32,
}

/// [`tile_sums`]' running sums, 16 lanes each.
struct VectorSums<S: Simd> {
    sv: S::V,
    dv: S::V,
    vv: S::V,
    maxv: S::V,
}

impl<S: Simd> VectorSums<S> {
    #[inline(always)]
    fn new(s: S) -> Self {
        Self { sv: s.splat(0.0), dv: s.splat(0.0), vv: s.splat(0.0), maxv: s.splat(f32::NEG_INFINITY) }
    }

    /// Adds 16 logits (`c`, exactly 16) in the units of `e`; returns their `e^d`.
    #[inline(always)]
    fn add<T: Element, E: Exponent<S>, const SUM_U: bool, const MAX: bool>(&mut self, s: S, c: &[T], e: E) -> S::V {
        s.prefetch(ahead(c));
        self.add_widened::<E, SUM_U, MAX>(s, s.load_t(c), e)
    }

    /// Adds 32 logits (`c`, exactly 32) as [`Simd::load_pair_t`] widens them; returns their
    /// `e^d` in its layout.
    #[inline(always)]
    fn add_pair<T: Element, E: Exponent<S>, const SUM_U: bool, const MAX: bool>(
        &mut self,
        s: S,
        c: &[T],
        e: E,
    ) -> (S::V, S::V) {
        s.prefetch(ahead(c));
        s.prefetch(ahead(&c[LANES..]));
        let (a, b) = s.load_pair_t(c);
        (self.add_widened::<E, SUM_U, MAX>(s, a, e), self.add_widened::<E, SUM_U, MAX>(s, b, e))
    }

    /// Adds 16 widened logits `x`; returns their `e^d`.
    #[inline(always)]
    fn add_widened<E: Exponent<S>, const SUM_U: bool, const MAX: bool>(&mut self, s: S, x: S::V, e: E) -> S::V {
        let (v, d) = e.split(s, x);
        if MAX {
            self.maxv = s.max(self.maxv, v);
        }
        let p = e.exp(s, d);
        self.sv = s.add(self.sv, p);
        self.dv = s.mul_add(p, d, self.dv);
        if SUM_U {
            self.vv = s.add(self.vv, v);
        }
        p
    }
}

/// One sweep over a tile: [`TileSums`] in the units of `e`; with `STORE`, each `e^d` also goes to
/// `scratch` (the kept values [`sweep`] rescales). In natural units `e^d = exp(u - m)` with `m`
/// at or near the tile's maximum ([`statistics_natural`] only requires `max u <= m + HEADROOM`);
/// in base 2, per 16 logits the widening, one FMA, `exp2` (7 operations on AVX-512) and two sums:
/// 12 vector operations where natural units take 16 (no subtraction, clamp or rounding trick),
/// the maximum only where it is reported (tracking it cost 7% in cache on cpu-2c). On AVX2, per 8
/// logits, 17 where natural units take 25-26 (its `exp2` 12 operations, `exp` 19).
#[inline(always)]
fn tile_sums<S: Simd, T: Element, E: Exponent<S>, const STORE: bool, const SUM_U: bool, const MAX: bool>(
    s: S,
    tile: &[T],
    e: E,
    scratch: &mut [f32],
) -> TileSums {
    let (pairs, full) = (pair_end(tile.len()), tile.len() / LANES * LANES);
    let mut sums = VectorSums::new(s);
    // The logits 32 at a time (in the layout of `Simd::load_pair_t`, which the kept values keep:
    // `kept_index`), then 16, then one at a time. The kept values go to whole chunks of
    // `scratch` zipped with the logits' (the same bits as indexing it): with an index checked in
    // the loop, the in-place bf16 sweep ran ~5% slower in cache on cpu-2c, and a replica of the
    // loop alone ~27% (`bench/tools/zen4_sweep_costs.rs`; docs/BENCHMARKS.md, "Where the
    // in-place sweep's time goes").
    if STORE {
        let chunks = tile[..pairs].chunks_exact(2 * LANES).zip(scratch[..pairs].chunks_exact_mut(2 * LANES));
        for (c, kept) in chunks {
            let (a, b) = sums.add_pair::<T, E, SUM_U, MAX>(s, c, e);
            let (ka, kb) = kept.split_at_mut(LANES);
            s.store(a, ka);
            s.store(b, kb);
        }
        for (c, kept) in tile[pairs..full].chunks_exact(LANES).zip(scratch[pairs..full].chunks_exact_mut(LANES)) {
            let p = sums.add::<T, E, SUM_U, MAX>(s, c, e);
            s.store(p, kept);
        }
    } else {
        for c in tile[..pairs].chunks_exact(2 * LANES) {
            sums.add_pair::<T, E, SUM_U, MAX>(s, c, e);
        }
        for c in tile[pairs..full].chunks_exact(LANES) {
            sums.add::<T, E, SUM_U, MAX>(s, c, e);
        }
    }
    let VectorSums { sv, dv, vv, maxv } = sums;
    let (mut sa, mut da, mut va, mut ma) = (s.to_array(sv), s.to_array(dv), s.to_array(vv), s.to_array(maxv));
    for (k, x) in tile[full..].iter().enumerate() {
        let (v, d) = e.split_scalar(s, x.to_f32());
        if MAX {
            ma[k] = if ma[k] >= v { ma[k] } else { v };
        }
        let p = e.exp_scalar(s, d);
        if STORE {
            scratch[full + k] = p;
        }
        sa[k] += p;
        da[k] = s.scalar_mul_add(p, d, da[k]);
        if SUM_U {
            va[k] += v;
        }
    }
    TileSums {
        sum: pairwise(sa),
        sum_d: pairwise(da),
        sum_v: pairwise(va),
        max: ma.iter().fold(f32::NEG_INFINITY, |a, &x| if a >= x { a } else { x }),
    }
}

/// [`tile_sums`] in natural units relative to `m`, with the maximum.
#[inline(always)]
fn natural_sums<S: Simd, T: Element, const STORE: bool, const SUM_U: bool, const SCALED: bool>(
    s: S,
    tile: &[T],
    inv_t: f32,
    m: f32,
    scratch: &mut [f32],
) -> TileSums {
    tile_sums::<S, T, Natural<SCALED>, STORE, SUM_U, true>(s, tile, Natural { inv_t, m }, scratch)
}

/// How far above the reference a tile's values may go before the tile is redone relative to its
/// own maximum: `exp(8)` is far from overflow, and the rounding it costs the entropy is ~8 ulp.
const HEADROOM: f32 = 8.0;

/// Step 1 on one row part in natural units (`exp`), where the vector `exp2` is not native
/// ([`Simd::NATIVE_EXP2`]) or the temperature is too far from 1 for [`Base2`]; `target` is the
/// target's index within `row`, if it falls there.
///
/// The sums are kept relative to a reference `m`: the first tile's maximum, raised only when a
/// later tile exceeds it by more than [`HEADROOM`] (that tile is then summed again relative to
/// its own maximum, and the running sums rescaled — `stats.rs` explains the shifted entropy
/// accumulator). So each element is read once per tile, with its maximum found in the same sweep.
/// With `STORE`, each tile's `exp(u - m)` goes to `scratch` and the `m` it used to `tile_ref`.
#[inline(always)]
fn statistics_natural<S: Simd, T: Element, const STORE: bool, const SUM_U: bool, const SCALED: bool>(
    s: S,
    row: &[T],
    inv_t: f32,
    target: Option<usize>,
    scratch: &mut [f32],
    tile_ref: &mut [f64],
) -> PartialRowStats {
    let (mut m, mut sum, mut e, mut su, mut max) = (f32::NEG_INFINITY, 0.0f32, 0.0f32, 0.0f32, f32::NEG_INFINITY);
    for (t, tile) in row.chunks(TILE).enumerate() {
        if m == f32::NEG_INFINITY {
            let x_max = lanes_max(s, tile);
            m = if SCALED { x_max * inv_t } else { x_max };
        }
        let scratch_tile: &mut [f32] = if STORE { &mut scratch[t * TILE..t * TILE + tile.len()] } else { &mut [] };
        let mut sums = natural_sums::<S, T, STORE, SUM_U, SCALED>(s, tile, inv_t, m, scratch_tile);
        if sums.max > m + HEADROOM {
            let shift = m - sums.max;
            let k = s.scalar_exp(shift);
            e = s.scalar_mul_add(shift, sum, e) * k;
            sum *= k;
            m = sums.max;
            sums = natural_sums::<S, T, STORE, SUM_U, SCALED>(s, tile, inv_t, m, scratch_tile);
        }
        if STORE {
            tile_ref[t] = m as f64;
        }
        max = if max >= sums.max { max } else { sums.max };
        sum += sums.sum;
        e += sums.sum_d;
        su += sums.sum_v;
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
        // The f32 `u` the sums were taken of ([`PartialRowStats::target_u`]).
        target_u: target.map(|y| (row[y].to_f32() * inv_t) as f64),
        argmax: None,
    }
}

/// The statistics pass in base 2: `t = x a - r`, with `a = inv_t log2 e` rounded to f32 and `r`
/// a reference in the same units, so that one FMA takes a raw logit to the exponent of `exp2`
/// (temperature, shift and change of base at once) and AVX-512's `exp2` needs no clamp (AVX2's
/// clamps to [-127, 128], its exponent field's range). In the units of `u = x inv_t`:
/// `u - r w = t w` with `w = inv_t / a` (in f64; ~ln 2), up to the rounding of `t` (half an
/// ulp: at most 2.4e-7 for the `t` in [-4, 4] that carry the sums).
#[derive(Clone, Copy)]
struct Base2 {
    a: f32,
    w: f64,
}

impl Base2 {
    fn new(inv_t: f32) -> Self {
        let a = (inv_t as f64 * std::f64::consts::LOG2_E) as f32;
        Self { a, w: inv_t as f64 / a as f64 }
    }

    /// Whether a reference `r` leaves the fast path exact enough: `t = x a - r` of the logit that
    /// set it is the rounding of `r`, at most half an ulp, so `|r| < 2^24` keeps it within 0.5 (a
    /// larger one, from logits beyond ~1e7 such as finite masks of -1e15, could push every `2^t`
    /// of a tile below the subnormals); such tiles are summed exactly.
    fn carries(r: f32) -> bool {
        r.abs() < 16_777_216.0
    }

    /// Whether `a` can carry the logits: not for a temperature so far from 1 that `a` is 0,
    /// subnormal or infinite (the statistics are then computed in natural units).
    fn usable(self) -> bool {
        self.a.is_normal()
    }

    /// The reference of a tile whose largest raw logit is `x_max`.
    fn reference(self, x_max: f32) -> f32 {
        x_max * self.a
    }

    /// `r` in the units of `u`.
    fn natural(self, r: f32) -> f64 {
        r as f64 * self.w
    }
}

/// Sums of the fast tiles relative to one reference `r`, in base 2: each tile's in f32 (16
/// lanes, pairwise), the tiles' added in f64.
#[derive(Clone, Copy)]
struct Base2Sums {
    /// `sum 2^t`.
    sum: f64,
    /// `sum 2^t t`.
    sum_t: f64,
    /// `sum x` (raw logits; only with `SUM_U`).
    sum_x: f64,
    /// `max x` (raw logits; only with `MAX`, else -inf).
    max_x: f32,
}

impl Default for Base2Sums {
    fn default() -> Self {
        Self { sum: 0.0, sum_t: 0.0, sum_x: 0.0, max_x: f32::NEG_INFINITY }
    }
}

impl Base2Sums {
    /// Adds a fast tile's [`TileSums`] (taken in base 2 relative to the same `r`).
    fn add(&mut self, tile: &TileSums) {
        self.sum += tile.sum as f64;
        self.sum_t += tile.sum_d as f64;
        self.sum_x += tile.sum_v as f64;
        self.max_x = if self.max_x >= tile.max { self.max_x } else { tile.max };
    }

    /// As [`PartialRowStats`] in the units of `u`: relative to the fast tiles' maximum
    /// `max = max_x inv_t` (as the sweeps round `u`), the difference `kappa` between the
    /// reference `r w` and it (at most ~0.35 above it, the rounding of `r`: [`Base2::carries`])
    /// moved into the sums in f64. Without a tracked maximum, relative to the reference itself
    /// (below the maximum by at most `log2(FAST_SUM_LIMIT) w`, ~8.3).
    fn stats(self, units: Base2, r: f32, inv_t: f32) -> PartialRowStats {
        let sum_u = (self.sum_x * inv_t as f64) as f32;
        if self.sum == 0.0 {
            return PartialRowStats { sum_u, ..PartialRowStats::EMPTY };
        }
        // Where the maximum was not tracked (`max_x` -inf with a positive sum), the reference
        // rounded to f32 stands for it.
        let reference = units.natural(r);
        let max = if self.max_x > f32::NEG_INFINITY { self.max_x * inv_t } else { reference as f32 };
        let kappa = reference - max as f64;
        let scale = kappa.exp();
        let sum = self.sum;
        PartialRowStats {
            max,
            sum_exp: (sum * scale) as f32,
            sum_exp_shifted: ((units.w * self.sum_t + kappa * sum) * scale) as f32,
            sum_u,
            target_u: None,
            argmax: None,
        }
    }
}

/// A fast tile's sum of `2^t` stays at or below this: a tile of [`TILE`] values at or below its
/// reference sums to at most 2048, so only a tile with values well above the first tile's
/// maximum, or with non-finite ones (or finite ones whose `t` overflows, as `f32::MIN` used as a
/// mask), is summed again on the exact path.
const FAST_SUM_LIMIT: f64 = 4096.0;

/// Step 1 on one row part in base 2, where `exp2` is native ([`Simd::NATIVE_EXP2`]); `target`
/// is the target's index within `row`, if it falls there.
///
/// Tile by tile on the fast path ([`tile_sums`] in base 2) relative to one reference, the first
/// tile's maximum. A tile the fast path cannot carry (its sum above [`FAST_SUM_LIMIT`], or not
/// finite) is summed again exactly, relative to its own maximum ([`tile_sums`], natural units,
/// `exp`), and combined with the rest in f64 ([`PartialRowStats::combine`]); if its maximum is
/// above the reference, the later tiles take it as theirs. So each element is read once per tile
/// on the common path. With `STORE`, each tile's kept values (`2^t` or `exp(u - m)`) go to
/// `scratch` and the reference they are relative to, in the units of `u`, to `tile_ref`.
///
/// With `MAX` ([`statistics`] with `max`, whose results leave the crate as vocabulary shards'
/// partial statistics) they are [`PartialRowStats`]' own: relative to the row's maximum (the fast
/// tiles' sums moved from their reference to it in f64, [`Base2Sums::stats`]). Without (the
/// sweep's, and the whole vocabulary's statistics, which only reach `finish`) the maximum is not
/// tracked (one vector operation fewer of ~12 per 16 logits), and the sums may be relative to a
/// reference below it (by at most ~8.3): the same `lse` and entropy.
#[inline(always)]
fn statistics_base2<S: Simd, T: Element, const STORE: bool, const SUM_U: bool, const SCALED: bool, const MAX: bool>(
    s: S,
    row: &[T],
    units: Base2,
    inv_t: f32,
    target: Option<usize>,
    scratch: &mut [f32],
    tile_ref: &mut [f64],
) -> PartialRowStats {
    let (mut r, mut fast, mut exact) = (f32::NEG_INFINITY, Base2Sums::default(), PartialRowStats::EMPTY);
    // A NaN or Inf met on the exact path (`combine` would drop a NaN maximum).
    let mut poisoned = false;
    // Whether the target's tile was summed on the fast path (of exact products).
    let mut target_fast = false;
    for (t, tile) in row.chunks(TILE).enumerate() {
        let scratch_tile: &mut [f32] = if STORE { &mut scratch[t * TILE..t * TILE + tile.len()] } else { &mut [] };
        if r.is_nan() || r == f32::NEG_INFINITY {
            r = units.reference(lanes_max(s, tile));
        }
        if Base2::carries(r) {
            let e = Base2At { a: units.a, r };
            let sums = tile_sums::<S, T, Base2At, STORE, SUM_U, MAX>(s, tile, e, scratch_tile);
            if sums.sum as f64 <= FAST_SUM_LIMIT && sums.sum_d.is_finite() {
                fast.add(&sums);
                if STORE {
                    tile_ref[t] = units.natural(r);
                }
                target_fast |= target.is_some_and(|y| y / TILE == t);
                continue;
            }
        }
        let x_max = lanes_max(s, tile);
        let m = if SCALED { x_max * inv_t } else { x_max };
        let sums = natural_sums::<S, T, STORE, SUM_U, SCALED>(s, tile, inv_t, m, scratch_tile);
        if STORE {
            tile_ref[t] = m as f64;
        }
        let tile_stats = PartialRowStats {
            max: m,
            sum_exp: sums.sum,
            sum_exp_shifted: sums.sum_d,
            sum_u: sums.sum_v,
            target_u: None,
            argmax: None,
        };
        poisoned |= !tile_stats.is_finite();
        exact = exact.combine(tile_stats);
        if m.is_finite() && (m as f64) > units.natural(r) {
            // The later tiles relative to this maximum: what the fast tiles summed so far joins
            // the exact part first.
            exact = exact.combine(fast.stats(units, r, inv_t));
            fast = Base2Sums::default();
            r = units.reference(x_max);
        }
    }
    let mut stats = exact.combine(fast.stats(units, r, inv_t));
    if poisoned || (stats.max == f32::NEG_INFINITY && !row.is_empty()) {
        // A NaN or Inf, or every value -inf: make the row non-finite for the caller's check.
        stats.sum_exp = f32::NAN;
    }
    // Consistent with the sums that took the target ([`PartialRowStats::target_u`]): the exact
    // product on the fast path, whose `t = x a - r` is one FMA of the exact product; the f32 `u`
    // in a tile summed exactly (logits beyond ~1e7, whose `u - m` are of f32 `u`).
    stats.target_u = target.map(|y| {
        let x = row[y].to_f32();
        if target_fast {
            x as f64 * inv_t as f64
        } else {
            (x * inv_t) as f64
        }
    });
    stats
}

/// Step 1 on one row part. With [`RowMax::Reported`], the statistics are relative to the row
/// part's maximum, as [`PartialRowStats`] defines them (a vocabulary shard's, for
/// [`PartialRowStats::combine`]); with [`RowMax::Unneeded`], perhaps to a reference below it (the
/// base-2 pass, [`statistics_base2`]): for a whole row, whose statistics only reach
/// [`PartialRowStats::finish`].
#[inline(always)]
pub(crate) fn statistics<S: Simd, T: Element>(
    s: S,
    row: &[T],
    inv_t: f32,
    target: Option<usize>,
    sum_u: bool,
    max: RowMax,
) -> PartialRowStats {
    match max {
        RowMax::Reported => statistics_for::<S, T, false, true>(s, row, inv_t, target, sum_u, &mut [], &mut []),
        RowMax::Unneeded => statistics_for::<S, T, false, false>(s, row, inv_t, target, sum_u, &mut [], &mut []),
    }
}

/// Step 1 on one row part, in base 2 where that is cheaper ([`statistics_base2`]), else in
/// natural units ([`statistics_natural`]).
#[inline(always)]
fn statistics_impl<S: Simd, T: Element, const STORE: bool, const SUM_U: bool, const SCALED: bool, const MAX: bool>(
    s: S,
    row: &[T],
    inv_t: f32,
    target: Option<usize>,
    scratch: &mut [f32],
    tile_ref: &mut [f64],
) -> PartialRowStats {
    let units = Base2::new(inv_t);
    // A row part shorter than a vector (no vector work to save) in natural units, where each
    // term is `exp(u - m)` of a difference: a one-token vocabulary gets `lse = u`, `log p = 0`
    // and `H = 0` exactly, and rows equal up to a shift (exact differences) the same bits, as
    // the references give them. In base 2 the reference's rounding enters `2^t` (~1e-7), which
    // broke such ties: a TRL high-entropy mask over one-token rows, whose entropies all tie at
    // 0, kept only some of them (bench/tools/logits_fuzz.py).
    if S::NATIVE_EXP2 && units.usable() && row.len() >= LANES {
        statistics_base2::<S, T, STORE, SUM_U, SCALED, MAX>(s, row, units, inv_t, target, scratch, tile_ref)
    } else {
        statistics_natural::<S, T, STORE, SUM_U, SCALED>(s, row, inv_t, target, scratch, tile_ref)
    }
}

/// [`statistics_impl`] with `sum_u` and `inv_t != 1` made compile-time constants.
#[inline(always)]
fn statistics_for<S: Simd, T: Element, const STORE: bool, const MAX: bool>(
    s: S,
    row: &[T],
    inv_t: f32,
    target: Option<usize>,
    sum_u: bool,
    scratch: &mut [f32],
    tile_ref: &mut [f64],
) -> PartialRowStats {
    match (sum_u, inv_t != 1.0) {
        (true, true) => statistics_impl::<S, T, STORE, true, true, MAX>(s, row, inv_t, target, scratch, tile_ref),
        (true, false) => statistics_impl::<S, T, STORE, true, false, MAX>(s, row, inv_t, target, scratch, tile_ref),
        (false, true) => statistics_impl::<S, T, STORE, false, true, MAX>(s, row, inv_t, target, scratch, tile_ref),
        (false, false) => statistics_impl::<S, T, STORE, false, false, MAX>(s, row, inv_t, target, scratch, tile_ref),
    }
}

/// One tile's gradient values, 16 at a time (`vector(j)`: elements `j..j + 16`) or one at a time,
/// for [`write_tile`]. (A trait, not a closure: closures are not compiled with the kernels'
/// target features.)
trait TileValues<S: Simd> {
    fn vector(&self, s: S, j: usize) -> S::V;
    fn scalar(&self, s: S, j: usize) -> f32;
}

/// Values already computed in f32.
struct Computed<'a>(&'a [f32]);

impl<S: Simd> TileValues<S> for Computed<'_> {
    #[inline(always)]
    fn vector(&self, s: S, j: usize) -> S::V {
        s.load(&self.0[j..])
    }
    #[inline(always)]
    fn scalar(&self, _: S, j: usize) -> f32 {
        self.0[j]
    }
}

/// `kept * kb + d`: the statistics pass's kept values rescaled (the gradient without `log p`).
struct Rescaled<'a> {
    kept: &'a [f32],
    kb: f32,
    d: f32,
}

impl<S: Simd> TileValues<S> for Rescaled<'_> {
    #[inline(always)]
    fn vector(&self, s: S, j: usize) -> S::V {
        s.mul_add(s.load(&self.kept[j..]), s.splat(self.kb), s.splat(self.d))
    }
    #[inline(always)]
    fn scalar(&self, s: S, j: usize) -> f32 {
        s.scalar_mul_add(self.kept[j], self.kb, self.d)
    }
}

/// Zeros: the gradient of a row that has none.
struct Zeros;

impl<S: Simd> TileValues<S> for Zeros {
    #[inline(always)]
    fn vector(&self, s: S, _: usize) -> S::V {
        s.splat(0.0)
    }
    #[inline(always)]
    fn scalar(&self, _: S, _: usize) -> f32 {
        0.0
    }
}

/// The gradient of a row without one (masked, or a zero gradient): zeros, the logits not read
/// here. With `stream` (a buffer larger than the caches) by non-temporal stores where the
/// instruction set has them for `T`, as [`write_tile`] streams: a plain store would first read
/// each line it overwrites, the row's logits themselves where the gradient is written in place.
#[inline(always)]
pub(crate) fn zero_row<S: Simd, T: Element>(s: S, out: &mut [T], stream: bool) {
    let stream = stream && s.streams::<T>();
    write_tile(s, &Zeros, out, stream);
    if stream {
        s.stream_fence();
    }
}

/// Writes one tile of gradient values to `dst` in its dtype: whole vectors, then the tail shorter
/// than a vector one element at a time ([`Simd::round_t`]: the same rounding). Plain stores ask
/// ahead for the lines they will write (a new gradient buffer is not in cache). With `stream`
/// (which the caller sets only where [`Simd::streams`], as [`sweep`] does, since it also owes the
/// row its `sfence`) the whole 64-byte lines of `dst` are written by non-temporal stores
/// and the elements before the first and after the last go as in the plain loop: the same bits
/// wherever `dst` starts. Only whole lines: a line half streamed and half stored would be flushed
/// from the write-combining buffer partially and then read for the plain half.
#[inline(always)]
fn write_tile<S: Simd, T: Element, V: TileValues<S>>(s: S, values: &V, dst: &mut [T], stream: bool) {
    let len = dst.len();
    let mut j = 0;
    if stream {
        let line = 64 / std::mem::size_of::<T>();
        let first_line = dst.as_ptr().align_offset(64);
        if first_line < len && len - first_line >= line {
            let lines_end = first_line + (len - first_line) / line * line;
            plain_stores(s, values, &mut dst[..first_line], 0);
            for (k, out) in dst[first_line..lines_end].chunks_exact_mut(LANES).enumerate() {
                debug_assert!((out.as_ptr() as usize).is_multiple_of(LANES * std::mem::size_of::<T>()));
                s.stream_t(values.vector(s, first_line + k * LANES), out);
            }
            j = lines_end;
        }
    }
    plain_stores(s, values, &mut dst[j..], j);
}

/// Elements `first..first + dst.len()` of `values` into `dst` by plain stores: whole vectors,
/// asking ahead for their lines, then one element at a time.
#[inline(always)]
fn plain_stores<S: Simd, T: Element, V: TileValues<S>>(s: S, values: &V, dst: &mut [T], first: usize) {
    let full = dst.len() / LANES * LANES;
    for (k, out) in dst[..full].chunks_exact_mut(LANES).enumerate() {
        s.prefetch(ahead(out));
        s.store_t(values.vector(s, first + k * LANES), out);
    }
    for (j, out) in dst.iter_mut().enumerate().skip(full) {
        *out = s.round_t(values.scalar(s, first + j));
    }
}

/// `u <- p (b + c log p) + d` over a tile of `u` values, with `log p = u - lse` and `p = kept * k`
/// (the statistics pass's kept values, rescaled); [`recomputed`] is the same with `p` recomputed
/// (in natural units; in base 2 for 16-bit outputs).
/// (No closure here: closures are not compiled with the kernels' target features.)
#[inline(always)]
fn combine_tile<S: Simd, T: Element>(s: S, g: &RowGradient, u: &mut [f32], kept: &[f32], k: f32) {
    let (pairs, full) = (pair_end(u.len()), u.len() / LANES * LANES);
    let splats = [s.splat(g.lse), s.splat(g.b), s.splat(g.c), s.splat(g.d), s.splat(k)];
    // Zipped chunks, not indices checked in the loop (as `tile_sums`); the whole pairs' kept
    // values put in order in registers (`tile_sums` kept their even and odd positions apart where
    // `Simd::splits`).
    for (uc, kc) in u[..pairs].chunks_exact_mut(2 * LANES).zip(kept[..pairs].chunks_exact(2 * LANES)) {
        let (ka, kb) = s.pair_in_order::<T>(s.load(&kc[..LANES]), s.load(&kc[LANES..]));
        let (ua, ub) = uc.split_at_mut(LANES);
        combine_vector(s, g, &splats, ua, ka);
        combine_vector(s, g, &splats, ub, kb);
    }
    for (uc, kc) in u[pairs..full].chunks_exact_mut(LANES).zip(kept[pairs..full].chunks_exact(LANES)) {
        combine_vector(s, g, &splats, uc, s.load(kc));
    }
    for (uj, &kj) in u[full..].iter_mut().zip(&kept[full..]) {
        let log_p = *uj - g.lse;
        let p = kj * k;
        *uj = s.scalar_mul_add(p, s.scalar_mul_add(g.c, log_p, g.b), g.d);
    }
}

/// [`combine_tile`] on 16 values of `u` and their kept values; `splats` are `lse, b, c, d, k`.
/// (A function, not a closure: closures are not compiled with the kernels' target features.)
#[inline(always)]
fn combine_vector<S: Simd>(s: S, g: &RowGradient, splats: &[S::V; 5], u: &mut [f32], kept: S::V) {
    let [lse, b, c, d, k] = *splats;
    let log_p = s.sub(s.load(u), lse);
    let p = s.mul(kept, k);
    let out = if g.c == 0.0 { s.mul_add(p, b, d) } else { s.mul_add(p, s.mul_add(c, log_p, b), d) };
    s.store(out, u);
}

/// Step 3 on one row part, recomputing `p` from the logits:
/// `dlogits_j = a*[j = y] + p_j * (b + c * log p_j) + d`, in one pass: each 16 logits are read,
/// their gradient computed in registers and written (in place, over the same lines). Through a
/// tile buffer (widened, combined, then rounded: three passes over it) the in-place GSPO step ran
/// ~1.4x slower on cpu-2c. The same operations in the same order: the same bits.
/// With `large` (a buffer larger than the caches) a row without a gradient is written as
/// [`zero_row`] writes it, and a gradient written into another buffer goes there by streaming
/// stores where the instruction set has them for `T` (as [`sweep`]'s).
#[inline(always)]
pub(crate) fn gradient<S: Simd, T: Element>(
    s: S,
    dst: GradientTarget<'_, T>,
    g: &RowGradient,
    inv_t: f32,
    target: Option<usize>,
    large: bool,
) {
    if g.is_zero() {
        let (_, out) = dst.into_parts();
        zero_row(s, out, large);
        return;
    }
    let stream = large && matches!(dst, GradientTarget::Into { .. }) && s.streams::<T>();
    // The units, `inv_t == 1` and `c == 0` decided once per row part, not per vector (base 2
    // takes the temperature in its one FMA either way).
    gradient_dispatch(
        s,
        dst,
        g,
        inv_t,
        RowPass { g, r: Recompute::new::<S, T>(inv_t, g.lse), target, stream, weights: None },
    )
}

/// [`gradient`] of a row part whose last term is `d c_j`, with `weights` its columns' class
/// weights `c` (cross-entropy with class weights and label smoothing): each value takes
/// `d c_j` (one load and one FMA more per 16 logits) before its one rounding. Plain stores: the
/// caller keeps such rows in cache.
#[inline(always)]
pub(crate) fn gradient_weighted<S: Simd, T: Element>(
    s: S,
    dst: GradientTarget<'_, T>,
    g: &RowGradient,
    inv_t: f32,
    target: Option<usize>,
    weights: &[f32],
) {
    debug_assert_eq!(weights.len(), dst.logits().len());
    let without_d = g.without_d();
    if g.is_zero() {
        let (_, out) = dst.into_parts();
        zero_row(s, out, false);
        return;
    }
    let r = Recompute::new::<S, T>(inv_t, g.lse);
    let row = RowPass { g: &without_d, r, target, stream: false, weights: Some((weights, g.d)) };
    gradient_dispatch(s, dst, &without_d, inv_t, row)
}

/// [`gradient_pass`] with the units, `inv_t == 1` and `c == 0` decided once per row part.
#[inline(always)]
fn gradient_dispatch<S: Simd, T: Element>(
    s: S,
    dst: GradientTarget<'_, T>,
    g: &RowGradient,
    inv_t: f32,
    row: RowPass<'_>,
) {
    let r = row.r;
    match (r.base2, inv_t != 1.0, g.c != 0.0) {
        (true, _, true) => gradient_pass::<S, T, false, true, true>(s, dst, row),
        (true, _, false) => gradient_pass::<S, T, false, false, true>(s, dst, row),
        (false, true, true) => gradient_pass::<S, T, true, true, false>(s, dst, row),
        (false, true, false) => gradient_pass::<S, T, true, false, false>(s, dst, row),
        (false, false, true) => gradient_pass::<S, T, false, true, false>(s, dst, row),
        (false, false, false) => gradient_pass::<S, T, false, false, false>(s, dst, row),
    }
}

/// What [`gradient_pass`] needs of its row besides the logits.
#[derive(Clone, Copy)]
struct RowPass<'g> {
    g: &'g RowGradient,
    r: Recompute,
    target: Option<usize>,
    /// Whether the gradient goes out by streaming stores.
    stream: bool,
    /// The columns' class weights and the `d` they multiply ([`gradient_weighted`]; never
    /// streamed).
    weights: Option<(&'g [f32], f32)>,
}

/// `v + d c_j..j+16` with class weights, else `v`.
#[inline(always)]
fn with_weights<S: Simd>(s: S, v: S::V, weights: Option<(&[f32], f32)>, j: usize) -> S::V {
    match weights {
        Some((c, d)) => s.mul_add(s.load(&c[j..]), s.splat(d), v),
        None => v,
    }
}

/// How [`recomputed`] takes a logit to `p`: in natural units, `u = x inv_t` and `p = exp(u - lse)`;
/// in base 2, where the output is 16-bit and `exp2` is native ([`Simd::NATIVE_EXP2`]), `t = x
/// (inv_t log2 e) - lse log2 e` in one FMA and `p = 2^t` (8 operations where natural units take
/// 11-12 on AVX-512; on AVX2 13 where they take 20-21 per 8 logits). Base 2's `t` carries the
/// rounding of both scaled terms, up to ~3e-6 relative in `p` at logits near 30: far below a bf16
/// or f16 output's own rounding (2^-9, 2^-11), and kept away from f32 outputs, which stay in
/// natural units, and from rows whose `|lse log2 e|` reaches 2^10 (logits in the thousands: the
/// shift's rounding would approach f16's) or whose scale is not a normal number. The scalar tail
/// (under 16 logits) stays in natural units.
#[derive(Clone, Copy)]
struct Recompute {
    base2: bool,
    /// `inv_t` (for the tail, and the vectors in natural units).
    inv_t: f32,
    /// `inv_t`, or `inv_t log2 e` in base 2.
    scale: f32,
    /// `lse`, or `lse log2 e` in base 2.
    shift: f32,
}

impl Recompute {
    #[inline(always)]
    fn new<S: Simd, T: Element>(inv_t: f32, lse: f32) -> Self {
        use std::f32::consts::LOG2_E;
        let (scale, shift) = (inv_t * LOG2_E, lse * LOG2_E);
        let base2 = S::NATIVE_EXP2 && std::mem::size_of::<T>() == 2 && scale.is_normal() && shift.abs() < 1024.0;
        if base2 {
            Self { base2, inv_t, scale, shift }
        } else {
            Self { base2, inv_t, scale: inv_t, shift: lse }
        }
    }
}

/// `p (b + c log p) + d` of 16 logits `x` with `p` recomputed in base 2 (`BASE2`, as `r` was
/// made) or natural units (`u = x inv_t` with `SCALED`), the `c` term with `LOG_P`.
#[inline(always)]
fn recomputed<S: Simd, const SCALED: bool, const LOG_P: bool, const BASE2: bool>(
    s: S,
    x: S::V,
    r: Recompute,
    g: &RowGradient,
) -> S::V {
    let (p, log_p) = if BASE2 {
        let t = s.mul_add(x, s.splat(r.scale), s.splat(-r.shift));
        (s.exp2(t), s.mul(t, s.splat(std::f32::consts::LN_2)))
    } else {
        let u = if SCALED { s.mul(x, s.splat(r.scale)) } else { x };
        let log_p = s.sub(u, s.splat(r.shift));
        (s.exp(log_p), log_p)
    };
    if LOG_P {
        s.mul_add(p, s.mul_add(s.splat(g.c), log_p, s.splat(g.b)), s.splat(g.d))
    } else {
        s.mul_add(p, s.splat(g.b), s.splat(g.d))
    }
}

/// The scalar tail's value (under 16 logits at a row's end), in natural units.
#[inline(always)]
fn tail_value<S: Simd, T: Element>(s: S, x: T, r: Recompute, g: &RowGradient) -> f32 {
    let log_p = x.to_f32() * r.inv_t - g.lse;
    let p = s.scalar_exp(log_p);
    s.scalar_mul_add(p, s.scalar_mul_add(g.c, log_p, g.b), g.d)
}

/// [`gradient_pass`]'s values for [`write_tile`], which starts its vectors where the output's
/// lines start: below `full` (the row's whole vectors) each element as the vector loop computes
/// it (lane by lane: the same bits in any group of 16), from `full` on as the scalar tail does,
/// so that a streamed row has the plain loop's bits.
struct Recomputed<'a, T, const SCALED: bool, const LOG_P: bool, const BASE2: bool> {
    logits: &'a [T],
    r: Recompute,
    g: &'a RowGradient,
    full: usize,
}

impl<S: Simd, T: Element, const SCALED: bool, const LOG_P: bool, const BASE2: bool> TileValues<S>
    for Recomputed<'_, T, SCALED, LOG_P, BASE2>
{
    #[inline(always)]
    fn vector(&self, s: S, j: usize) -> S::V {
        if j + LANES <= self.full {
            // The logits come from memory (as in the plain loop: the prefetchers alone left it
            // waiting on an Intel CPU).
            s.prefetch(ahead(&self.logits[j..]));
            return recomputed::<S, SCALED, LOG_P, BASE2>(s, s.load_t(&self.logits[j..]), self.r, self.g);
        }
        // Across `full` (once a row at most): element by element.
        let mut lanes = [0.0; LANES];
        for (i, lane) in lanes.iter_mut().enumerate() {
            *lane = self.scalar(s, j + i);
        }
        s.load(&lanes)
    }
    #[inline(always)]
    fn scalar(&self, s: S, j: usize) -> f32 {
        if j < self.full {
            let start = j / LANES * LANES;
            let v = recomputed::<S, SCALED, LOG_P, BASE2>(s, s.load_t(&self.logits[start..]), self.r, self.g);
            s.to_array(v)[j - start]
        } else {
            tail_value(s, self.logits[j], self.r, self.g)
        }
    }
}

/// [`gradient`] with `inv_t != 1`, `c != 0` and the units ([`Recompute`]) made compile-time
/// constants.
#[inline(always)]
fn gradient_pass<S: Simd, T: Element, const SCALED: bool, const LOG_P: bool, const BASE2: bool>(
    s: S,
    dst: GradientTarget<'_, T>,
    row: RowPass<'_>,
) {
    let RowPass { g, r, target, stream, weights } = row;
    debug_assert!(!(stream && weights.is_some()), "class-weighted rows are not streamed");
    let (src, out) = dst.into_parts();
    let len = out.len();
    let full = len / LANES * LANES;
    // The 16 logits around the target, kept before an in-place pass overwrites them.
    let target_vector = target.filter(|&y| y < full).map(|y| {
        let start = y / LANES * LANES;
        let mut kept = [T::from_f32(0.0); LANES];
        kept.copy_from_slice(&src.unwrap_or(out)[start..start + LANES]);
        (y, start, kept)
    });
    let streamed = match src {
        Some(logits) if stream => {
            write_tile(s, &Recomputed::<T, SCALED, LOG_P, BASE2> { logits, r, g, full }, out, true);
            s.stream_fence(); // the streamed lines before the target's store over them
            true
        }
        Some(logits) => {
            for j in (0..full).step_by(LANES) {
                s.prefetch(ahead(&logits[j..]));
                s.prefetch(ahead(&out[j..]));
                let v = recomputed::<S, SCALED, LOG_P, BASE2>(s, s.load_t(&logits[j..]), r, g);
                s.store_t(with_weights(s, v, weights, j), &mut out[j..]);
            }
            false
        }
        None => {
            for j in (0..full).step_by(LANES) {
                s.prefetch(ahead(&out[j..]));
                let v = recomputed::<S, SCALED, LOG_P, BASE2>(s, s.load_t(&out[j..]), r, g);
                s.store_t(with_weights(s, v, weights, j), &mut out[j..]);
            }
            false
        }
    };
    if let Some((y, start, kept)) = target_vector {
        let v = recomputed::<S, SCALED, LOG_P, BASE2>(s, s.load_t(&kept), r, g);
        let mut lanes = s.to_array(with_weights(s, v, weights, start));
        lanes[y - start] += g.a;
        s.store_t(s.load(&lanes), &mut out[start..]);
    }
    // The tail shorter than a vector, one logit at a time (streamed: written, but for the
    // target's `a`).
    for j in full..len {
        if streamed && target != Some(j) {
            continue;
        }
        let mut value = tail_value(s, src.map_or(out[j], |l| l[j]), r, g);
        if let Some((c, d)) = weights {
            value = s.scalar_mul_add(d, c[j], value);
        }
        if target == Some(j) {
            value += g.a;
        }
        out[j] = s.round_t(value);
    }
}

thread_local! {
    /// Per-thread scratch of [`sweep`]: the kept values of the row being processed (`exp(u -
    /// m_tile)`, or `2^t` on the base-2 path), and each tile's reference `m_tile` in the units of
    /// `u` (f64: see [`Base2`]). Grows to the widest row seen; a 151936-wide row takes 594 KiB.
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
mod tests {
    //! The statistics pass against f64 on every instruction set: [`statistics`] reports the row's
    //! maximum (as [`PartialRowStats`] defines it), whichever path (base 2 or exact) each tile
    //! took, and its statistics without the maximum (a whole row's) and [`sweep`]'s give the same
    //! `lse`, entropy and `log p`.
    use super::super::isa::{with_f32_streams, with_isa, Isa};
    use super::super::{GradientTarget, Kernels, RowMax};
    use crate::element::{DType, Element};
    use crate::objective::RowGradient;
    use crate::stats::PartialRowStats;
    use crate::synthetic::normal_matrix;

    /// Rows that send tiles down each path: plain, a later tile far above the first (exact path,
    /// new reference), a later tile a little above (base 2, reference kept below the maximum),
    /// masks near `f32::MIN` (`t` overflows; bf16 holds them), logits too large for a base-2
    /// reference, a tail shorter than a vector.
    fn rows() -> Vec<(&'static str, Vec<f32>)> {
        let plain = normal_matrix(1, 10_007, 2.0, 11);
        let mut spiky = plain.clone();
        spiky[7000] = 60.0;
        let mut above = plain.clone();
        for x in &mut above[4100..4200] {
            *x += 5.0;
        }
        let mut masked = plain.clone();
        for x in masked.iter_mut().skip(3000).step_by(3) {
            *x = -3.0e38;
        }
        let mut huge = plain.clone();
        huge[10] = 5.0e9;
        vec![
            ("plain", plain),
            ("spiky", spiky),
            ("above", above),
            ("masked", masked),
            // Finite masks far beyond 2^24 / log2(e): the base-2 reference would be off by more
            // than its own rounding (every 2^t of the tile below the subnormals).
            ("all -1e15", vec![-1.0e15; 5000]),
            ("all -1e36", vec![-1.0e36; 5000]),
            ("huge first", huge),
            ("short", vec![0.5, -3.0, 9.0]),
        ]
    }

    /// The statistics of `u = x * inv_t` in f32, summed in f64; the target's `u` the exact product.
    fn reference(row: &[f32], inv_t: f32, target: usize) -> PartialRowStats {
        let u: Vec<f32> = row.iter().map(|&x| x * inv_t).collect();
        let m = u.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e = |x: f32| (x as f64 - m as f64).exp();
        PartialRowStats {
            max: m,
            sum_exp: u.iter().map(|&x| e(x)).sum::<f64>() as f32,
            sum_exp_shifted: u.iter().map(|&x| e(x) * (x as f64 - m as f64)).sum::<f64>() as f32,
            sum_u: u.iter().map(|&x| x as f64).sum::<f64>() as f32,
            // The exact product, or beyond what a base-2 reference carries (and in a row shorter
            // than a vector, `check`) its f32 rounding, as the kernels take it.
            target_u: Some(if (row[target] * inv_t).abs() < 1.0e7 {
                row[target] as f64 * inv_t as f64
            } else {
                (row[target] * inv_t) as f64
            }),
            argmax: None,
        }
    }

    fn check(what: &str, got: PartialRowStats, want: &PartialRowStats) {
        assert_eq!(got.max, want.max, "{what}: max");
        // The exact product, or (a row shorter than a vector) its f32 rounding.
        let (g, w) = (got.target_u.expect("a target"), want.target_u.expect("a target"));
        assert!((g - w).abs() <= w.abs() * f32::EPSILON as f64 / 2.0, "{what}: target {g} vs {w}");
        let close = |a: f32, b: f32, tol: f64| (a as f64 - b as f64).abs() <= tol * b.abs().max(1.0) as f64;
        assert!(close(got.sum_exp, want.sum_exp, 2e-6), "{what}: sum_exp {} vs {}", got.sum_exp, want.sum_exp);
        // `e` in the units of the entropy it gives, `H = ln s - e / s`, against LOSSES.md's 1e-5
        // (the "above" row, values well above the first tile's maximum, is the worst: ~6e-6).
        let (de, s) = ((got.sum_exp_shifted as f64 - want.sum_exp_shifted as f64).abs(), want.sum_exp as f64);
        assert!(de / s <= 1e-5, "{what}: sum_exp_shifted {} vs {}", got.sum_exp_shifted, want.sum_exp_shifted);
        if !want.sum_u.is_finite() {
            return;
        }
        assert!(close(got.sum_u, want.sum_u, 1e-5), "{what}: sum_u {} vs {}", got.sum_u, want.sum_u);
    }

    fn every_row<T: Element>(isa: Isa) {
        for (name, row) in rows() {
            let row: Vec<T> = row.iter().map(|&x| T::from_f32(x)).collect();
            let widened: Vec<f32> = row.iter().map(|x| x.to_f32()).collect();
            for inv_t in [1.0f32, 1.0 / 0.7] {
                if name == "masked" && inv_t != 1.0 {
                    continue; // the masks' u overflows to -inf: a non-finite row
                }
                let target = widened.len() / 2;
                let want = reference(&widened, inv_t, target);
                let what = format!("{isa:?} {name} {} inv_t {inv_t}", std::any::type_name::<T>());
                let k = with_isa(isa, Kernels::<T>::select);
                check(&what, k.statistics(&row, inv_t, Some(target), true, RowMax::Reported), &want);
                // Without the maximum (a whole row's statistics): what `finish` makes of them.
                let loose = k.statistics(&row, inv_t, Some(target), true, RowMax::Unneeded);
                let t = 1.0 / inv_t as f64;
                let (got, want_whole) = (loose.finish(row.len(), t), want.finish(row.len(), t));
                assert!(
                    (got.lse - want_whole.lse).abs() <= 1e-6 * want_whole.lse.abs().max(1.0),
                    "{what} (no max): lse"
                );
                assert!((got.entropy - want_whole.entropy).abs() <= 1e-5, "{what} (no max): entropy");
                let mut swept = None;
                let mut out = row.clone();
                k.sweep(GradientTarget::InPlace(&mut out), inv_t, Some(target), true, false, &mut |s, _| {
                    swept = Some(s);
                    Some(RowGradient::ZERO)
                });
                // The sweep's sums may be relative to a reference below the maximum: what
                // `finish` makes of them is what must agree.
                let (got, want) = (swept.expect("finish called").finish(row.len(), t), want.finish(row.len(), t));
                assert!((got.lse - want.lse).abs() <= 1e-6 * want.lse.abs().max(1.0), "{what} (sweep): lse");
                assert!((got.entropy - want.entropy).abs() <= 1e-5, "{what} (sweep): entropy");
                let (got_logp, want_logp) = (got.logp.expect("a target"), want.logp.expect("a target"));
                assert!((got_logp - want_logp).abs() <= 1e-6 * want_logp.abs().max(1.0), "{what} (sweep): logp");
            }
        }
    }

    /// [`super::gradient`] (`p` recomputed) against f64 on every instruction set: rows whose
    /// length is and is not a multiple of 16, the target in the head, the vectors, the tail or
    /// absent, with and without temperature and the `c log p` term, in place and into another
    /// buffer (the same bits); with `large`, into a buffer at every offset of a line (streamed
    /// where `T` streams: the same bits, nothing outside the row) and in place; outputs in f32's
    /// subnormal range (which AVX512-BF16's conversion flushes) and a zero gradient.
    fn recomputed_gradient<T: Element>(isa: Isa) {
        // f32 to its accuracy; 16-bit outputs to their rounding (half an ulp: 2^-9, 2^-11) and a
        // margin for `p`'s own error (base 2 on AVX-512 and AVX2).
        let tolerance = match T::DTYPE {
            DType::F32 => 4e-6,
            DType::BF16 => 4.5e-3,
            DType::F16 => 1e-3,
        };
        let k = with_isa(isa, Kernels::<T>::select);
        for len in [1000, 100, 37, 5] {
            let row: Vec<T> = normal_matrix(1, len, 2.0, len as u64).iter().map(|&x| T::from_f32(x)).collect();
            for (inv_t, c, target) in [
                (1.0f32, 0.0f32, Some(len / 2)),
                (1.0 / 0.7, -0.3, Some(len - 1)),
                (1.0, 0.2, None),
                (1.0, 0.0, Some(3.min(len - 1))),
            ] {
                let u: Vec<f64> = row.iter().map(|x| (x.to_f32() * inv_t) as f64).collect();
                let lse = u.iter().map(|&x| x.exp()).sum::<f64>().ln() as f32;
                let tiny = |b: f32| RowGradient { lse, a: 0.0, b, c, d: 0.0 };
                for g in
                    [RowGradient { lse, a: -0.8, b: 0.6, c, d: 0.01 }, tiny(1e-38), tiny(-1e-38), RowGradient::ZERO]
                {
                    let what = format!("{isa:?} {} len {len} inv_t {inv_t} c {c} {g:?}", std::any::type_name::<T>());
                    let into = gradients_agree(k, &row, &g, inv_t, target, &what);
                    for (j, (&x, got)) in u.iter().zip(&into).enumerate() {
                        let log_p = x - g.lse as f64;
                        let p = if g.is_zero() { 0.0 } else { log_p.exp() };
                        let want = p * (g.b as f64 + g.c as f64 * log_p)
                            + g.d as f64
                            + if target == Some(j) { g.a as f64 } else { 0.0 };
                        let err = (got.to_f32() as f64 - want).abs();
                        assert!(
                            err <= tolerance * want.abs().max(0.01),
                            "{what}: element {j}: {} against {want}",
                            got.to_f32()
                        );
                    }
                }
            }
        }
    }

    /// The gradient of `row` into another buffer, after checking that in place, and with `large`
    /// into a buffer at every offset of a line and in place, give the same bits (and nothing is
    /// written outside the row).
    fn gradients_agree<T: Element>(
        k: Kernels<T>,
        row: &[T],
        g: &RowGradient,
        inv_t: f32,
        target: Option<usize>,
        what: &str,
    ) -> Vec<T> {
        let len = row.len();
        let bits = |x: &[T]| x.iter().map(|v| v.to_f32().to_bits()).collect::<Vec<_>>();
        let mut into = vec![T::from_f32(0.0); len];
        k.gradient(GradientTarget::Into { logits: row, out: &mut into }, g, inv_t, target, false);
        for large in [false, true] {
            let mut in_place = row.to_vec();
            k.gradient(GradientTarget::InPlace(&mut in_place), g, inv_t, target, large);
            assert_eq!(bits(&into), bits(&in_place), "{what} large {large}: in place and into another buffer");
        }
        for offset in 0..64 / std::mem::size_of::<T>() {
            let mut buffer = vec![T::from_f32(f32::NAN); len + 64];
            let out = &mut buffer[offset..offset + len];
            k.gradient(GradientTarget::Into { logits: row, out }, g, inv_t, target, true);
            assert_eq!(bits(&into), bits(&buffer[offset..offset + len]), "{what} offset {offset}: streamed and plain");
            let mut outside = buffer[..offset].iter().chain(&buffer[offset + len..]);
            assert!(outside.all(|x| x.to_f32().is_nan()), "{what} offset {offset}: a store outside the row");
        }
        into
    }

    /// `check` with f32 written by plain stores and by streaming ones, whatever the CPU's vendor
    /// (`isa::streams_f32`).
    fn f32_plain_and_streamed(check: impl Fn()) {
        for streams in [false, true] {
            with_f32_streams(streams, &check);
        }
    }

    #[test]
    fn recomputed_gradient_matches_f64_on_every_instruction_set() {
        for isa in Isa::available() {
            f32_plain_and_streamed(|| recomputed_gradient::<f32>(isa));
            recomputed_gradient::<half::bf16>(isa);
            recomputed_gradient::<half::f16>(isa);
        }
    }

    /// [`super::sweep`] into another buffer with streaming stores writes the same bits as with
    /// plain ones, wherever the output starts (every offset of a 64-byte line), on rows shorter
    /// than a line, of a few tiles with a ragged tail, with the target in a tile's head, body and
    /// tail, with and without the `c log p` term, for a zero gradient and for subnormal outputs;
    /// and the values against f64 (`p (b + c log p) + d + a [j = y]` from the same `lse`), on
    /// lengths around the 32-value pairs of [`super::tile_sums`] (their kept layout, the target
    /// in a pair's even or odd position or after the pairs).
    fn streamed_sweep<T: Element>(isa: Isa) {
        let k = with_isa(isa, Kernels::<T>::select);
        let tile = super::TILE;
        for len in [7, 32, 40, 63, 2 * tile + 77, tile + 48] {
            let row: Vec<T> = normal_matrix(1, len, 2.0, len as u64).iter().map(|&x| T::from_f32(x)).collect();
            // Without `c log p` the target's fix-up reads its kept value through `kept_index`:
            // targets at even (2, len / 2 for the longer rows) and odd (3, len / 2 + 1) positions.
            let cases = [
                (0.0f32, Some(3)),
                (0.0, Some(len - 1)),
                (-0.3, Some(len / 2)),
                (0.0, None),
                (0.0, Some(len / 2 + 1)),
                (0.0, Some(len / 2)),
                (0.0, Some(2)),
            ];
            for (c, target) in cases {
                // The last: outputs in f32's subnormal range, which AVX512-BF16's vector
                // conversion flushes to zero (and so must the scalar heads and tails).
                let tiny = |b: f32| RowGradient { lse: 0.0, a: 0.0, b, c, d: 0.0 };
                let normal = RowGradient { lse: 0.0, a: -0.8, b: 0.6, c, d: 0.01 };
                for g in [normal, RowGradient::ZERO, tiny(1e-38), tiny(-1e-38)] {
                    let lse_used = std::cell::Cell::new(0.0f32);
                    let swept = |stream: bool, offset: usize| {
                        let mut buffer = vec![T::from_f32(f32::NAN); len + 64];
                        let out = &mut buffer[offset..offset + len];
                        let mut finish = |stats: PartialRowStats, _: &[_]| {
                            let lse = stats.finish(len, 1.0).lse as f32;
                            lse_used.set(lse);
                            Some(if g.is_zero() { g } else { RowGradient { lse, ..g } })
                        };
                        let into = GradientTarget::Into { logits: &row, out };
                        assert!(k.sweep(into, 1.0, target, false, stream, &mut finish));
                        let outside = buffer[..offset].iter().chain(&buffer[offset + len..]);
                        assert!(outside.clone().all(|x| x.to_f32().is_nan()), "a store outside the row");
                        buffer[offset..offset + len].to_vec()
                    };
                    let plain = swept(false, 0);
                    assert!(plain.iter().all(|x| x.to_f32().is_finite()), "every element written");
                    if g.b == normal.b {
                        let lse = lse_used.get() as f64;
                        for (j, (x, got)) in row.iter().zip(&plain).enumerate() {
                            let log_p = x.to_f32() as f64 - lse;
                            let hit = if target == Some(j) { g.a as f64 } else { 0.0 };
                            let want = log_p.exp() * (g.b as f64 + g.c as f64 * log_p) + g.d as f64 + hit;
                            let err = (got.to_f32() as f64 - want).abs();
                            // The output's rounding (bf16's half an ulp: 2^-9) and f32's.
                            assert!(
                                err <= want.abs() / 256.0 + 1e-7,
                                "{isa:?} {} len {len} c {c} target {target:?}: element {j} {} against f64 {want}",
                                std::any::type_name::<T>(),
                                got.to_f32()
                            );
                        }
                    }
                    for offset in 0..64 / std::mem::size_of::<T>() {
                        let what = format!(
                            "{isa:?} {} len {len} c {c} target {target:?} offset {offset}",
                            std::any::type_name::<T>()
                        );
                        let streamed = swept(true, offset);
                        let same =
                            plain.iter().zip(&streamed).all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits());
                        assert!(same, "{what}: streamed and plain stores differ");
                    }
                }
            }
        }
    }

    /// A masked row's gradient ([`super::zero_row`]): positive zeros over the whole row and
    /// nothing outside it, streamed or not, wherever the row starts and however long it is.
    fn zero_rows<T: Element>(isa: Isa) {
        let k = with_isa(isa, Kernels::<T>::select);
        for len in [0, 1, 7, 16, 31, 40, 100, super::TILE + 77] {
            for offset in 0..64 / std::mem::size_of::<T>() {
                for stream in [false, true] {
                    let mut buffer = vec![T::from_f32(f32::NAN); len + 64];
                    k.zero_row(&mut buffer[offset..offset + len], stream);
                    let what = format!("{isa:?} {} len {len} offset {offset}", std::any::type_name::<T>());
                    let (row, outside) =
                        (&buffer[offset..offset + len], buffer[..offset].iter().chain(&buffer[offset + len..]));
                    assert!(row.iter().all(|x| x.to_f32().to_bits() == 0), "{what}: not +0 in the row");
                    assert!(outside.clone().all(|x| x.to_f32().is_nan()), "{what}: a store outside the row");
                }
            }
        }
    }

    #[test]
    fn masked_rows_are_zeros_on_every_instruction_set() {
        for isa in Isa::available() {
            f32_plain_and_streamed(|| zero_rows::<f32>(isa));
            zero_rows::<half::bf16>(isa);
            zero_rows::<half::f16>(isa);
        }
    }

    #[test]
    fn streamed_sweep_writes_the_same_bits_on_every_instruction_set() {
        for isa in Isa::available() {
            f32_plain_and_streamed(|| streamed_sweep::<f32>(isa));
            streamed_sweep::<half::bf16>(isa);
            streamed_sweep::<half::f16>(isa);
        }
    }

    /// `log p` of rows of large logits (~20, where half an ulp of `u` is ~1e-6) at temperatures
    /// whose f32 inverse is inexact, against f64 at `1 / T`: the base-2 pass's sums are of exact
    /// products and `finish` moves them to `1 / T` ([`PartialRowStats::finish`]). The portable
    /// kernels (natural units, the f32 `u`) are held to f32's rounding of `u` instead.
    fn logp_at_the_exact_temperature<T: Element>(isa: Isa) {
        let k = with_isa(isa, Kernels::<T>::select);
        for len in [33, 4097, 10_007] {
            let row: Vec<T> = normal_matrix(1, len, 2.0, 5).iter().map(|&x| T::from_f32(20.0 + x)).collect();
            let x: Vec<f64> = row.iter().map(|v| v.to_f32() as f64).collect();
            for temperature in [0.7, 0.31, 1.3, 0.9] {
                let u: Vec<f64> = x.iter().map(|&v| v / temperature).collect();
                let m = u.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let lse = m + u.iter().map(|&v| (v - m).exp()).sum::<f64>().ln();
                let inv_t = crate::stats::inverse_temperature(temperature);
                for y in [0, len / 3, len - 1] {
                    let stats = k.statistics(&row, inv_t, Some(y), false, RowMax::Unneeded);
                    let (got, want) = (stats.finish(len, temperature).logp.expect("a target"), u[y] - lse);
                    let tolerance = if isa == Isa::Generic { f32::EPSILON as f64 * m } else { 4e-7 };
                    assert!(
                        (got - want).abs() <= tolerance,
                        "{isa:?} {} len {len} T {temperature} y {y}: {got} vs {want}",
                        std::any::type_name::<T>()
                    );
                }
            }
        }
    }

    #[test]
    fn logp_is_that_of_the_exact_temperature_on_every_instruction_set() {
        for isa in Isa::available() {
            logp_at_the_exact_temperature::<f32>(isa);
            logp_at_the_exact_temperature::<half::bf16>(isa);
        }
    }

    #[test]
    fn statistics_report_the_rows_maximum_on_every_instruction_set() {
        for isa in Isa::available() {
            every_row::<f32>(isa);
            every_row::<half::bf16>(isa);
        }
    }
}

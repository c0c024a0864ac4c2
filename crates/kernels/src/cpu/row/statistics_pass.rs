//! Step 1 on a row: its statistics (`lse`, the entropy's sum, `sum u`), tile by tile, in base 2
//! where the vector `exp2` is native, else in natural units.

use super::super::simd::{Simd, LANES};
use super::super::RowMax;
use super::{ahead, pair_end, TILE};
use crate::element::Element;
use crate::stats::PartialRowStats;

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
/// `scratch` (the kept values [`super::sweep`] rescales). In natural units `e^d = exp(u - m)` with `m`
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
pub(super) fn statistics_for<S: Simd, T: Element, const STORE: bool, const MAX: bool>(
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

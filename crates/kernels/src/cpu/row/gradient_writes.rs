//! Step 3 on a row: its gradient written tile by tile, from the kept values ([`super::sweep`])
//! or recomputed from the logits ([`gradient`]), by plain or non-temporal stores.

use super::super::simd::{Simd, LANES};
use super::super::GradientTarget;
use super::{ahead, pair_end};
use crate::element::Element;
use crate::objective::RowGradient;

/// One tile's gradient values, 16 at a time (`vector(j)`: elements `j..j + 16`) or one at a time,
/// for [`write_tile`]. (A trait, not a closure: closures are not compiled with the kernels'
/// target features.)
pub(super) trait TileValues<S: Simd> {
    fn vector(&self, s: S, j: usize) -> S::V;
    fn scalar(&self, s: S, j: usize) -> f32;
}

/// Values already computed in f32.
pub(super) struct Computed<'a>(pub(super) &'a [f32]);

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
pub(super) struct Rescaled<'a> {
    pub(super) kept: &'a [f32],
    pub(super) kb: f32,
    pub(super) d: f32,
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
/// (which the caller sets only where [`Simd::streams`], as [`super::sweep`] does, since it also owes the
/// row its `sfence`) the whole 64-byte lines of `dst` are written by non-temporal stores
/// and the elements before the first and after the last go as in the plain loop: the same bits
/// wherever `dst` starts. Only whole lines: a line half streamed and half stored would be flushed
/// from the write-combining buffer partially and then read for the plain half.
#[inline(always)]
pub(super) fn write_tile<S: Simd, T: Element, V: TileValues<S>>(s: S, values: &V, dst: &mut [T], stream: bool) {
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
pub(super) fn combine_tile<S: Simd, T: Element>(s: S, g: &RowGradient, u: &mut [f32], kept: &[f32], k: f32) {
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
/// stores where the instruction set has them for `T` (as [`super::sweep`]'s).
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

/// Writes `kept * kb + d` ([`Rescaled`]) over a tile kept in [`Simd::load_pair_t`]'s layout:
/// each pair rescaled and stored in order by [`Simd::store_pair_t`] (where [`Simd::splits`] `T`:
/// the even and odd positions rounded and interleaved at once), or with `stream` by
/// [`Simd::stream_rescaled_pairs`]; the values after the pairs as [`plain_stores`].
#[inline(always)]
pub(super) fn write_rescaled_pairs<S: Simd, T: Element>(
    s: S,
    kept: &[f32],
    kb: f32,
    d: f32,
    dst: &mut [T],
    stream: bool,
) {
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

//! Sixteen f32 lanes, three ways: portable arrays that LLVM autovectorises for whatever the
//! calling function is compiled for (the baseline kernels; with FMA, the reference the AVX2 ones
//! are tested against bit for bit), AVX2 intrinsics on two 8-lane registers (the portable
//! arithmetic written out, and an `exp2` of their own with AVX-512's polynomial), and AVX-512
//! intrinsics (whose `exp` and `exp2` use `vscalefps` and so need no exponent bit tricks, range
//! clamp on the high side, or underflow fix-up). The row kernels are
//! written once over [`Simd`]; a token value of the implementation selects it, at no cost.

use super::math;
use crate::element::Element;

pub(crate) const LANES: usize = 16;

/// Vector operations on 16 f32 lanes. Every method is `#[inline(always)]` so that it is compiled
/// with the features of the `#[target_feature]` function it ends up in.
pub(crate) trait Simd: Copy {
    type V: Copy;
    fn splat(self, x: f32) -> Self::V;
    /// Loads exactly 16 values.
    fn load(self, src: &[f32]) -> Self::V;
    /// Stores exactly 16 values.
    fn store(self, v: Self::V, dst: &mut [f32]);
    fn add(self, a: Self::V, b: Self::V) -> Self::V;
    fn sub(self, a: Self::V, b: Self::V) -> Self::V;
    fn mul(self, a: Self::V, b: Self::V) -> Self::V;
    /// `a * b + c` (fused where the implementation has FMA).
    fn mul_add(self, a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// Lane-wise maximum; a NaN in `b` propagates. Of two zeros the intrinsics return `b`, the
    /// portable arrays `a` (the sign of a zero maximum never reaches a result: it is subtracted
    /// and exponentiated).
    fn max(self, a: Self::V, b: Self::V) -> Self::V;
    fn exp(self, x: Self::V) -> Self::V;
    /// Whether [`Simd::exp2`] is this level's own, cheaper than `exp` and exact in its range
    /// reduction but for the last bit of some `t` in (-0.5, 0) (AVX-512 and AVX2): only then
    /// does the statistics pass work in base 2.
    const NATIVE_EXP2: bool = false;
    /// `2^t`: 0 for `-inf` and below the subnormals (the default: below about -125.5, where
    /// `exp` clamps), `NaN` for `NaN`. By default `exp(t ln 2)` (the product's rounding adds
    /// ~`|t| 2^-24` to the relative error); AVX-512 and AVX2 have a cheaper one of their own
    /// ([`Simd::NATIVE_EXP2`]; AVX2's 0 below 2^-126).
    #[inline(always)]
    fn exp2(self, t: Self::V) -> Self::V {
        self.exp(self.mul(t, self.splat(std::f32::consts::LN_2)))
    }
    #[inline(always)]
    fn to_array(self, v: Self::V) -> [f32; LANES] {
        let mut out = [0.0; LANES];
        self.store(v, &mut out);
        out
    }
    /// Loads exactly 16 logits of any dtype, widened to f32.
    fn load_t<T: Element>(self, src: &[T]) -> Self::V;
    /// Stores exactly 16 values rounded to `T` (to nearest even; with AVX512-BF16's conversion, bf16
    /// values below 2^-126 in magnitude become zero, as in [`Avx512`]).
    fn store_t<T: Element>(self, v: Self::V, dst: &mut [T]);
    /// Whether [`Simd::load_pair_t`] splits 32 logits of `T` into their even and odd positions:
    /// AVX-512 with bf16, where one shift and one `and` of a 64-byte load widen 32 logits and
    /// `vpmovzxwd` plus a shift per 16 competed with the statistics loop's FMAs (the loop 12-13%
    /// faster on AMD Zen 4: docs/BENCHMARKS.md, "Even and odd positions"); AVX2 with bf16, where
    /// the gain is the rounding back in order without a pack and a lane permute. Elsewhere a pair
    /// is two vectors in order, and every `*_pair` method below is the two 16-value ones.
    #[inline(always)]
    fn splits<T: Element>(self) -> bool {
        false
    }
    /// Loads exactly 32 logits widened, as two vectors: positions 0..16 and 16..32, or, where
    /// [`Simd::splits`], the even positions and the odd ones.
    #[inline(always)]
    fn load_pair_t<T: Element>(self, src: &[T]) -> (Self::V, Self::V) {
        (self.load_t(&src[..LANES]), self.load_t(&src[LANES..2 * LANES]))
    }
    /// Where element `q` (< 32) of a pair lies in [`Simd::load_pair_t`]'s two vectors, read as
    /// one 32-value array: in order, or, where [`Simd::splits`], the even positions in the first
    /// vector and the odd ones in the second, in order (the layout is the same on every ISA).
    #[inline(always)]
    fn pair_lane<T: Element>(self, q: usize) -> usize {
        if self.splits::<T>() {
            q % 2 * LANES + q / 2
        } else {
            q
        }
    }
    /// Two vectors laid out as [`Simd::load_pair_t`] lays them out, put in order.
    #[inline(always)]
    fn pair_in_order<T: Element>(self, a: Self::V, b: Self::V) -> (Self::V, Self::V) {
        (a, b)
    }
    /// Stores exactly 32 values, given as [`Simd::load_pair_t`] lays them out, rounded to `T` in
    /// order (the same bits as [`Simd::store_t`] of the ordered vectors).
    #[inline(always)]
    fn store_pair_t<T: Element>(self, a: Self::V, b: Self::V, dst: &mut [T]) {
        let (a, b) = self.pair_in_order::<T>(a, b);
        self.store_t(a, &mut dst[..LANES]);
        self.store_t(b, &mut dst[LANES..2 * LANES]);
    }
    /// `kept * kb + d` over whole pairs of values kept in [`Simd::load_pair_t`]'s layout
    /// (`kept` and `dst` whole pairs long), rounded to `T` and written in order. Where
    /// [`Simd::splits`] `T`, by non-temporal stores of whole 64-byte lines: on AVX-512 wherever
    /// `dst` starts (each line from two pairs where `dst` does not start on one), on AVX2 where
    /// `dst` starts on 32 bytes (plain stores elsewhere); the partial lines at its two ends by
    /// plain stores, as [`Simd::stream_t`]'s callers write them. By default by plain stores (the
    /// sweep streams the other outputs through [`Simd::stream_t`]). The caller owes the
    /// [`Simd::stream_fence`].
    #[inline(always)]
    fn stream_rescaled_pairs<T: Element>(self, kept: &[f32], kb: f32, d: f32, dst: &mut [T]) {
        plain_rescaled_pairs(self, kept, kb, d, dst)
    }
    /// Whether the sweeps write a large new buffer of `T` through [`Simd::stream_t`], bypassing
    /// the caches (AVX-512 and AVX2: 16-bit outputs, and f32 on AMD CPUs).
    #[inline(always)]
    fn streams<T: Element>(self) -> bool {
        false
    }
    /// [`Simd::store_t`] as a non-temporal store (the same bits), for callers that
    /// [`Simd::streams`] `T`: a buffer too large to stay in cache whose lines are not read first
    /// (a new gradient buffer, or a row's zeros in place), which a plain store would first read
    /// (read-for-ownership). Where `dst` does not start on a boundary of the store's width (32
    /// bytes for 16-bit outputs, 64 for f32) it falls back to a plain store; the caller ends the
    /// row's streaming stores with [`Simd::stream_fence`] before anything else writes or reads
    /// them.
    #[inline(always)]
    fn stream_t<T: Element>(self, v: Self::V, dst: &mut [T]) {
        self.store_t(v, dst)
    }
    /// One value rounded to `T` as [`Simd::store_t`] rounds it in a vector, for the scalar heads
    /// and tails of a row (by default `Element::from_f32`, which the vectors match).
    #[inline(always)]
    fn round_t<T: Element>(self, x: f32) -> T {
        T::from_f32(x)
    }
    /// Orders the streaming stores before every later store (`sfence`).
    #[inline(always)]
    fn stream_fence(self) {}
    /// `a * b + c` on one scalar, as the scalar tails compute it (fused: the intrinsic types
    /// all have FMA; the portable one says).
    #[inline(always)]
    fn scalar_mul_add(self, a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
    #[inline(always)]
    fn scalar_exp(self, x: f32) -> f32 {
        math::exp::<true>(x)
    }
    /// `2^t` on one scalar, as the scalar tails compute it.
    #[inline(always)]
    fn scalar_exp2(self, t: f32) -> f32 {
        self.scalar_exp(t * std::f32::consts::LN_2)
    }
    /// Asks for the cache line holding `p` to be brought into L1 (a hint: never faults, so `p`
    /// may point past the end of a row). The same SSE instruction for every x86-64 level.
    #[inline(always)]
    fn prefetch<T>(self, p: *const T) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: SSE is part of x86-64, and a prefetch never faults, whatever the address.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast())
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }
}

/// [`Simd::stream_rescaled_pairs`] by plain stores ([`Simd::store_pair_t`]): its default,
/// AVX-512's for the dtypes it does not split, and AVX2's also for bf16 rows that do not start on
/// 32 bytes.
#[inline(always)]
fn plain_rescaled_pairs<S: Simd, T: Element>(s: S, kept: &[f32], kb: f32, d: f32, dst: &mut [T]) {
    let (kb, d) = (s.splat(kb), s.splat(d));
    for (k, out) in kept.chunks_exact(2 * LANES).zip(dst.chunks_exact_mut(2 * LANES)) {
        let a = s.mul_add(s.load(&k[..LANES]), kb, d);
        let b = s.mul_add(s.load(&k[LANES..]), kb, d);
        s.store_pair_t(a, b, out);
    }
}

/// Plain arrays; `FMA` only where the target has it (elsewhere `mul_add` is a libm call).
#[derive(Clone, Copy)]
pub(crate) struct Portable<const FMA: bool>;

/// `[expr for k in 0..LANES]` as a plain loop. Not `std::array::from_fn`: its closure is compiled
/// without the calling kernel's target features and was not inlined, so with `FMA` every lane
/// became a call to the software `fmaf` (the AVX2 kernels ran 11x slower than the baseline ones).
macro_rules! lanewise {
    (|$k:ident| $e:expr) => {{
        let mut out = [0.0f32; LANES];
        for $k in 0..LANES {
            out[$k] = $e;
        }
        out
    }};
}

impl<const FMA: bool> Simd for Portable<FMA> {
    type V = [f32; LANES];

    #[inline(always)]
    fn splat(self, x: f32) -> Self::V {
        [x; LANES]
    }
    #[inline(always)]
    fn load(self, src: &[f32]) -> Self::V {
        let mut v = [0.0; LANES];
        v.copy_from_slice(&src[..LANES]);
        v
    }
    #[inline(always)]
    fn store(self, v: Self::V, dst: &mut [f32]) {
        dst[..LANES].copy_from_slice(&v);
    }
    #[inline(always)]
    fn add(self, a: Self::V, b: Self::V) -> Self::V {
        lanewise!(|k| a[k] + b[k])
    }
    #[inline(always)]
    fn sub(self, a: Self::V, b: Self::V) -> Self::V {
        lanewise!(|k| a[k] - b[k])
    }
    #[inline(always)]
    fn mul(self, a: Self::V, b: Self::V) -> Self::V {
        lanewise!(|k| a[k] * b[k])
    }
    #[inline(always)]
    fn mul_add(self, a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        lanewise!(|k| math::madd::<FMA>(a[k], b[k], c[k]))
    }
    #[inline(always)]
    fn max(self, a: Self::V, b: Self::V) -> Self::V {
        lanewise!(|k| if a[k] >= b[k] { a[k] } else { b[k] })
    }
    #[inline(always)]
    fn exp(self, x: Self::V) -> Self::V {
        lanewise!(|k| math::exp::<FMA>(x[k]))
    }
    #[inline(always)]
    fn to_array(self, v: Self::V) -> [f32; LANES] {
        v
    }
    #[inline(always)]
    fn load_t<T: Element>(self, src: &[T]) -> Self::V {
        let src = &src[..LANES];
        lanewise!(|k| src[k].to_f32())
    }
    #[inline(always)]
    fn store_t<T: Element>(self, v: Self::V, dst: &mut [T]) {
        for (d, &x) in dst[..LANES].iter_mut().zip(&v) {
            *d = T::from_f32(x);
        }
    }
    #[inline(always)]
    fn scalar_mul_add(self, a: f32, b: f32, c: f32) -> f32 {
        math::madd::<FMA>(a, b, c)
    }
    #[inline(always)]
    fn scalar_exp(self, x: f32) -> f32 {
        math::exp::<FMA>(x)
    }
}

/// AVX-512F intrinsics. Only constructed by kernels compiled with AVX-512 enabled, after
/// run-time detection (`isa.rs`); with `BF16`, also AVX512-BF16 (`vcvtneps2bf16` rounds 16 f32
/// to bf16 in one instruction; unlike the integer rounding, it flushes denormals to zero). The
/// private field leaves [`Avx512::new`], which is `unsafe`, the only way to make one: every
/// method runs those instructions.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct Avx512<const BF16: bool>(());

#[cfg(target_arch = "x86_64")]
impl<const BF16: bool> Avx512<BF16> {
    /// # Safety
    /// The CPU must support AVX-512F, BW, DQ and VL (and AVX512-BF16 with `BF16`), and the
    /// token's methods must be called from code compiled with those features.
    pub(crate) const unsafe fn new() -> Self {
        Self(())
    }
}

/// AVX2 + FMA + F16C intrinsics, 16 lanes as two 8-lane registers. Only constructed by kernels
/// compiled with those features, after run-time detection. The same arithmetic as
/// [`Portable<true>`] (its `exp` included, Cephes' clamp and bit tricks; `exp2` is AVX2's own,
/// AVX-512's written for 8 lanes), written out: LLVM
/// split the portable 16-lane arrays into 128-bit halves and spilled them, and the AVX2 kernels
/// ran ~3.3x slower per logit than AVX-512's (issue 17).
/// As for [`Avx512`], [`Avx2::new`] is the only way to make one.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct Avx2(());

#[cfg(target_arch = "x86_64")]
impl Avx2 {
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C, and the token's methods must be called from code
    /// compiled with those features.
    pub(crate) const unsafe fn new() -> Self {
        Self(())
    }
}

/// Whether the intrinsic instruction sets (AVX-512, AVX2) stream a large new buffer of `T`
/// ([`Simd::streams`]): 16-bit dtypes on every CPU (on AMD Zen 4 streaming took 19-25% off the bf16
/// `fused` step, on an Intel server CPU it measured the same as plain stores), f32 on AMD CPUs
/// only ([`super::isa::streams_f32`]: 12-21% off the f32 `fused` step on Zen 4, 6% slower on the
/// Intel CPU). AVX2 timed on Zen 4 with `FLASHGRPO_ISA=avx2` (docs/BENCHMARKS.md).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn streamed_dtype<T: Element>() -> bool {
    T::DTYPE != crate::element::DType::F32 || super::isa::streams_f32()
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(test)]
mod tests;

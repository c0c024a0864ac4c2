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

#[cfg(test)]
mod tests {
    use super::*;

    /// Worst relative error of `S::exp` against f64 over [-100, 10].
    fn worst<S: Simd>(s: S) -> f64 {
        let mut worst = 0.0f64;
        let mut x = -100.0f32;
        while x < 10.0 {
            let lanes: [f32; LANES] = std::array::from_fn(|k| x + k as f32 * 0.000_37);
            let got = s.to_array(s.exp(s.load(&lanes)));
            for (g, &l) in got.iter().zip(&lanes) {
                let want = (l as f64).exp();
                if want > 1e-37 {
                    worst = worst.max((*g as f64 - want).abs() / want);
                }
            }
            x += 0.0071;
        }
        worst
    }

    /// `store_t(load_t(x))` is the identity, and `store_t` rounds as `Element::from_f32`; the
    /// same of the 32-value pairs (`load_pair_t` puts element `q` at `pair_lane(q)`,
    /// `pair_in_order` undoes it, `store_pair_t` stores in order, and `stream_rescaled_pairs`
    /// over whole pairs at every offset of a line, nothing written outside); `stream_t` stores
    /// what `store_t` does at every offset of a line, streamed or not, whatever `streams` says.
    fn conversions<S: Simd, T: Element>(s: S) {
        let values: Vec<f32> = (0..4096).map(|i| ((i as f32 * 0.731).sin() * 1e3) / (1 + i % 7) as f32).collect();
        for chunk in values.chunks_exact(LANES) {
            let t: Vec<T> = chunk.iter().map(|&x| T::from_f32(x)).collect();
            let mut out = vec![T::default(); LANES];
            s.store_t(s.load_t(&t), &mut out);
            assert_eq!(out, t);
            s.store_t(s.load(chunk), &mut out);
            assert_eq!(out, t);
        }
        let bits = |v: S::V| s.to_array(v).map(f32::to_bits);
        for chunk in values.chunks_exact(2 * LANES) {
            let t: Vec<T> = chunk.iter().map(|&x| T::from_f32(x)).collect();
            let (a, b) = s.load_pair_t(&t);
            let laid: Vec<f32> = s.to_array(a).into_iter().chain(s.to_array(b)).collect();
            for (q, x) in t.iter().enumerate() {
                assert_eq!(laid[s.pair_lane::<T>(q)].to_bits(), x.to_f32().to_bits(), "pair lane of {q}");
            }
            let (first, second) = s.pair_in_order::<T>(a, b);
            assert_eq!((bits(first), bits(second)), (bits(s.load_t(&t[..LANES])), bits(s.load_t(&t[LANES..]))));
            // f32 values in the pair layout are rounded as `from_f32` and stored in order.
            let mut f32_laid = [0.0f32; 2 * LANES];
            for (q, &x) in chunk.iter().enumerate() {
                f32_laid[s.pair_lane::<T>(q)] = x;
            }
            let (fa, fb) = (s.load(&f32_laid[..LANES]), s.load(&f32_laid[LANES..]));
            let mut out = [T::default(); 2 * LANES];
            s.store_pair_t(a, b, &mut out);
            assert_eq!(&out[..], &t[..]);
            s.store_pair_t(fa, fb, &mut out);
            assert_eq!(&out[..], &t[..]);
        }
        // `stream_rescaled_pairs` over 1 to 5 pairs kept in the pair layout, at every offset of a
        // 64-byte line (one of them starts on it): `kept * kb + d` rounded in order, nothing
        // written outside.
        for pairs in 1..=5 {
            let n = pairs * 2 * LANES;
            let (kb, d) = (0.75f32, 0.125f32);
            let want: Vec<T> = values[..n].iter().map(|&x| T::from_f32(x.mul_add(kb, d))).collect();
            let mut kept = vec![0.0f32; n];
            for (q, &x) in values[..n].iter().enumerate() {
                kept[q / (2 * LANES) * (2 * LANES) + s.pair_lane::<T>(q % (2 * LANES))] = x;
            }
            let sentinel = T::from_f32(-7.0);
            for offset in 0..64 / std::mem::size_of::<T>() {
                let mut buffer = vec![sentinel; n + 64];
                s.stream_rescaled_pairs(&kept, kb, d, &mut buffer[offset..offset + n]);
                s.stream_fence();
                assert_eq!(&buffer[offset..offset + n], &want[..], "{pairs} pairs at offset {offset}");
                let outside = buffer[..offset].iter().chain(&buffer[offset + n..]);
                assert!(outside.into_iter().all(|&x| x == sentinel), "a store outside, offset {offset}");
            }
        }
        let v = s.load(&values[..LANES]);
        let want: Vec<T> = values[..LANES].iter().map(|&x| T::from_f32(x)).collect();
        let sentinel = T::from_f32(-7.0);
        for offset in 0..64 / std::mem::size_of::<T>() {
            let mut buffer = [sentinel; LANES + 64];
            s.stream_t(v, &mut buffer[offset..offset + LANES]);
            s.stream_fence();
            assert_eq!(&buffer[offset..offset + LANES], &want[..], "stream_t at offset {offset}");
            let outside = buffer[..offset].iter().chain(&buffer[offset + LANES..]);
            assert!(outside.into_iter().all(|&x| x == sentinel), "stream_t: a store outside, offset {offset}");
        }
    }

    #[test]
    fn dtype_conversions_on_every_instruction_set() {
        conversions::<_, f32>(Portable::<false>);
        conversions::<_, half::bf16>(Portable::<false>);
        conversions::<_, half::f16>(Portable::<false>);
        #[cfg(target_arch = "x86_64")]
        if super::super::isa::Isa::detected() >= super::super::isa::Isa::Avx2 {
            #[target_feature(enable = "avx2,fma,f16c")]
            fn avx2() {
                conversions::<_, f32>(unsafe { Avx2::new() });
                conversions::<_, half::bf16>(unsafe { Avx2::new() });
                conversions::<_, half::f16>(unsafe { Avx2::new() });
            }
            // SAFETY: AVX2, FMA and F16C were detected.
            unsafe { avx2() };
        }
        #[cfg(target_arch = "x86_64")]
        if super::super::isa::Isa::detected() >= super::super::isa::Isa::Avx512 {
            #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
            fn all() {
                conversions::<_, f32>(unsafe { Avx512::<false>::new() });
                conversions::<_, half::bf16>(unsafe { Avx512::<false>::new() });
                conversions::<_, half::f16>(unsafe { Avx512::<false>::new() });
            }
            // SAFETY: AVX-512 was detected.
            unsafe { all() };
            if super::super::isa::Isa::detected() >= super::super::isa::Isa::Avx512Bf16 {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
                fn bf16() {
                    conversions::<_, half::bf16>(unsafe { Avx512::<true>::new() });
                }
                // SAFETY: AVX512-BF16 was detected.
                unsafe { bf16() };
            }
        }
    }

    /// AVX2's bf16 pairs (even and odd positions apart, rounded back in order by
    /// `interleaved_bf16`) round special values as `Element::from_f32` does, bit for bit: NaNs
    /// quieted with their sign and payload's high bits, infinities, signed zeros, subnormals,
    /// ties to even, the largest finite values rounding to infinity; by `store_pair_t` and by
    /// `stream_rescaled_pairs` (aligned: streamed; one element off: plain stores).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_bf16_pairs_round_special_values_as_element() {
        if super::super::isa::Isa::detected() < super::super::isa::Isa::Avx2 {
            return;
        }
        let special = [
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7F80_0001), // signalling, low payload
            f32::from_bits(0xFF81_2345), // signalling, negative, payload in the high bits
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            f32::from_bits(1),           // the smallest subnormal
            f32::from_bits(0x0000_8000), // a subnormal at a tie
            f32::from_bits(0x3F80_8000), // 1 + 2^-8: a tie, to even (1)
            f32::from_bits(0x3F81_8000), // a tie, to even (up)
            f32::from_bits(0x3F80_8001), // just above a tie
            f32::MAX,                    // rounds to infinity
            f32::MIN,
            f32::MIN_POSITIVE,
        ];
        let values: Vec<f32> = (0..2 * LANES).map(|q| special.get(q).copied().unwrap_or(q as f32 * -0.37)).collect();
        let want: Vec<u16> = values.iter().map(|&x| <half::bf16 as Element>::from_f32(x).to_bits()).collect();
        #[target_feature(enable = "avx2,fma,f16c")]
        fn check(values: &[f32], want: &[u16]) {
            let s = unsafe { Avx2::new() };
            let mut laid = [0.0f32; 2 * LANES];
            for (q, &x) in values.iter().enumerate() {
                laid[s.pair_lane::<half::bf16>(q)] = x;
            }
            let (a, b) = (s.load(&laid[..LANES]), s.load(&laid[LANES..]));
            let mut out = [half::bf16::ZERO; 2 * LANES];
            s.store_pair_t(a, b, &mut out);
            assert_eq!(out.map(half::bf16::to_bits), want, "store_pair_t");
            let (kb, d) = (1.0f32, 0.0f32);
            let rescaled: Vec<u16> =
                values.iter().map(|&x| <half::bf16 as Element>::from_f32(x.mul_add(kb, d)).to_bits()).collect();
            for offset in [0, 1] {
                // A 32-byte aligned start (offset 0) and one element past it.
                let mut buffer = [half::bf16::ZERO; 4 * LANES];
                let start = buffer.as_ptr().align_offset(32) + offset;
                s.stream_rescaled_pairs(&laid, kb, d, &mut buffer[start..start + 2 * LANES]);
                s.stream_fence();
                let got: Vec<u16> = buffer[start..start + 2 * LANES].iter().map(|x| x.to_bits()).collect();
                assert_eq!(got, rescaled, "stream_rescaled_pairs at offset {offset}");
            }
        }
        // SAFETY: AVX2, FMA and F16C were detected.
        unsafe { check(&values, &want) };
    }

    /// The AVX2 intrinsics compute what the portable arrays with FMA compute, bit for bit, on
    /// special values too (`f32::mul_add` is exact wherever it runs, so the portable side is a
    /// reference without target features). Zeros of a maximum may differ in sign (see `max`).
    #[test]
    fn avx2_matches_portable_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        if super::super::isa::Isa::detected() >= super::super::isa::Isa::Avx2 {
            let specials = [
                f32::NAN,
                -f32::NAN,
                f32::from_bits(0x7fc1_2345),
                f32::from_bits(0xff80_0001),
                f32::INFINITY,
                f32::NEG_INFINITY,
                0.0,
                -0.0,
                -87.0001,
                -87.0,
                88.0,
                88.5,
                1e30,
                -1e30,
                6.0e-8,
                -3.0e-5,
                65520.0,
                65519.0,
                1.0 + 1.0 / 256.0,
                1.0 + 3.0 / 512.0,
                f32::MIN_POSITIVE,
                1.0e-40,
            ];
            let mut values: Vec<f32> = specials.to_vec();
            values.extend((0..4096).map(|i| ((i as f32 * 0.37).sin() * 120.0) - 20.0));
            values.resize(values.len().next_multiple_of(LANES), 1.0);
            #[target_feature(enable = "avx2,fma,f16c")]
            fn check(values: &[f32]) {
                let (p, a) = (Portable::<true>, unsafe { Avx2::new() });
                let bits = |v: [f32; LANES]| v.map(f32::to_bits);
                for (x, y) in values.chunks_exact(LANES).zip(values.chunks_exact(LANES).skip(1)) {
                    assert_eq!(bits(p.to_array(p.exp(p.load(x)))), bits(a.to_array(a.exp(a.load(x)))), "exp of {x:?}");
                    let (pm, am) = (p.to_array(p.max(p.load(x), p.load(y))), a.to_array(a.max(a.load(x), a.load(y))));
                    for (m, n) in pm.iter().zip(&am) {
                        assert!(m.to_bits() == n.to_bits() || (*m == 0.0 && *n == 0.0), "max {m} vs {n}");
                    }
                    assert_eq!(
                        bits(p.to_array(p.mul_add(p.load(x), p.load(y), p.load(x)))),
                        bits(a.to_array(a.mul_add(a.load(x), a.load(y), a.load(x))))
                    );
                    same_round_trip::<half::bf16>(x);
                    same_round_trip::<half::f16>(x);
                }
            }
            /// `x` stored as `T` by both and loaded back by both: the same bits each way (compared
            /// widened: exact, NaN payloads kept).
            #[inline(always)]
            fn same_round_trip<T: Element>(x: &[f32]) {
                let (p, a) = (Portable::<true>, unsafe { Avx2::new() });
                let (mut pt, mut at) = (vec![T::default(); LANES], vec![T::default(); LANES]);
                p.store_t(p.load(x), &mut pt);
                a.store_t(a.load(x), &mut at);
                let widened = |t: &[T]| t.iter().map(|v| v.to_f32().to_bits()).collect::<Vec<_>>();
                assert_eq!(widened(&pt), widened(&at), "{:?} of {x:?}", T::DTYPE);
                let (pl, al) = (p.to_array(p.load_t(&pt)), a.to_array(a.load_t(&at)));
                assert_eq!(pl.map(f32::to_bits), al.map(f32::to_bits));
            }
            // SAFETY: AVX2, FMA and F16C were detected.
            unsafe { check(&values) };
        }
    }

    #[test]
    fn vector_exp_is_accurate_on_every_instruction_set() {
        assert!(worst(Portable::<false>) < 3e-7);
        #[cfg(target_arch = "x86_64")]
        if super::super::isa::Isa::detected() >= super::super::isa::Isa::Avx2 {
            #[target_feature(enable = "avx2,fma,f16c")]
            fn avx2_worst() -> f64 {
                worst(unsafe { Avx2::new() })
            }
            // SAFETY: AVX2, FMA and F16C were detected.
            let w = unsafe { avx2_worst() };
            assert!(w < 3e-7, "AVX2 exp worst relative error {w}");
        }
        #[cfg(target_arch = "x86_64")]
        if super::super::isa::Isa::detected() >= super::super::isa::Isa::Avx512 {
            #[target_feature(enable = "avx512f")]
            fn avx512_worst() -> f64 {
                worst(unsafe { Avx512::<false>::new() })
            }
            // SAFETY: AVX-512F was detected.
            let w = unsafe { avx512_worst() };
            assert!(w < 4e-7, "AVX-512 exp worst relative error {w}");
        }
    }

    /// Worst relative error of `S::exp2` against f64 over [-125, 14], in excess of `slope * |t|`
    /// (what rounding `t ln 2` costs the default), and its special values.
    fn exp2_worst<S: Simd>(s: S, slope: f64) -> f64 {
        let mut worst = 0.0f64;
        let mut t = -125.0f32;
        while t < 14.0 {
            let lanes: [f32; LANES] = std::array::from_fn(|k| t + k as f32 * 0.000_53);
            let got = s.to_array(s.exp2(s.load(&lanes)));
            for (g, &l) in got.iter().zip(&lanes) {
                let want = (l as f64).exp2();
                worst = worst.max((*g as f64 - want).abs() / want - slope * (l as f64).abs());
            }
            t += 0.0093;
        }
        let special =
            [f32::NEG_INFINITY, -1e30, -200.0, 0.0, 3.0, -7.0, f32::NAN, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5];
        let got = s.to_array(s.exp2(s.load(&special)));
        assert_eq!(&got[..3], &[0.0, 0.0, 0.0]);
        assert!((got[3] - 1.0).abs() <= f32::EPSILON && (got[4] - 8.0).abs() <= 8.0 * f32::EPSILON);
        assert!((got[5] - 1.0 / 128.0).abs() <= f32::EPSILON / 128.0);
        assert!(got[6].is_nan());
        worst
    }

    /// `S::exp2` of every integer power of two in [-140, 130], against f64: exact (the
    /// polynomial's constant term is 1), but below 2^-126 where the level `flushes` to 0, and
    /// inf from 2^128 on.
    fn exp2_powers<S: Simd>(s: S, flushes: bool) {
        for first in (-140..=130).step_by(LANES) {
            let t: [f32; LANES] = std::array::from_fn(|k| (first + k as i32) as f32);
            let got = s.to_array(s.exp2(s.load(&t)));
            for (g, &t) in got.iter().zip(&t) {
                let want = if flushes && t < -126.0 { 0.0 } else { (t as f64).exp2() };
                assert_eq!(*g as f64, if want >= 2f64.powi(128) { f64::INFINITY } else { want }, "2^{t}");
            }
        }
    }

    #[test]
    fn vector_exp2_is_accurate_on_every_instruction_set() {
        // The default, `exp(t ln 2)`: the product's rounding (half an ulp of |t ln 2|) adds up
        // to 2^-24 ln 2 |t| relative.
        let slope = std::f64::consts::LN_2 * 2f64.powi(-24);
        let w = exp2_worst(Portable::<false>, slope);
        assert!(w < 3e-7, "portable exp2 worst relative error beyond the slope {w}");
        #[cfg(target_arch = "x86_64")]
        if super::super::isa::Isa::detected() >= super::super::isa::Isa::Avx2 {
            #[target_feature(enable = "avx2,fma,f16c")]
            fn avx2() -> f64 {
                let s = unsafe { Avx2::new() };
                exp2_powers(s, true);
                exp2_worst(s, 0.0)
            }
            // SAFETY: AVX2, FMA and F16C were detected.
            let w = unsafe { avx2() };
            assert!(w < 1.6e-7, "AVX2 exp2 worst relative error {w}");
        }
        #[cfg(target_arch = "x86_64")]
        if super::super::isa::Isa::detected() >= super::super::isa::Isa::Avx512 {
            #[target_feature(enable = "avx512f,avx512dq")]
            fn avx512() -> f64 {
                let s = unsafe { Avx512::<false>::new() };
                exp2_powers(s, false);
                exp2_worst(s, 0.0)
            }
            // SAFETY: AVX-512F and DQ were detected.
            let w = unsafe { avx512() };
            assert!(w < 1.6e-7, "AVX-512 exp2 worst relative error {w}");
        }
    }

    /// AVX2's `exp2` gives AVX-512's bits wherever the result is a normal number (the same
    /// fraction, polynomial and power of two), so the base-2 statistics agree across the two;
    /// for `t` in (-0.5, 0) within one ulp (`vreduceps` rounds `t + 1` down, AVX2 to nearest).
    #[test]
    fn avx2_exp2_matches_avx512_where_normal() {
        #[cfg(target_arch = "x86_64")]
        if super::super::isa::Isa::detected() >= super::super::isa::Isa::Avx512 {
            #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq")]
            fn check() {
                let (a, b) = (unsafe { Avx2::new() }, unsafe { Avx512::<false>::new() });
                let mut t = -126.0f32;
                while t < 127.0 {
                    let lanes: [f32; LANES] = std::array::from_fn(|k| t + k as f32 * 0.000_37);
                    let (x, y) = (a.to_array(a.exp2(a.load(&lanes))), b.to_array(b.exp2(b.load(&lanes))));
                    for ((x, y), t) in x.iter().zip(&y).zip(&lanes) {
                        let ulps = x.to_bits().abs_diff(y.to_bits());
                        let allowed = if (-0.5..0.0).contains(t) { 1 } else { 0 };
                        assert!(ulps <= allowed, "exp2({t}): AVX2 {x} against AVX-512 {y}");
                    }
                    t += 0.0071;
                }
            }
            // SAFETY: AVX2, FMA, F16C (every AVX-512 CPU has them), AVX-512F and DQ were detected.
            unsafe { check() };
        }
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
mod avx512 {
    use std::arch::x86_64::*;

    use super::super::math::{EXP2_POLY_DEG5, EXP_POLY_DEG5, ROUND_MAGIC};
    use super::{plain_rescaled_pairs, streamed_dtype, Avx512, Simd, LANES};
    use crate::element::{DType, Element};

    /// Where element `k` of 32 in order lies in a pair's two vectors (even positions, then odd):
    /// `vpermw`'s and `vpermt2ps`'s index (16 + i names the second vector's lane i).
    const fn pair_order<const N: usize>(first: usize) -> [u16; N] {
        let mut order = [0; N];
        let mut k = 0;
        while k < N {
            order[k] = ((first + k) % 2 * LANES + (first + k) / 2) as u16;
            k += 1;
        }
        order
    }
    const WORDS_IN_ORDER: [u16; 2 * LANES] = pair_order(0);
    /// 0, 1, ..., 31: `vpermt2w`'s index of 32 consecutive words, before the offset is added.
    const WORDS_FROM: [u16; 2 * LANES] = {
        let mut words = [0; 2 * LANES];
        let mut i = 0;
        while i < 2 * LANES {
            words[i] = i as u16;
            i += 1;
        }
        words
    };
    const LOW_IN_ORDER: [u16; LANES] = pair_order(0);
    const HIGH_IN_ORDER: [u16; LANES] = pair_order(LANES);

    // SAFETY (every method): `Avx512` values exist only inside functions compiled with
    // AVX-512F enabled and called after detection, so the intrinsics are supported; loads and
    // stores index slices of at least 16 elements (checked by the slice indexing).
    impl<const BF16: bool> Simd for Avx512<BF16> {
        type V = __m512;
        const NATIVE_EXP2: bool = true;

        #[inline(always)]
        fn splat(self, x: f32) -> __m512 {
            unsafe { _mm512_set1_ps(x) }
        }
        #[inline(always)]
        fn load(self, src: &[f32]) -> __m512 {
            let src = &src[..LANES];
            unsafe { _mm512_loadu_ps(src.as_ptr()) }
        }
        #[inline(always)]
        fn store(self, v: __m512, dst: &mut [f32]) {
            let dst = &mut dst[..LANES];
            unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), v) }
        }
        #[inline(always)]
        fn add(self, a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_add_ps(a, b) }
        }
        #[inline(always)]
        fn sub(self, a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_sub_ps(a, b) }
        }
        #[inline(always)]
        fn mul(self, a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_mul_ps(a, b) }
        }
        #[inline(always)]
        fn mul_add(self, a: __m512, b: __m512, c: __m512) -> __m512 {
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        fn max(self, a: __m512, b: __m512) -> __m512 {
            // vmaxps returns its second operand when either is NaN.
            unsafe { _mm512_max_ps(a, b) }
        }
        /// `exp(x) = 2^n * p(r)`, `n = round(x log2 e)`, `r = x - n ln 2`, `p` the
        /// degree-5 polynomial `math::EXP_POLY_DEG5`; `vscalefps` applies `2^n` with correct underflow to 0
        /// and overflow to inf. `x` is clamped below at -104 so that `r` stays small.
        #[inline(always)]
        fn exp(self, x: __m512) -> __m512 {
            unsafe {
                let x = _mm512_max_ps(_mm512_set1_ps(-104.0), x);
                // n = round(x log2 e): adding 1.5 * 2^23 in the FMA rounds the exact product to an
                // integer, subtracting it leaves that integer (two single-uop operations, where
                // `vrndscaleps` after a multiply is three). Exact while |x log2 e| < 2^22: the clamp
                // bounds it below; above, the callers' arguments stay under the tile HEADROOM (8)
                // except in a first pass over a tile that is then summed again.
                let magic = _mm512_set1_ps(ROUND_MAGIC);
                let n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E), magic), magic);
                // One fused step: n ln2 is exact inside the FMA; ln2's f32 rounding (1.9e-9)
                // costs at most 2.9e-7 relative at n = -150, where exp is ~1e-45 anyway.
                let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(std::f32::consts::LN_2), x);
                let mut p = _mm512_set1_ps(EXP_POLY_DEG5[0]);
                for &c in &EXP_POLY_DEG5[1..] {
                    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
                }
                _mm512_scalef_ps(p, n)
            }
        }
        /// `2^t` as `2^(t - floor t) * 2^floor t`: `vreduceps` leaves the fraction `f` in [0, 1)
        /// (exactly, but for `t` in (-0.5, 0), where `t + 1` is rounded down),
        /// `math::EXP2_POLY_DEG5` takes `2^f` (1.4e-7 relative), and `vscalefps` applies
        /// `2^floor t` with its own floor, underflow to 0 and overflow to inf. No clamp and no
        /// rounding trick: 7 operations where `exp` takes 10. For `t = -inf` the fraction is 0
        /// and the scale 0; for |t| >= 2^23 the fraction is 0 (t is an integer).
        #[inline(always)]
        fn exp2(self, t: __m512) -> __m512 {
            unsafe {
                let f = _mm512_reduce_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t);
                let mut p = _mm512_set1_ps(EXP2_POLY_DEG5[0]);
                for &c in &EXP2_POLY_DEG5[1..] {
                    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
                }
                _mm512_scalef_ps(p, t)
            }
        }
        #[inline(always)]
        fn load_t<T: Element>(self, src: &[T]) -> __m512 {
            let p = src[..LANES].as_ptr();
            // SAFETY: 16 elements of `T` are readable at `p`; the dtype tells their layout.
            unsafe {
                match T::DTYPE {
                    DType::F32 => _mm512_loadu_ps(p.cast()),
                    DType::BF16 => {
                        let h = _mm256_loadu_si256(p.cast());
                        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
                    }
                    DType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
                }
            }
        }
        #[inline(always)]
        fn splits<T: Element>(self) -> bool {
            T::DTYPE == DType::BF16
        }
        /// bf16: the 64 bytes as 16 lanes of two logits each, the even one in the low half (its
        /// bits shifted up into an f32) and the odd one in the high half (the low half cleared).
        #[inline(always)]
        fn load_pair_t<T: Element>(self, src: &[T]) -> (__m512, __m512) {
            if T::DTYPE != DType::BF16 {
                return (self.load_t(&src[..LANES]), self.load_t(&src[LANES..2 * LANES]));
            }
            let p = src[..2 * LANES].as_ptr();
            // SAFETY: 32 two-byte elements are readable at `p`.
            unsafe {
                let x = _mm512_loadu_si512(p.cast());
                let odd = _mm512_and_si512(x, _mm512_set1_epi32(0xFFFF_0000u32 as i32));
                (_mm512_castsi512_ps(_mm512_slli_epi32::<16>(x)), _mm512_castsi512_ps(odd))
            }
        }
        #[inline(always)]
        fn pair_in_order<T: Element>(self, a: __m512, b: __m512) -> (__m512, __m512) {
            if T::DTYPE != DType::BF16 {
                return (a, b);
            }
            // Element k of the first vector out is a[k / 2] (k even) or b[k / 2] (k odd).
            unsafe {
                let low = _mm512_cvtepu16_epi32(_mm256_loadu_si256(LOW_IN_ORDER.as_ptr().cast()));
                let high = _mm512_cvtepu16_epi32(_mm256_loadu_si256(HIGH_IN_ORDER.as_ptr().cast()));
                (_mm512_permutex2var_ps(a, low, b), _mm512_permutex2var_ps(a, high, b))
            }
        }
        #[inline(always)]
        fn store_pair_t<T: Element>(self, a: __m512, b: __m512, dst: &mut [T]) {
            if T::DTYPE != DType::BF16 {
                let (a, b) = self.pair_in_order::<T>(a, b);
                self.store_t(a, &mut dst[..LANES]);
                return self.store_t(b, &mut dst[LANES..2 * LANES]);
            }
            let p = dst[..2 * LANES].as_mut_ptr();
            // SAFETY: 32 two-byte elements are writable at `p`.
            unsafe { _mm512_storeu_si512(p.cast(), self.pair_bf16(a, b)) }
        }
        #[inline(always)]
        fn stream_rescaled_pairs<T: Element>(self, kept: &[f32], kb: f32, d: f32, dst: &mut [T]) {
            let pairs = dst.len() / (2 * LANES);
            if T::DTYPE != DType::BF16 || pairs == 0 {
                return plain_rescaled_pairs(self, kept, kb, d, dst);
            }
            let kept = &kept[..pairs * 2 * LANES];
            let (kbv, dv) = (self.splat(kb), self.splat(d));
            // SAFETY: `T` is bf16 here, two-byte elements with `u16`'s layout.
            let out = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u16>(), kept.len()) };
            // Elements before the first line boundary (`out` is 2-byte aligned).
            let head = (64 - out.as_ptr() as usize % 64) % 64 / 2;
            let mut chunks = kept.chunks_exact(2 * LANES);
            // SAFETY: the streamed stores write whole lines of `out`: at `head + 32 k` for
            // k < pairs (head 0) or k < pairs - 1 (head > 0), 64-byte aligned.
            unsafe {
                if head == 0 {
                    for (k, chunk) in chunks.enumerate() {
                        let line = self.rescaled_pair_bf16(chunk, kbv, dv);
                        _mm512_stream_si512(out.as_mut_ptr().add(k * 2 * LANES).cast(), line);
                    }
                    return;
                }
                // Line `k` holds elements head + 32 k .. head + 32 (k + 1): the end of pair k
                // (its lanes head..32) and the start of pair k + 1 (index 32 + i: its lane i).
                // The partial lines at the two ends are copied from the pair: by masked stores
                // (`vmovdqu16` with a mask) the `fused` bf16 step ran 1.6x slower on Zen 4.
                let order = _mm512_loadu_si512(WORDS_FROM.as_ptr().cast());
                let order = _mm512_add_epi16(order, _mm512_set1_epi16(head as i16));
                let mut ends = [0u16; 2 * LANES];
                let mut previous = self.rescaled_pair_bf16(chunks.next().expect("a whole pair"), kbv, dv);
                _mm512_storeu_si512(ends.as_mut_ptr().cast(), previous);
                out[..head].copy_from_slice(&ends[..head]);
                for (k, chunk) in chunks.enumerate() {
                    let current = self.rescaled_pair_bf16(chunk, kbv, dv);
                    let line = _mm512_permutex2var_epi16(previous, order, current);
                    _mm512_stream_si512(out.as_mut_ptr().add(head + k * 2 * LANES).cast(), line);
                    previous = current;
                }
                _mm512_storeu_si512(ends.as_mut_ptr().cast(), previous);
                out[(pairs - 1) * 2 * LANES + head..].copy_from_slice(&ends[head..]);
            }
        }
        #[inline(always)]
        fn store_t<T: Element>(self, v: __m512, dst: &mut [T]) {
            let p = dst[..LANES].as_mut_ptr();
            // SAFETY: 16 elements of `T` are writable at `p`; the dtype tells their layout.
            unsafe {
                match T::DTYPE {
                    DType::F32 => _mm512_storeu_ps(p.cast(), v),
                    DType::BF16 | DType::F16 => _mm256_storeu_si256(p.cast(), self.packed16::<T>(v)),
                }
            }
        }
        #[inline(always)]
        fn streams<T: Element>(self) -> bool {
            streamed_dtype::<T>()
        }
        #[inline(always)]
        fn stream_t<T: Element>(self, v: __m512, dst: &mut [T]) {
            let p = dst[..LANES].as_mut_ptr();
            let address = p as usize;
            // SAFETY: 16 elements of `T` are writable at `p`, aligned as each stream needs.
            unsafe {
                match T::DTYPE {
                    DType::F32 if address.is_multiple_of(64) => _mm512_stream_ps(p.cast(), v),
                    DType::BF16 | DType::F16 if address.is_multiple_of(32) => {
                        _mm256_stream_si256(p.cast(), self.packed16::<T>(v))
                    }
                    _ => self.store_t(v, dst),
                }
            }
        }
        /// AVX512-BF16's conversion treats an f32 subnormal as zero (and bf16 has no subnormal
        /// that a normal f32 rounds to): the scalar rounding does the same, so that an element's
        /// bits do not depend on whether a vector or the scalar tail wrote it.
        #[inline(always)]
        fn round_t<T: Element>(self, x: f32) -> T {
            if BF16 && T::DTYPE == DType::BF16 && x.is_subnormal() {
                T::from_f32(0.0f32.copysign(x))
            } else {
                T::from_f32(x)
            }
        }
        #[inline(always)]
        fn stream_fence(self) {
            unsafe { _mm_sfence() }
        }
    }

    impl<const BF16: bool> Avx512<BF16> {
        /// 16 values rounded to bf16 without AVX512-BF16: to nearest even on the bits, quiet NaNs
        /// kept (as `Element`), each in the low half of its 32-bit lane (the high half zero).
        #[inline(always)]
        fn bf16_lanes(self, v: __m512) -> __m512i {
            unsafe {
                let bits = _mm512_castps_si512(v);
                let high = _mm512_srli_epi32::<16>(bits);
                let odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
                let bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
                let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, bias));
                let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
                let quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
                _mm512_mask_blend_epi32(nan, rounded, quiet)
            }
        }
        /// The even positions `a` and the odd ones `b` rounded to bf16 and put in order, 64
        /// bytes: AVX512-BF16 rounds all 32 in one `vcvtne2ps2bf16` (`a` in the low 16 words, `b`
        /// in the high) and one `vpermw` interleaves them; without it, each lane of `b`'s
        /// rounding goes above the same lane of `a`'s.
        #[inline(always)]
        fn pair_bf16(self, a: __m512, b: __m512) -> __m512i {
            unsafe {
                if BF16 {
                    let rounded = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(b, a));
                    _mm512_permutexvar_epi16(_mm512_loadu_si512(WORDS_IN_ORDER.as_ptr().cast()), rounded)
                } else {
                    _mm512_or_si512(self.bf16_lanes(a), _mm512_slli_epi32::<16>(self.bf16_lanes(b)))
                }
            }
        }
        /// The 32 kept values `k` (even positions, then odd) times `kb` plus `d`, as
        /// [`Self::pair_bf16`] rounds and orders them.
        #[inline(always)]
        fn rescaled_pair_bf16(self, k: &[f32], kb: __m512, d: __m512) -> __m512i {
            let a = self.mul_add(self.load(&k[..LANES]), kb, d);
            self.pair_bf16(a, self.mul_add(self.load(&k[LANES..2 * LANES]), kb, d))
        }
        /// 16 values rounded to a 16-bit `T` (to nearest even), packed in 32 bytes.
        #[inline(always)]
        fn packed16<T: Element>(self, v: __m512) -> __m256i {
            unsafe {
                match T::DTYPE {
                    DType::BF16 if BF16 => std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(v)),
                    DType::BF16 => _mm512_cvtepi32_epi16(self.bf16_lanes(v)),
                    DType::F16 => _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v),
                    DType::F32 => unreachable!("packed16 is for 16-bit dtypes"),
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::super::math::{EXP2_POLY_DEG5, EXP_POLY, LN2_HI, LN2_LO, MAX_ARG, MIN_ARG, ROUND_MAGIC};
    use super::{streamed_dtype, Avx2, Simd, LANES};
    use crate::element::{DType, Element};

    /// Lanes 0..8 and 8..16.
    type Pair = (__m256, __m256);

    /// `$op` on each half of the pairs, written out: a closure would be compiled without the
    /// kernel's target features and called, not inlined (see `lanewise!`).
    macro_rules! halves {
        ($op:ident($($v:ident),+)) => {
            // SAFETY: compiled into AVX2 + FMA kernels only (see `Avx2`).
            unsafe { ($op($($v.0),+), $op($($v.1),+)) }
        };
    }

    /// `math::exp::<true>` on 8 lanes.
    #[inline(always)]
    fn exp8(x: __m256) -> __m256 {
        // SAFETY: compiled into AVX2 + FMA kernels only (see `Avx2`).
        unsafe {
            // maxps / minps return their second operand when either is NaN: a NaN stays.
            let xc = _mm256_min_ps(_mm256_set1_ps(MAX_ARG), _mm256_max_ps(_mm256_set1_ps(MIN_ARG), x));
            let magic = _mm256_set1_ps(ROUND_MAGIC);
            let shifted = _mm256_fmadd_ps(xc, _mm256_set1_ps(std::f32::consts::LOG2_E), magic);
            let n = _mm256_sub_ps(shifted, magic);
            let n_int = _mm256_sub_epi32(_mm256_castps_si256(shifted), _mm256_castps_si256(magic));
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), xc);
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
            let mut p = _mm256_set1_ps(EXP_POLY[0]);
            for &c in &EXP_POLY[1..] {
                p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
            }
            let scale = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n_int, _mm256_set1_epi32(127))));
            let below = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(MIN_ARG));
            _mm256_andnot_ps(below, _mm256_mul_ps(p, scale))
        }
    }

    /// 2^23 + 127: added to an integer `n` in [-127, 128] (exactly), it leaves `n + 127` in the
    /// low mantissa bits, which a shift by 23 moves into the exponent field of `2^n`.
    const EXPONENT_MAGIC: f32 = 8_388_735.0;

    /// `2^t` on 8 lanes, AVX-512's `exp2` written for AVX2: `f = t - floor t` (exact but for
    /// `t` in (-0.5, 0), where `t + 1` is rounded to nearest), `math::EXP2_POLY_DEG5` for `2^f`,
    /// times `2^floor t` built in the exponent bits. So the same bits as AVX-512's wherever the
    /// result is a normal number, but for `t` in (-0.5, 0), where `vreduceps` rounds `t + 1`
    /// down (the last bit may differ); `t` is clamped to [-127, 128] first (a NaN stays), so
    /// that below 2^-126 the result is 0 (the exponent field 0; AVX-512 gives the subnormals)
    /// and from 2^128 on it is inf. 12 operations where `exp8` takes 19, and no range
    /// reduction by `ln 2` in two parts.
    #[inline(always)]
    fn exp2_8(t: __m256) -> __m256 {
        // SAFETY: compiled into AVX2 + FMA kernels only (see `Avx2`).
        unsafe {
            // maxps / minps return their second operand when either is NaN: a NaN stays.
            let t = _mm256_min_ps(_mm256_set1_ps(128.0), _mm256_max_ps(_mm256_set1_ps(-127.0), t));
            let floor = _mm256_round_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t);
            let f = _mm256_sub_ps(t, floor);
            let mut p = _mm256_set1_ps(EXP2_POLY_DEG5[0]);
            for &c in &EXP2_POLY_DEG5[1..] {
                p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
            }
            let biased = _mm256_castps_si256(_mm256_add_ps(floor, _mm256_set1_ps(EXPONENT_MAGIC)));
            _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(biased)))
        }
    }

    /// The 8 bf16 at `p`, widened.
    ///
    /// # Safety
    /// AVX2 kernels only; 16 bytes readable at `p`.
    #[inline(always)]
    unsafe fn widen_bf16(p: *const u16) -> __m256 {
        unsafe { _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())))) }
    }

    /// 8 f32 rounded to bf16 bits (nearest even, quiet NaNs kept, as `Element`) in 32-bit lanes.
    #[inline(always)]
    fn bf16_bits8(v: __m256) -> __m256i {
        // SAFETY: compiled into AVX2 kernels only.
        unsafe { _mm256_srli_epi32::<16>(bf16_high8(v)) }
    }

    /// [`bf16_bits8`] left in the high half of each lane (the low half is left over): the
    /// odd positions of [`interleaved_bf16`] go there as they are, the even ones one shift down.
    #[inline(always)]
    fn bf16_high8(v: __m256) -> __m256i {
        // SAFETY: compiled into AVX2 kernels only.
        unsafe {
            let bits = _mm256_castps_si256(v);
            let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
            let rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
            let quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x0040_0000));
            let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
            _mm256_blendv_epi8(rounded, quiet, nan)
        }
    }

    /// 16 values given as their even positions `even` and odd ones `odd` (8 each, as
    /// `load_pair_t` splits bf16), rounded to bf16 in order: 32 bytes, each lane's even value
    /// in its low half and its odd one above, by a shift, an `and` and an `or` where rounding in
    /// order ([`packed16`]) takes a shift each, a pack and a lane permute.
    #[inline(always)]
    fn interleaved_bf16(even: __m256, odd: __m256) -> __m256i {
        // SAFETY: compiled into AVX2 kernels only.
        unsafe {
            let high = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
            _mm256_or_si256(_mm256_srli_epi32::<16>(bf16_high8(even)), _mm256_and_si256(bf16_high8(odd), high))
        }
    }

    /// Two vectors of 8, one of 8 even positions and one of the 8 odd positions after them,
    /// interleaved in order: positions 0..8 and 8..16.
    #[inline(always)]
    fn interleaved8(even: __m256, odd: __m256) -> Pair {
        // SAFETY: compiled into AVX2 kernels only.
        unsafe {
            // Within each 128-bit lane: [e0 o0 e1 o1 | e4 o4 e5 o5] and [e2 o2 e3 o3 | e6 o6 e7 o7].
            let (low, high) = (_mm256_unpacklo_ps(even, odd), _mm256_unpackhi_ps(even, odd));
            (_mm256_permute2f128_ps::<0x20>(low, high), _mm256_permute2f128_ps::<0x31>(low, high))
        }
    }

    // SAFETY (every method): `Avx2` values exist only inside functions compiled with AVX2, FMA
    // and F16C enabled and called after detection, so the intrinsics are supported; loads and
    // stores index slices of at least 16 elements (checked by the slice indexing).
    impl Simd for Avx2 {
        type V = Pair;
        const NATIVE_EXP2: bool = true;

        #[inline(always)]
        fn splat(self, x: f32) -> Pair {
            unsafe { (_mm256_set1_ps(x), _mm256_set1_ps(x)) }
        }
        #[inline(always)]
        fn load(self, src: &[f32]) -> Pair {
            let p = src[..LANES].as_ptr();
            unsafe { (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))) }
        }
        #[inline(always)]
        fn store(self, v: Pair, dst: &mut [f32]) {
            let p = dst[..LANES].as_mut_ptr();
            unsafe {
                _mm256_storeu_ps(p, v.0);
                _mm256_storeu_ps(p.add(8), v.1);
            }
        }
        #[inline(always)]
        fn add(self, a: Pair, b: Pair) -> Pair {
            halves!(_mm256_add_ps(a, b))
        }
        #[inline(always)]
        fn sub(self, a: Pair, b: Pair) -> Pair {
            halves!(_mm256_sub_ps(a, b))
        }
        #[inline(always)]
        fn mul(self, a: Pair, b: Pair) -> Pair {
            halves!(_mm256_mul_ps(a, b))
        }
        #[inline(always)]
        fn mul_add(self, a: Pair, b: Pair, c: Pair) -> Pair {
            halves!(_mm256_fmadd_ps(a, b, c))
        }
        #[inline(always)]
        fn max(self, a: Pair, b: Pair) -> Pair {
            // vmaxps returns its second operand when either is NaN.
            halves!(_mm256_max_ps(a, b))
        }
        #[inline(always)]
        fn exp(self, x: Pair) -> Pair {
            (exp8(x.0), exp8(x.1))
        }
        #[inline(always)]
        fn exp2(self, t: Pair) -> Pair {
            (exp2_8(t.0), exp2_8(t.1))
        }
        #[inline(always)]
        fn load_t<T: Element>(self, src: &[T]) -> Pair {
            let p = src[..LANES].as_ptr();
            // SAFETY: 16 elements of `T` are readable at `p`; the dtype tells their layout.
            unsafe {
                match T::DTYPE {
                    DType::F32 => (_mm256_loadu_ps(p.cast()), _mm256_loadu_ps(p.cast::<f32>().add(8))),
                    DType::BF16 => (widen_bf16(p.cast()), widen_bf16(p.add(8).cast())),
                    DType::F16 => {
                        (_mm256_cvtph_ps(_mm_loadu_si128(p.cast())), _mm256_cvtph_ps(_mm_loadu_si128(p.add(8).cast())))
                    }
                }
            }
        }
        #[inline(always)]
        fn store_t<T: Element>(self, v: Pair, dst: &mut [T]) {
            // SAFETY: 16 elements of `T` are writable at the start of `dst`.
            unsafe { put::<T, false>(v, dst[..LANES].as_mut_ptr()) }
        }
        /// bf16, as on AVX-512: 32 logits by two 32-byte loads, a shift and an `and` each (the
        /// even positions' bits moved up, the odd ones' kept in place), where widening them in
        /// order takes a `vpmovzxwd` and a shift per 8. The gain is in the rounding back
        /// ([`interleaved_bf16`]): in a replica of the in-place sweep on Zen 3 the gradient loop
        /// took 15% less time, the whole sweep 5%, flashgrpo's in-place bf16 step 19-22%
        /// (docs/BENCHMARKS.md). Rows whose gradient needs `log p` (an entropy term) put the
        /// kept values back in order first ([`Simd::pair_in_order`]: four shuffles per 16),
        /// which cost ~5% in cache there.
        #[inline(always)]
        fn splits<T: Element>(self) -> bool {
            T::DTYPE == DType::BF16
        }
        /// bf16: the even positions' vector is logits 0, 2, .., 30 (16 lanes, as on AVX-512),
        /// the odd one 1, 3, .., 31.
        #[inline(always)]
        fn load_pair_t<T: Element>(self, src: &[T]) -> (Pair, Pair) {
            if T::DTYPE != DType::BF16 {
                return (self.load_t(&src[..LANES]), self.load_t(&src[LANES..2 * LANES]));
            }
            let p = src[..2 * LANES].as_ptr();
            // SAFETY: 32 two-byte elements are readable at `p`.
            unsafe {
                let (x0, x1) = (_mm256_loadu_si256(p.cast()), _mm256_loadu_si256(p.add(LANES).cast()));
                let high = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
                let even = (_mm256_slli_epi32::<16>(x0), _mm256_slli_epi32::<16>(x1));
                let odd = (_mm256_and_si256(x0, high), _mm256_and_si256(x1, high));
                (
                    (_mm256_castsi256_ps(even.0), _mm256_castsi256_ps(even.1)),
                    (_mm256_castsi256_ps(odd.0), _mm256_castsi256_ps(odd.1)),
                )
            }
        }
        #[inline(always)]
        fn pair_in_order<T: Element>(self, a: Pair, b: Pair) -> (Pair, Pair) {
            if T::DTYPE != DType::BF16 {
                return (a, b);
            }
            (interleaved8(a.0, b.0), interleaved8(a.1, b.1))
        }
        #[inline(always)]
        fn store_pair_t<T: Element>(self, a: Pair, b: Pair, dst: &mut [T]) {
            if T::DTYPE != DType::BF16 {
                let (a, b) = self.pair_in_order::<T>(a, b);
                self.store_t(a, &mut dst[..LANES]);
                return self.store_t(b, &mut dst[LANES..2 * LANES]);
            }
            let p = dst[..2 * LANES].as_mut_ptr();
            // SAFETY: 32 two-byte elements are writable at `p`.
            unsafe {
                _mm256_storeu_si256(p.cast(), interleaved_bf16(a.0, b.0));
                _mm256_storeu_si256(p.add(LANES).cast(), interleaved_bf16(a.1, b.1));
            }
        }
        /// bf16 where `dst` starts on 32 bytes (every row of a vocabulary that is a multiple of
        /// 16, in a buffer aligned as allocators align large ones): each pair's two 32-byte
        /// pieces by non-temporal stores, which fill whole lines one after another, but for a
        /// half line at either end when `dst` starts half way into a line (plain stores there,
        /// as `stream_t`'s callers write partial lines). Elsewhere by plain stores: unlike
        /// AVX-512's, no shifting of the pairs onto lines (AVX2 has no word permute across its
        /// 128-bit lanes).
        #[inline(always)]
        fn stream_rescaled_pairs<T: Element>(self, kept: &[f32], kb: f32, d: f32, dst: &mut [T]) {
            let start = dst.as_ptr() as usize;
            if T::DTYPE != DType::BF16 || !start.is_multiple_of(32) {
                return super::plain_rescaled_pairs(self, kept, kb, d, dst);
            }
            // The pieces that are half lines: the first (when `dst` starts half way into a line)
            // and then the last.
            let half_lines = !start.is_multiple_of(64);
            let last = (dst.len() / LANES).saturating_sub(1);
            let (kb, d) = (self.splat(kb), self.splat(d));
            for (k, (kept, out)) in kept.chunks_exact(2 * LANES).zip(dst.chunks_exact_mut(2 * LANES)).enumerate() {
                let a = self.mul_add(self.load(&kept[..LANES]), kb, d);
                let b = self.mul_add(self.load(&kept[LANES..]), kb, d);
                let p = out.as_mut_ptr().cast::<__m256i>();
                // (No closure: closures are not compiled with the kernel's target features.)
                let (first, second) = (2 * k, 2 * k + 1);
                let first_whole = !half_lines || (first != 0 && first != last);
                let second_whole = !half_lines || second != last;
                // SAFETY: 64 bytes are writable at `p` (a pair), which is 32-byte aligned (`dst`
                // is).
                unsafe {
                    put32_streamed_if(p, interleaved_bf16(a.0, b.0), first_whole);
                    put32_streamed_if(p.add(1), interleaved_bf16(a.1, b.1), second_whole);
                }
            }
        }
        #[inline(always)]
        fn streams<T: Element>(self) -> bool {
            streamed_dtype::<T>()
        }
        #[inline(always)]
        fn stream_t<T: Element>(self, v: Pair, dst: &mut [T]) {
            let p = dst[..LANES].as_mut_ptr();
            if !(p as usize).is_multiple_of(32) {
                return self.store_t(v, dst);
            }
            // SAFETY: 16 elements of `T` are writable at `p`, which is 32-byte aligned.
            unsafe { put::<T, true>(v, p) }
        }
        #[inline(always)]
        fn stream_fence(self) {
            unsafe { _mm_sfence() }
        }
    }

    /// 16 values stored at `p` in `T`'s layout: by plain stores, or with `STREAM` by
    /// non-temporal ones (the same bits).
    ///
    /// # Safety
    /// 16 elements of `T` writable at `p`; with `STREAM`, `p` 32-byte aligned.
    #[inline(always)]
    unsafe fn put<T: Element, const STREAM: bool>(v: Pair, p: *mut T) {
        let p = p.cast::<__m256i>();
        match T::DTYPE {
            DType::F32 => unsafe {
                put32::<STREAM>(p, _mm256_castps_si256(v.0));
                put32::<STREAM>(p.add(1), _mm256_castps_si256(v.1));
            },
            DType::BF16 | DType::F16 => unsafe { put32::<STREAM>(p, packed16::<T>(v)) },
        }
    }

    /// One 32-byte store, non-temporal if `stream` (decided at run time, unlike [`put32`]).
    ///
    /// # Safety
    /// 32 bytes writable at `p`, 32-byte aligned.
    #[inline(always)]
    unsafe fn put32_streamed_if(p: *mut __m256i, x: __m256i, stream: bool) {
        unsafe {
            if stream {
                _mm256_stream_si256(p, x)
            } else {
                _mm256_storeu_si256(p, x)
            }
        }
    }

    /// One 32-byte store, plain or non-temporal.
    ///
    /// # Safety
    /// 32 bytes writable at `p`; with `STREAM`, `p` 32-byte aligned.
    #[inline(always)]
    unsafe fn put32<const STREAM: bool>(p: *mut __m256i, x: __m256i) {
        unsafe {
            if STREAM {
                _mm256_stream_si256(p, x)
            } else {
                _mm256_storeu_si256(p, x)
            }
        }
    }

    /// 16 values rounded to a 16-bit `T` (to nearest even), in order in one register.
    #[inline(always)]
    fn packed16<T: Element>(v: Pair) -> __m256i {
        // SAFETY: compiled into AVX2 + FMA + F16C kernels only (see `Avx2`).
        unsafe {
            match T::DTYPE {
                DType::BF16 => {
                    // packus interleaves the 128-bit lanes: [lo 0-3, hi 0-3 | lo 4-7, hi 4-7].
                    let packed = _mm256_packus_epi32(bf16_bits8(v.0), bf16_bits8(v.1));
                    _mm256_permute4x64_epi64::<0b11_01_10_00>(packed)
                }
                DType::F16 => {
                    const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT;
                    _mm256_set_m128i(_mm256_cvtps_ph::<NEAREST>(v.1), _mm256_cvtps_ph::<NEAREST>(v.0))
                }
                DType::F32 => unreachable!("packed16 is for 16-bit dtypes"),
            }
        }
    }
}

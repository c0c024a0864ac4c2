//! [`Simd`] on AVX2 intrinsics: the 16 lanes as two 8-lane registers, the portable arithmetic
//! written out, and an `exp2` of its own with AVX-512's polynomial.

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

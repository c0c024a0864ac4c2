//! [`Simd`] on AVX-512 intrinsics (with AVX512-BF16's conversions where `BF16`): `exp` and `exp2`
//! on `vscalefps`, bf16 widened 32 at a time as even and odd positions.

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

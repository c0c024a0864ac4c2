//! Sixteen f32 lanes, two ways: portable arrays that LLVM autovectorises for whatever the calling
//! function is compiled for, and AVX-512 intrinsics (whose `exp` uses `vscalefps` and so needs no
//! exponent bit tricks, range clamp on the high side, or underflow fix-up). The row kernels are
//! written once over [`Simd`]; a token value of the implementation selects it, at no cost.

use super::math;

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
    /// Lane-wise maximum; a NaN in `b` propagates.
    fn max(self, a: Self::V, b: Self::V) -> Self::V;
    fn exp(self, x: Self::V) -> Self::V;
    fn to_array(self, v: Self::V) -> [f32; LANES];
    /// `a * b + c` on one scalar, as the scalar tails compute it.
    fn scalar_mul_add(self, a: f32, b: f32, c: f32) -> f32;
    fn scalar_exp(self, x: f32) -> f32;
}

/// Plain arrays; `FMA` only where the target has it (elsewhere `mul_add` is a libm call).
#[derive(Clone, Copy)]
pub(crate) struct Portable<const FMA: bool>;

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
        std::array::from_fn(|k| a[k] + b[k])
    }
    #[inline(always)]
    fn sub(self, a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|k| a[k] - b[k])
    }
    #[inline(always)]
    fn mul(self, a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|k| a[k] * b[k])
    }
    #[inline(always)]
    fn mul_add(self, a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        std::array::from_fn(|k| math::madd::<FMA>(a[k], b[k], c[k]))
    }
    #[inline(always)]
    fn max(self, a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|k| if a[k] >= b[k] { a[k] } else { b[k] })
    }
    #[inline(always)]
    fn exp(self, x: Self::V) -> Self::V {
        std::array::from_fn(|k| math::exp::<FMA>(x[k]))
    }
    #[inline(always)]
    fn to_array(self, v: Self::V) -> [f32; LANES] {
        v
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
/// run-time detection (`isa.rs`).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct Avx512;

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{Avx512, Simd, LANES};

    // SAFETY (every method): `Avx512` values exist only inside functions compiled with
    // AVX-512F enabled and called after detection, so the intrinsics are supported; loads and
    // stores index slices of at least 16 elements (checked by the slice indexing).
    impl Simd for Avx512 {
        type V = __m512;

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
        /// `exp(x) = 2^n * p(r)`, `n = round(x log2 e)`, `r = x - n ln 2` (two-part), `p` the
        /// Cephes degree-6 polynomial; `vscalefps` applies `2^n` with correct underflow to 0
        /// and overflow to inf. `x` is clamped below at -104 so that `r` stays small.
        #[inline(always)]
        fn exp(self, x: __m512) -> __m512 {
            unsafe {
                let x = _mm512_max_ps(_mm512_set1_ps(-104.0), x);
                let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
                    x,
                    _mm512_set1_ps(std::f32::consts::LOG2_E),
                ));
                let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
                let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
                let mut p = _mm512_set1_ps(1.987_569_1e-4);
                p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.398_199_9e-3));
                p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.333_452e-3));
                p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.166_579_6e-2));
                p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.666_666_5e-1));
                p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5));
                let y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0));
                _mm512_scalef_ps(y, n)
            }
        }
        #[inline(always)]
        fn to_array(self, v: __m512) -> [f32; LANES] {
            let mut out = [0.0; LANES];
            self.store(v, &mut out);
            out
        }
        #[inline(always)]
        fn scalar_mul_add(self, a: f32, b: f32, c: f32) -> f32 {
            a.mul_add(b, c)
        }
        #[inline(always)]
        fn scalar_exp(self, x: f32) -> f32 {
            super::math::exp::<true>(x)
        }
    }
}

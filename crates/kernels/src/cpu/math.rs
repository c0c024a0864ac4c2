//! A vectorisable `exp` for f32. `f32::exp` calls libm one element at a time; this one is plain
//! arithmetic and bit operations, so LLVM turns a loop of it into SIMD (SSE2 / AVX2 / AVX-512,
//! whichever the calling function is compiled for). With `FMA` the multiply-adds are fused
//! (use it only where the target has FMA: elsewhere `mul_add` is a libm call).
//!
//! Method (Cephes `expf`): `exp(x) = 2^n * exp(r)`, `n = round(x / ln 2)`,
//! `r = x - n ln 2` in two parts, `exp(r)` by Cephes' polynomial in Horner form. Max
//! relative error about 2 ulp on [-87, 88]; below -87 the result is flushed to 0 (true value
//! < 1.7e-38).

const LOG2E: f32 = std::f32::consts::LOG2_E;
pub(crate) const LN2_HI: f32 = 0.693_359_4;
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5 * 2^23: adding it rounds to the nearest integer, which lands in the low mantissa bits.
pub(crate) const ROUND_MAGIC: f32 = 12_582_912.0;
pub(crate) const MIN_ARG: f32 = -87.0;
pub(crate) const MAX_ARG: f32 = 88.0;

/// `exp(r)` on `[-ln 2 / 2, ln 2 / 2]`, degree 7, highest degree first (Cephes `expf`'s
/// `1 + r + r^2 P(r)` expanded).
pub(crate) const EXP_POLY: [f32; 8] =
    [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5, 1.0, 1.0];

/// `exp(r)` on `[-ln 2 / 2, ln 2 / 2]`, degree 5, highest degree first: `1 + r` fixed and the
/// rest fitted for the least maximum relative error (1.0e-7 in exact arithmetic, 1.6e-7
/// evaluated in f32 with FMA). The AVX-512 `exp` uses it: two multiply-adds fewer than
/// [`EXP_POLY`] of the ~20 vector operations a logit costs in the row kernels, for an error of
/// about 1.3 ulp at 1 (the whole `exp`'s worst over [-100, 10]: 3.9e-7, against 2.9e-7).
pub(crate) const EXP_POLY_DEG5: [f32; 6] = [8.312_525e-3, 4.189_011_5e-2, 1.666_711_4e-1, 4.999_923e-1, 1.0, 1.0];

/// `2^f` on `[0, 1)`, degree 5, highest degree first: `1` fixed (so that `2^n` is exact for an
/// integer `n`) and the rest fitted for the least maximum relative error (8.2e-8 in exact
/// arithmetic, 1.4e-7 evaluated in f32 with FMA; `bench/tools/fit_exp2_poly.py` fits and checks
/// it). The AVX-512 and AVX2 `exp2` use it after `vreduceps` (or `vroundps` and a subtraction)
/// leaves `f = t - floor t`.
pub(crate) const EXP2_POLY_DEG5: [f32; 6] =
    [1.867_132_4e-3, 9.017_025e-3, 5.579_991_6e-2, 2.401_644_4e-1, 6.931_513e-1, 1.0];

/// `a * b + c`, fused when `FMA`.
#[inline(always)]
pub fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

#[inline(always)]
pub fn exp<const FMA: bool>(x: f32) -> f32 {
    let xc = x.clamp(MIN_ARG, MAX_ARG);
    let shifted = madd::<FMA>(xc, LOG2E, ROUND_MAGIC);
    let n = shifted - ROUND_MAGIC;
    let n_int = shifted.to_bits().wrapping_sub(ROUND_MAGIC.to_bits()) as i32;
    let r = madd::<FMA>(-n, LN2_HI, xc);
    let r = madd::<FMA>(-n, LN2_LO, r);
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = madd::<FMA>(p, r, c);
    }
    let scale = f32::from_bits((n_int.wrapping_add(127) as u32) << 23);
    if x < MIN_ARG {
        0.0
    } else {
        p * scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worst<const FMA: bool>() -> f64 {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            worst = worst.max(((exp::<FMA>(x) as f64 - want) / want).abs());
            x += 0.000_731;
        }
        worst
    }

    #[test]
    fn matches_f64_exp() {
        assert!(worst::<false>() < 3.0e-7, "worst relative error {}", worst::<false>());
        assert!(worst::<true>() < 3.0e-7, "worst relative error with FMA {}", worst::<true>());
        assert_eq!(exp::<false>(0.0), 1.0);
        assert_eq!(exp::<false>(-1000.0), 0.0);
        assert_eq!(exp::<false>(f32::NEG_INFINITY), 0.0);
        assert!(exp::<false>(f32::NAN).is_nan());
    }
}

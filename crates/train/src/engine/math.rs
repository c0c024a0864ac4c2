//! Small numeric kernels the engine's loops are built from, written so that the compiler
//! vectorises them: `exp` as a branch-free polynomial, dot products with eight partial sums in a
//! fixed order, `y += a x`. [`avx2_or_baseline!`] compiles a hot function a second time for AVX2 and
//! FMA and picks it at run time (the portable build targets SSE2 only).

/// `exp(x)` in f32 for `x` in `[-87, 88]` (clamped outside: about 1e-38 below, about 1.6e38
/// above): `2^n * p(f)` with `x = n ln 2 + f`, `|f| <= ln 2 / 2`, and `p` the degree-7 Taylor
/// polynomial (within two ulps). Branch-free and without float-to-int conversion (`2^n` comes from
/// the bits of `n + 2^23 + 127`), so that loops over it vectorise.
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding and subtracting it rounds to an integer
    const BIASED: f32 = 8_388_735.0; // 2^23 + 127: its low mantissa bits hold n + 127
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    let f = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + f * (1.0
            + f * (0.5 + f * (1.0 / 6.0 + f * (1.0 / 24.0 + f * (1.0 / 120.0 + f * (1.0 / 720.0 + f / 5040.0))))));
    p * f32::from_bits(((n + BIASED).to_bits() & 0x007F_FFFF) << 23)
}

/// Eight lanes added pairwise.
#[inline(always)]
fn reduce(acc: [f32; 8]) -> f32 {
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// `a . b` with eight partial sums in a fixed order.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8.remainder().iter().zip(b8.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in a8.zip(b8) {
        let (x, y): (&[f32; 8], &[f32; 8]) = (x.try_into().expect("8"), y.try_into().expect("8"));
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    reduce(acc) + tail
}

/// The sum of `x` with eight partial sums in a fixed order.
#[inline(always)]
pub fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        let c: &[f32; 8] = c.try_into().expect("8");
        for l in 0..8 {
            acc[l] += c[l];
        }
    }
    reduce(acc) + tail
}

/// `y += a x`.
#[inline(always)]
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, &x)| *y += a * x);
}

/// Defines `fn $name(args) -> ret` that runs `$body(args)` compiled for AVX2 + FMA when the CPU has
/// them, and as compiled for the build's target otherwise. `$body` should be `#[inline(always)]`
/// (so that it, and what it calls, is compiled with the features).
macro_rules! avx2_or_baseline {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? => $body:path) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                if flashgrpo_kernels::Isa::detected() >= flashgrpo_kernels::Isa::Avx2 {
                    // SAFETY: the CPU has AVX2 and FMA (checked at run time just above).
                    return unsafe { avx2($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}
pub(crate) use avx2_or_baseline;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_polynomial_exp_is_within_two_ulps() {
        for i in 0..400_000 {
            let x = -87.0 + (i as f32) * 175.0 / 400_000.0;
            let (got, want) = (fast_exp(x), x.exp());
            assert!(((got - want) / want).abs() < 2.5e-7, "exp({x}) = {got}, want {want}");
        }
        assert!(fast_exp(-1000.0) < 1e-37 && fast_exp(f32::NEG_INFINITY) >= 0.0);
        assert!(fast_exp(1000.0).is_finite() && fast_exp(88.0) > 1.6e38);
    }

    #[test]
    fn sums_in_a_fixed_order() {
        let x: Vec<f32> = (0..37).map(|i| (i as f32 * 0.7).sin()).collect();
        let want: f64 = x.iter().map(|&v| v as f64).sum();
        assert!((sum(&x) as f64 - want).abs() < 1e-5);
        let y: Vec<f32> = (0..37).map(|i| (i as f32 * 0.3).cos()).collect();
        let want: f64 = x.iter().zip(&y).map(|(a, b)| *a as f64 * *b as f64).sum();
        assert!((dot(&x, &y) as f64 - want).abs() < 1e-5);
    }
}

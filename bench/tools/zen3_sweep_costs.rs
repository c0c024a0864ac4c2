//! What the logits-level in-place sweep's two loops cost on an AVX2-only CPU (AMD Zen 3), piece by
//! piece (issue 17, item 3; docs/BENCHMARKS.md, "bf16 as even and odd positions on AVX2"). A
//! standalone program, outside the workspace so that CI never builds it:
//!
//! ```sh
//! rustc --edition 2021 -O -C target-cpu=native bench/tools/zen3_sweep_costs.rs -o /tmp/zen3_sweep_costs
//! /tmp/zen3_sweep_costs
//! ```
//!
//! 1. one instruction's reciprocal throughput, on 8 independent chains;
//! 2. the statistics loop's arithmetic (widening, the `t` FMA, `2^t`, the two sums) with the
//!    logits in L1 and nothing stored, with AVX2's `exp2_8` as `cpu::simd` has it and variants
//!    (no clamp, Estrin's scheme, degree 4, rounding to nearest by an addition);
//! 3. a replica of `cpu::row`'s base-2 sweep over 16 rows of V=151936 bf16 logits in turn (from
//!    L3, as `flashgrpo bench`'s in-cache run reads them): the statistics loop keeping `2^t` in
//!    f32 (or nothing), the gradient loop rescaling the kept values and rounding them to bf16
//!    over the logits, and both; the logits widened in order (`vpmovzxwd`) or as even and odd
//!    positions, the gradient rounded in order (`vpackusdw` and `vpermq`) or from that layout.
//!
//! The polynomial is `math::EXP2_POLY_DEG5`'s (the costs, not the values, are the point).
use std::arch::x86_64::*;
use std::hint::black_box;
use std::time::Instant;

const V: usize = 151_936;
const ROWS: usize = 16;
const POLY: [f32; 6] = [1.867_132_4e-3, 9.017_025e-3, 5.579_991_6e-2, 2.401_644_4e-1, 6.931_513e-1, 1.0];

/// `2^t` as AVX2's `exp2_8` builds it from `t` (already clamped, or not): `f = t - floor t`,
/// the polynomial `$poly(f)`, times `2^floor t` made in the exponent bits.
macro_rules! exp2_from {
    ($t:expr, $poly:expr) => {{
        let t = $t;
        let floor = _mm256_round_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t);
        let f = _mm256_sub_ps(t, floor);
        let biased = _mm256_castps_si256(_mm256_add_ps(floor, _mm256_set1_ps(8_388_735.0)));
        _mm256_mul_ps($poly(f), _mm256_castsi256_ps(_mm256_slli_epi32::<23>(biased)))
    }};
}

/// `t` clamped to [-127, 128], the exponent field's range.
#[inline(always)]
unsafe fn clamped(t: __m256) -> __m256 {
    _mm256_min_ps(_mm256_set1_ps(128.0), _mm256_max_ps(_mm256_set1_ps(-127.0), t))
}

/// `cpu::simd`'s AVX2 `exp2_8`.
#[inline(always)]
unsafe fn exp2_8(t: __m256) -> __m256 {
    exp2_from!(clamped(t), poly5)
}

#[inline(always)]
unsafe fn widen8(p: *const u16) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()))))
}

/// bf16 bits (nearest even, NaN quieted) in 32-bit lanes, as `cpu::simd::bf16_bits8`.
#[inline(always)]
unsafe fn bf16_bits8(v: __m256) -> __m256i {
    let bits = _mm256_castps_si256(v);
    let high = _mm256_srli_epi32::<16>(bits);
    let odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
    let bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF));
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(bits, bias));
    let quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
    _mm256_blendv_epi8(rounded, quiet, nan)
}

/// As `bf16_bits8`, the result left in the high halves (no final shift): for the even/odd layout.
#[inline(always)]
unsafe fn bf16_high8(v: __m256) -> __m256i {
    let bits = _mm256_castps_si256(v);
    let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
    let rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    let quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x0040_0000));
    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
    _mm256_blendv_epi8(rounded, quiet, nan)
}

/// Statistics loop, 16 logits a step: `EVEN_ODD` widens 16 by one 32-byte load, a shift and an
/// `and` (the kept values stored even 8, odd 8); else two `vpmovzxwd` and shifts. `STORE`: the
/// kept `2^t` stored.
#[inline(always)]
unsafe fn statistics<const EVEN_ODD: bool, const STORE: bool>(row: &[u16], kept: &mut [f32]) -> f32 {
    let (a, r) = (_mm256_set1_ps(0.144_269_5), _mm256_set1_ps(3.0));
    let high = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    let (mut sv, mut dv) = ([_mm256_setzero_ps(); 2], [_mm256_setzero_ps(); 2]);
    for j in (0..V).step_by(16) {
        let w = if EVEN_ODD {
            let x = _mm256_loadu_si256(row.as_ptr().add(j).cast());
            [_mm256_castsi256_ps(_mm256_slli_epi32::<16>(x)), _mm256_castsi256_ps(_mm256_and_si256(x, high))]
        } else {
            [widen8(row.as_ptr().add(j)), widen8(row.as_ptr().add(j + 8))]
        };
        for h in 0..2 {
            let t = _mm256_fmsub_ps(w[h], a, r);
            let e = exp2_8(t);
            if STORE {
                _mm256_storeu_ps(kept.as_mut_ptr().add(j + 8 * h), e);
            }
            sv[h] = _mm256_add_ps(sv[h], e);
            dv[h] = _mm256_fmadd_ps(e, t, dv[h]);
        }
    }
    let s = _mm256_add_ps(_mm256_add_ps(sv[0], sv[1]), _mm256_add_ps(dv[0], dv[1]));
    let mut out = [0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), s);
    out.iter().sum()
}

/// Gradient loop: kept * kb + d rounded to bf16 over the row, NaNs quieted as `cpu::simd` does.
/// `EVEN_ODD`: the kept values are in even / odd blocks of 8, and each 16 go back in order by a
/// shift of the even values' rounding, an `and` of the odd ones' and an `or` (`cpu::simd`'s
/// `interleaved_bf16`); else each 8 rounded in order and two packed by `vpackusdw` and `vpermq`.
#[inline(always)]
unsafe fn gradient<const EVEN_ODD: bool>(kept: &[f32], out: &mut [u16], kb: f32, d: f32) {
    let (kb, d) = (_mm256_set1_ps(kb), _mm256_set1_ps(d));
    let low = _mm256_set1_epi32(0xFFFF);
    for j in (0..V).step_by(16) {
        let g0 = _mm256_fmadd_ps(_mm256_loadu_ps(kept.as_ptr().add(j)), kb, d);
        let g1 = _mm256_fmadd_ps(_mm256_loadu_ps(kept.as_ptr().add(j + 8)), kb, d);
        let packed = if EVEN_ODD {
            let even = _mm256_srli_epi32::<16>(bf16_high8(g0));
            let odd = _mm256_andnot_si256(low, bf16_high8(g1));
            _mm256_or_si256(even, odd)
        } else {
            let p = _mm256_packus_epi32(bf16_bits8(g0), bf16_bits8(g1));
            _mm256_permute4x64_epi64::<0b11_01_10_00>(p)
        };
        _mm256_storeu_si256(out.as_mut_ptr().add(j).cast(), packed);
    }
}

// Parts 1 and 2: one instruction's throughput, and the statistics loop's arithmetic alone (the
// logits in L1, nothing stored) with `exp2` variants.

/// The degree-`degree` tail of `POLY` by Horner's rule (a chain of `degree` FMAs).
#[inline(always)]
unsafe fn poly(f: __m256, degree: usize) -> __m256 {
    let mut p = _mm256_set1_ps(POLY[5 - degree]);
    for &c in &POLY[6 - degree..] {
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
    }
    p
}
#[inline(always)]
unsafe fn poly5(f: __m256) -> __m256 {
    poly(f, 5)
}
#[inline(always)]
unsafe fn poly4(f: __m256) -> __m256 {
    poly(f, 4)
}
/// `exp2_8` without its clamps (wrong below 2^-127 and above 2^128).
#[inline(always)]
unsafe fn exp2_noclamp(t: __m256) -> __m256 {
    exp2_from!(t, poly5)
}
/// The clamp below alone (the one the statistics' `t` may need: it is at most a few units above 0).
#[inline(always)]
unsafe fn exp2_lowclamp(t: __m256) -> __m256 {
    exp2_from!(_mm256_max_ps(_mm256_set1_ps(-127.0), t), poly5)
}
/// `t` rounded to nearest by adding 1.5 2^23 (+ 127: the biased exponent in the low bits), `f` in
/// [-0.5, 0.5]: no `vroundps`, one addition more. (The polynomial is fitted on [0, 1): the cost,
/// not the values, is the point.)
#[inline(always)]
unsafe fn exp2_nearest(t: __m256) -> __m256 {
    let t = _mm256_max_ps(_mm256_set1_ps(-126.0), t);
    let magic = _mm256_set1_ps(12_582_912.0 + 127.0); // 1.5*2^23 + 127
    let j = _mm256_add_ps(t, magic); // nearest integer + 127 in the low bits
    let k = _mm256_sub_ps(j, magic);
    let f = _mm256_sub_ps(t, k); // [-0.5, 0.5]
    let scale = _mm256_slli_epi32::<23>(_mm256_castps_si256(j));
    _mm256_mul_ps(poly(f, 5), _mm256_castsi256_ps(scale))
}
/// `exp2_8` with a degree-4 polynomial (one FMA less in the chain; not accurate enough).
#[inline(always)]
unsafe fn exp2_deg4(t: __m256) -> __m256 {
    exp2_from!(clamped(t), poly4)
}
/// Estrin: (c5 + c4 f) + f2 (c3 + c2 f) + f4 (c1 + c0 f), POLY[0] the highest coefficient.
#[inline(always)]
unsafe fn poly_estrin(f: __m256) -> __m256 {
    let c = |i: usize| _mm256_set1_ps(POLY[i]);
    let f2 = _mm256_mul_ps(f, f);
    let lo = _mm256_fmadd_ps(c(4), f, c(5));
    let mid = _mm256_fmadd_ps(c(2), f, c(3));
    let hi = _mm256_fmadd_ps(c(0), f, c(1));
    let f4 = _mm256_mul_ps(f2, f2);
    _mm256_fmadd_ps(f4, hi, _mm256_fmadd_ps(f2, mid, lo))
}
/// Half Estrin: ((c0 f + c1) f2 + (c2 f + c3)) f2 + (c4 f + c5)
#[inline(always)]
unsafe fn poly_half(f: __m256) -> __m256 {
    let c = |i: usize| _mm256_set1_ps(POLY[i]);
    let f2 = _mm256_mul_ps(f, f);
    let a = _mm256_fmadd_ps(c(0), f, c(1));
    let b = _mm256_fmadd_ps(c(2), f, c(3));
    let d = _mm256_fmadd_ps(c(4), f, c(5));
    _mm256_fmadd_ps(_mm256_fmadd_ps(a, f2, b), f2, d)
}
/// `exp2_8` with Estrin's scheme (a shorter chain, two multiplies more).
#[inline(always)]
unsafe fn exp2_estrin(t: __m256) -> __m256 {
    exp2_from!(clamped(t), poly_estrin)
}
/// `exp2_8` with the half-Estrin scheme (three FMAs in the chain after `f^2`, one multiply more).
#[inline(always)]
unsafe fn exp2_half(t: __m256) -> __m256 {
    exp2_from!(clamped(t), poly_half)
}
/// Part 2: the statistics loop's arithmetic over `row` (in L1) with `exp2`, 32 logits a step in four
/// independent chains of sums, nothing stored.
#[target_feature(enable = "avx2,fma")]
unsafe fn arith(what: &str, row: &[u16], exp2: unsafe fn(__m256) -> __m256) {
    let reps = 200_000usize;
    let (a, r) = (_mm256_set1_ps(0.144_269_5), _mm256_set1_ps(3.0));
    let (mut sv, mut dv) = ([_mm256_setzero_ps(); 4], [_mm256_setzero_ps(); 4]);
    let start = Instant::now();
    for _ in 0..reps {
        for j in (0..row.len()).step_by(32) {
            for h in 0..4 {
                let t = _mm256_fmsub_ps(widen8(row.as_ptr().add(j + 8 * h)), a, r);
                let e = exp2(t);
                sv[h] = _mm256_add_ps(sv[h], e);
                dv[h] = _mm256_fmadd_ps(e, t, dv[h]);
            }
        }
    }
    let s = start.elapsed().as_secs_f64();
    black_box((sv, dv));
    println!("  {what:<40} {:6.3} ns per 8 logits", s * 1e9 / (reps * row.len() / 8) as f64);
}
/// Part 1: `op` on 8 independent chains (enough to cover its latency): its reciprocal throughput.
#[target_feature(enable = "avx2,fma")]
unsafe fn tp(what: &str, op: unsafe fn(__m256, __m256) -> __m256) {
    let n = 20_000_000usize;
    let mut acc = [_mm256_set1_ps(1.0001); 8];
    let c = black_box(_mm256_set1_ps(0.9999));
    let start = Instant::now();
    for _ in 0..n {
        for a in acc.iter_mut() {
            *a = op(*a, c);
        }
    }
    let s = start.elapsed().as_secs_f64();
    black_box(acc);
    println!("  {what:<40} {:6.3} ns per op", s * 1e9 / (n * 8) as f64);
}
#[inline(always)]
unsafe fn o_fma(a: __m256, c: __m256) -> __m256 {
    _mm256_fmadd_ps(a, c, c)
}
#[inline(always)]
unsafe fn o_add(a: __m256, c: __m256) -> __m256 {
    _mm256_add_ps(a, c)
}
#[inline(always)]
unsafe fn o_max(a: __m256, c: __m256) -> __m256 {
    _mm256_max_ps(a, c)
}
#[inline(always)]
unsafe fn o_round(a: __m256, _c: __m256) -> __m256 {
    _mm256_round_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(a)
}

fn report(what: &str, seconds: f64, reps: usize) {
    println!(
        "  {what:<58} {:6.3} ns/logit  {:6.3} ms per 16 rows",
        seconds * 1e9 / (reps * ROWS * V) as f64,
        seconds * 1e3 / reps as f64
    );
}

/// Part 3: the sweep's loops over the 16 rows in turn (`mode`: which loop, which layout).
#[target_feature(enable = "avx2,fma")]
unsafe fn run(what: &str, rows: &mut [Vec<u16>], kept: &mut [f32], mode: u32) {
    let reps = 40;
    let mut total = 0.0;
    let start = Instant::now();
    for _ in 0..reps {
        for row in rows.iter_mut() {
            let row = black_box(row);
            match mode {
                0 => total += statistics::<false, true>(row, kept),
                1 => total += statistics::<true, true>(row, kept),
                2 => total += statistics::<false, false>(row, kept),
                3 => gradient::<false>(kept, row, 1e-30, 0.0),
                4 => gradient::<true>(kept, row, 1e-30, 0.0),
                5 => {
                    total += statistics::<false, true>(row, kept);
                    gradient::<false>(kept, row, 1e-30, 0.0)
                }
                6 => {
                    total += statistics::<true, true>(row, kept);
                    gradient::<true>(kept, row, 1e-30, 0.0)
                }
                _ => unreachable!(),
            }
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    black_box(total);
    report(what, seconds, reps);
}

fn main() {
    assert!(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"));
    // bf16 logits ~ N(0, 2) by a cheap generator; the gradient loop writes tiny values (kb 1e-30)
    // so that the logits stay about the same from rep to rep.
    let mut state = 0x1234_5678u64;
    let mut rows: Vec<Vec<u16>> = (0..ROWS)
        .map(|_| {
            (0..V)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let u = ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0;
                    (u.to_bits() >> 16) as u16
                })
                .collect()
        })
        .collect();
    let mut kept = vec![0f32; V];
    let l1: Vec<u16> = rows[0][..2048].to_vec();
    for round in 0..3 {
        println!("round {round}: throughput (8 independent chains) and the statistics arithmetic in L1");
        // SAFETY: AVX2 and FMA asserted above.
        unsafe {
            tp("vfmadd", o_fma);
            tp("vaddps", o_add);
            tp("vmaxps", o_max);
            tp("vroundps", o_round);
            arith("exp2 as now (`cpu::simd`)", &l1, exp2_8);
            arith("exp2 Estrin", &l1, exp2_estrin);
            arith("exp2 half Estrin", &l1, exp2_half);
            arith("exp2 without clamp", &l1, exp2_noclamp);
            arith("exp2 low clamp only", &l1, exp2_lowclamp);
            arith("exp2 nearest (magic add), low clamp", &l1, exp2_nearest);
            arith("exp2 degree 4", &l1, exp2_deg4);
        }
    }
    for round in 0..3 {
        println!("round {round}");
        for (what, mode) in [
            ("statistics, widened by vpmovzxwd, 2^t kept", 0),
            ("statistics, even / odd, 2^t kept", 1),
            ("statistics, widened by vpmovzxwd, nothing kept", 2),
            ("gradient, packus + permute", 3),
            ("gradient, even / odd (no pack)", 4),
            ("both, as now", 5),
            ("both, even / odd", 6),
        ] {
            // SAFETY: AVX2 and FMA asserted above.
            unsafe { run(what, &mut rows, &mut kept, mode) };
        }
    }
}

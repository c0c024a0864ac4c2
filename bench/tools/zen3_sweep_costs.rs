//! What the logits-level in-place sweep's two loops cost on an AVX2-only CPU (AMD Zen 3), piece by
//! piece: a replica of `cpu::row`'s base-2 statistics loop (widening, `t` FMA, AVX2's `exp2_8`, the
//! two sums, the kept `2^t` stored in f32) and its gradient loop (the kept values rescaled, rounded
//! to bf16 over the logits), over 16 rows of V=151936 bf16 logits in turn (from L3, as `flashgrpo
//! bench`'s in-cache run reads them), and alternatives. A standalone program, outside the workspace:
//!
//! ```sh
//! rustc --edition 2021 -O -C target-cpu=native bench/tools/zen3_sweep_costs.rs -o /tmp/zen3_sweep_costs
//! /tmp/zen3_sweep_costs
//! ```
use std::arch::x86_64::*;
use std::hint::black_box;
use std::time::Instant;

const V: usize = 151_936;
const ROWS: usize = 16;
const POLY: [f32; 6] = [1.867_132_4e-3, 9.017_025e-3, 5.579_991_6e-2, 2.401_644_4e-1, 6.931_513e-1, 1.0];

#[inline(always)]
unsafe fn exp2_8(t: __m256) -> __m256 {
    let t = _mm256_min_ps(_mm256_set1_ps(128.0), _mm256_max_ps(_mm256_set1_ps(-127.0), t));
    let floor = _mm256_round_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t);
    let f = _mm256_sub_ps(t, floor);
    let mut p = _mm256_set1_ps(POLY[0]);
    for &c in &POLY[1..] {
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
    }
    let biased = _mm256_castps_si256(_mm256_add_ps(floor, _mm256_set1_ps(8_388_735.0)));
    _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(biased)))
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

fn report(what: &str, seconds: f64, reps: usize) {
    println!(
        "  {what:<58} {:6.3} ns/logit  {:6.3} ms per 16 rows",
        seconds * 1e9 / (reps * ROWS * V) as f64,
        seconds * 1e3 / reps as f64
    );
}

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

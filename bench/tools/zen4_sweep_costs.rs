//! What the logits-level sweep's two loops cost on an AVX-512 CPU, piece by piece (issue 17,
//! item 3; docs/BENCHMARKS.md, "Where the in-place sweep's time goes"). A standalone program,
//! outside the workspace so that CI never builds it:
//!
//! ```sh
//! rustc --edition 2021 -O -C target-cpu=native bench/tools/zen4_sweep_costs.rs -o /tmp/zen4_sweep_costs
//! /tmp/zen4_sweep_costs
//! ```
//!
//! Six parts, each in ns (and cycles at an assumed clock, `GHZ`; this VM reports none):
//! 1. one 512-bit instruction's reciprocal throughput, on 8 independent chains (enough to cover
//!    every latency here, so that a figure is the issue rate, not a dependency);
//! 2. `2^t` of 16 bf16 logits as the statistics loop computes it (widening, `t` FMA, `exp2`, the
//!    two sums) and as alternatives would, with the logits in L1 and nothing stored;
//! 3. a replica of the in-place sweep over one row of V=151936 bf16 logits held in L2 (4.: over
//!    16 rows in turn, from L3, as `flashgrpo bench`'s in-cache run reads them): the
//!    statistics loop keeping `2^t` (f32, as `cpu::row` does, or f16), the gradient loop
//!    rescaling the kept values into bf16 over the logits, and both; with and without prefetches,
//!    and with the gradient loop rounding 32 values a conversion (`vcvtne2ps2bf16`);
//! 5. the same with the entropy's multiply-add moved from the statistics loop (bound by the FMA
//!    pipes) to the gradient loop, which reads the logits still in place for it;
//! 6. 32 logits widened at a time by one shift and one `and` (even and odd positions as two
//!    vectors, kept in that order), the gradient put back in order by one `vpermw`; or the kept
//!    values put back in order as they are stored (two `vpermt2ps`), the gradient loop unchanged.
//!
//! The polynomial is `math::EXP2_POLY_DEG5`'s (the costs, not the values, are the point).

use std::arch::x86_64::*;
use std::hint::black_box;
use std::time::Instant;

const GHZ: f64 = 3.66;
const V: usize = 151_936;
const POLY: [f32; 6] = [1.867_132_4e-3, 9.017_025e-3, 5.579_991_6e-2, 2.401_644_4e-1, 6.931_513e-1, 1.0];

fn report(what: &str, seconds: f64, units: f64) {
    let ns = seconds * 1e9 / units;
    println!("  {what:<44} {ns:6.3} ns  {:5.2} cycles", ns * GHZ);
}

/// Part 1: `op` applied to 8 independent chains, `n` times.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
unsafe fn throughput(what: &str, op: unsafe fn(__m512, __m512) -> __m512) {
    let n = 20_000_000usize;
    let mut acc = [_mm512_set1_ps(1.0001); 8];
    let c = black_box(_mm512_set1_ps(0.9999));
    let start = Instant::now();
    for _ in 0..n {
        for a in acc.iter_mut() {
            *a = op(*a, c);
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    black_box(acc);
    report(what, seconds, (n * 8) as f64);
}

#[inline(always)]
unsafe fn poly(f: __m512, degree: usize) -> __m512 {
    let mut p = _mm512_set1_ps(POLY[5 - degree]);
    for &c in &POLY[6 - degree..] {
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
    }
    p
}

/// `2^t` as `cpu::simd` computes it: `vreduceps` (floor), the polynomial, `vscalefps`.
#[inline(always)]
unsafe fn exp2_reduce(t: __m512) -> __m512 {
    let f = _mm512_reduce_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t);
    _mm512_scalef_ps(poly(f, 5), t)
}

#[inline(always)]
unsafe fn exp2_roundscale(t: __m512) -> __m512 {
    let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t);
    _mm512_scalef_ps(poly(_mm512_sub_ps(t, k), 5), k)
}

/// The power of two built in the exponent bits (a clamp, a conversion, an integer add and shift,
/// a multiply) instead of `vscalefps`.
#[inline(always)]
unsafe fn exp2_integer(t: __m512) -> __m512 {
    let t = _mm512_max_ps(t, _mm512_set1_ps(-126.0));
    let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t);
    let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)));
    _mm512_mul_ps(poly(_mm512_sub_ps(t, k), 5), _mm512_castsi512_ps(bits))
}

#[inline(always)]
unsafe fn exp2_degree4(t: __m512) -> __m512 {
    let f = _mm512_reduce_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t);
    _mm512_scalef_ps(poly(f, 4), t)
}

/// `2^k/32` for k < 32: the table of [`exp2_table32`] (two registers, one `vpermt2ps`).
const TABLE32: [f32; 32] = [
    1.0,
    1.0218971967697144,
    1.0442737340927124,
    1.0671404600143433,
    1.0905077457427979,
    1.114386796951294,
    1.1387885808944702,
    1.1637248992919922,
    1.1892070770263672,
    1.215247392654419,
    1.2418577671051025,
    1.2690509557724,
    1.2968395948410034,
    1.3252366781234741,
    1.3542555570602417,
    1.3839099407196045,
    1.4142135381698608,
    1.4451807737350464,
    1.4768261909484863,
    1.5091644525527954,
    1.5422108173370361,
    1.5759809017181396,
    1.610490322113037,
    1.6457555294036865,
    1.6817928552627563,
    1.7186193466186523,
    1.7562521696090698,
    1.7947090864181519,
    1.8340080976486206,
    1.8741676807403564,
    1.9152065515518188,
    1.9571441411972046,
];
/// `2^f` on `[0, 1/32)`, `1 + f (P2[1] + f P2[0])`, fitted for the least relative error (6.5e-8).
const P2: [f32; 2] = [0.242_652_5, 0.693_123_76];

/// Part 2's alternative with a table: `2^t = 2^floor(t) 2^(k/32) 2^f`, `k / 32 + f` the fraction
/// of `t` (`vreduceps` keeping 5 bits), `k` from the low bits of `t + 1.5 2^18` rounded down, the
/// table by one `vpermt2ps`, a degree-2 polynomial. Three multiply-adds where `exp2_reduce`
/// takes five, but a permute and an add more (worst relative error 1.8e-7; not made: no faster).
#[inline(always)]
unsafe fn exp2_table32(t: __m512) -> __m512 {
    let f = _mm512_reduce_ps::<{ (5 << 4) | _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t);
    let j = _mm512_add_round_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t, _mm512_set1_ps(786_432.0));
    from_table32(t, f, j)
}

/// [`exp2_table32`] without `vreduceps`: `f = t - (j - 1.5 2^18)`, two subtractions.
#[inline(always)]
unsafe fn exp2_table32_sub(t: __m512) -> __m512 {
    let magic = _mm512_set1_ps(786_432.0);
    let j = _mm512_add_round_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t, magic);
    from_table32(t, _mm512_sub_ps(t, _mm512_sub_ps(j, magic)), j)
}

/// `2^floor(t) 2^(k/32) (1 + f q(f))`, with `k` in the low 5 bits of `j`.
#[inline(always)]
unsafe fn from_table32(t: __m512, f: __m512, j: __m512) -> __m512 {
    let low = _mm512_loadu_ps(TABLE32.as_ptr());
    let high = _mm512_loadu_ps(TABLE32.as_ptr().add(16));
    let table = _mm512_permutex2var_ps(low, _mm512_castps_si512(j), high);
    let q = _mm512_fmadd_ps(_mm512_set1_ps(P2[0]), f, _mm512_set1_ps(P2[1]));
    _mm512_scalef_ps(_mm512_fmadd_ps(_mm512_mul_ps(table, f), q, table), t)
}

#[inline(always)]
unsafe fn widen(src: *const u16) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(src.cast()))))
}

/// Part 2: the statistics loop's arithmetic over `row` (in L1) `reps` times, nothing stored.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
unsafe fn statistics_arithmetic(what: &str, row: &[u16], exp2: unsafe fn(__m512) -> __m512) {
    let reps = 100_000usize;
    let (a, r) = (_mm512_set1_ps(0.144_269_5), _mm512_set1_ps(3.0));
    let (mut sv, mut dv) = ([_mm512_setzero_ps(); 2], [_mm512_setzero_ps(); 2]);
    let start = Instant::now();
    for _ in 0..reps {
        for j in (0..row.len()).step_by(32) {
            for h in 0..2 {
                let t = _mm512_fmsub_ps(widen(row.as_ptr().add(j + 16 * h)), a, r);
                let e = exp2(t);
                sv[h] = _mm512_add_ps(sv[h], e);
                dv[h] = _mm512_fmadd_ps(e, t, dv[h]);
            }
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    black_box((sv, dv));
    report(what, seconds, (reps * row.len() / 16) as f64);
}

/// Part 3's statistics loop, the kept values stored through a slice index checked in the loop
/// (as `cpu::row::tile_sums` stored them before 2026-11-27), in f32.
#[inline(always)]
unsafe fn statistics_checked(row: &[u16], kept: &mut [f32]) -> f32 {
    let (a, r) = (_mm512_set1_ps(0.144_269_5), _mm512_set1_ps(3.0));
    let (mut sv, mut dv) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    for (j, c) in row.chunks_exact(16).enumerate() {
        let t = _mm512_fmsub_ps(widen(c.as_ptr()), a, r);
        let e = exp2_reduce(t);
        _mm512_storeu_ps(kept[j * 16..][..16].as_mut_ptr(), e);
        sv = _mm512_add_ps(sv, e);
        dv = _mm512_fmadd_ps(e, t, dv);
    }
    _mm512_reduce_add_ps(sv) + _mm512_reduce_add_ps(dv)
}

#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
unsafe fn sweep_checked(what: &str, base: &[u16]) {
    let reps = 400usize;
    let row = base.to_vec();
    let mut kept = vec![0f32; V];
    let mut total = 0.0;
    let start = Instant::now();
    for _ in 0..reps {
        total += statistics_checked(black_box(&row), black_box(&mut kept));
    }
    let seconds = start.elapsed().as_secs_f64();
    black_box((total, &kept));
    report(what, seconds, (reps * V / 16) as f64);
}

/// Part 3's statistics loop: `2^t` kept in f32 (`HALF` false) or f16, the sums returned.
#[inline(always)]
unsafe fn statistics<const HALF: bool, const PREFETCH_KEPT: bool, const NO_ENTROPY: bool>(
    row: &[u16],
    kept: *mut u8,
) -> f32 {
    let (a, r) = (_mm512_set1_ps(0.144_269_5), _mm512_set1_ps(3.0));
    let (mut sv, mut dv) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let bytes = if HALF { 2 } else { 4 };
    for j in (0..V).step_by(16) {
        if PREFETCH_KEPT {
            _mm_prefetch::<_MM_HINT_ET0>(kept.wrapping_add((j + 256) * bytes).cast());
        }
        let t = _mm512_fmsub_ps(widen(row.as_ptr().add(j)), a, r);
        let e = exp2_reduce(t);
        if HALF {
            _mm256_storeu_si256(kept.add(j * 2).cast(), _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(e));
        } else {
            _mm512_storeu_ps(kept.add(j * 4).cast(), e);
        }
        sv = _mm512_add_ps(sv, e);
        if !NO_ENTROPY {
            dv = _mm512_fmadd_ps(e, t, dv);
        }
    }
    _mm512_reduce_add_ps(sv) + _mm512_reduce_add_ps(dv)
}

/// Part 3's gradient loop: the kept values times a scale, rounded to bf16 over the row.
#[inline(always)]
unsafe fn gradient<const HALF: bool, const PREFETCH_OUT: bool, const ENTROPY: bool>(
    kept: *const u8,
    out: &mut [u16],
    scale: f32,
) -> f32 {
    let scale = _mm512_set1_ps(scale);
    let mut dv = _mm512_setzero_ps();
    for j in (0..V).step_by(16) {
        if PREFETCH_OUT {
            _mm_prefetch::<_MM_HINT_ET0>(out.as_ptr().wrapping_add(j + 512).cast());
        }
        let k = if HALF {
            _mm512_cvtph_ps(_mm256_loadu_si256(kept.add(j * 2).cast()))
        } else {
            _mm512_loadu_ps(kept.add(j * 4).cast())
        };
        if ENTROPY {
            // The entropy's sum from the logits still in place, before they are overwritten.
            dv = _mm512_fmadd_ps(k, widen(out.as_ptr().add(j)), dv);
        }
        let g: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(_mm512_mul_ps(k, scale)));
        _mm256_storeu_si256(out.as_mut_ptr().add(j).cast(), g);
    }
    _mm512_reduce_add_ps(dv)
}

/// Part 3's gradient loop with 32 values a conversion: two rescaled vectors rounded by one
/// `vcvtne2ps2bf16` and stored as one 64-byte vector.
#[inline(always)]
unsafe fn gradient_pairs(kept: *const u8, out: &mut [u16], scale: f32) -> f32 {
    let scale = _mm512_set1_ps(scale);
    for j in (0..V).step_by(32) {
        let k0 = _mm512_loadu_ps(kept.add(j * 4).cast());
        let k1 = _mm512_loadu_ps(kept.add(j * 4 + 64).cast());
        let g: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(_mm512_mul_ps(k1, scale), _mm512_mul_ps(k0, scale)));
        _mm512_storeu_si512(out.as_mut_ptr().add(j).cast(), g);
    }
    0.0
}

/// Part 6: 32 bf16 logits widened as two vectors by one shift and one `and` of a 64-byte load (the
/// even positions' bits moved up, the odd ones' kept in place), where `widen` takes a
/// `vpmovzxwd` and a shift per 16; the kept values stored even block, odd block.
#[inline(always)]
unsafe fn statistics_split(row: &[u16], kept: *mut u8) -> f32 {
    let (a, r) = (_mm512_set1_ps(0.144_269_5), _mm512_set1_ps(3.0));
    let high = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    let (mut sv, mut dv) = ([_mm512_setzero_ps(); 2], [_mm512_setzero_ps(); 2]);
    for j in (0..V).step_by(32) {
        let x = _mm512_loadu_si512(row.as_ptr().add(j).cast());
        let halves = [_mm512_castsi512_ps(_mm512_slli_epi32::<16>(x)), _mm512_castsi512_ps(_mm512_and_si512(x, high))];
        for (h, w) in halves.into_iter().enumerate() {
            let t = _mm512_fmsub_ps(w, a, r);
            let e = exp2_reduce(t);
            _mm512_storeu_ps(kept.add(j * 4 + 64 * h).cast(), e);
            sv[h] = _mm512_add_ps(sv[h], e);
            dv[h] = _mm512_fmadd_ps(e, t, dv[h]);
        }
    }
    _mm512_reduce_add_ps(_mm512_add_ps(sv[0], sv[1])) + _mm512_reduce_add_ps(_mm512_add_ps(dv[0], dv[1]))
}

/// Part 6's statistics loop with the kept values put back in order as they are stored (two
/// `vpermt2ps`), so that the gradient loop and every other reader of the kept row stay as they are.
#[inline(always)]
unsafe fn statistics_split_in_order(row: &[u16], kept: *mut u8) -> f32 {
    let (a, r) = (_mm512_set1_ps(0.144_269_5), _mm512_set1_ps(3.0));
    let high = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    let lo: [i32; 16] = std::array::from_fn(|i| ((i % 2) * 16 + i / 2) as i32);
    let hi: [i32; 16] = std::array::from_fn(|i| ((i % 2) * 16 + 8 + i / 2) as i32);
    let (lo, hi) = (_mm512_loadu_si512(lo.as_ptr().cast()), _mm512_loadu_si512(hi.as_ptr().cast()));
    let (mut sv, mut dv) = ([_mm512_setzero_ps(); 2], [_mm512_setzero_ps(); 2]);
    for j in (0..V).step_by(32) {
        let x = _mm512_loadu_si512(row.as_ptr().add(j).cast());
        let halves = [_mm512_castsi512_ps(_mm512_slli_epi32::<16>(x)), _mm512_castsi512_ps(_mm512_and_si512(x, high))];
        let mut e = [_mm512_setzero_ps(); 2];
        for (h, w) in halves.into_iter().enumerate() {
            let t = _mm512_fmsub_ps(w, a, r);
            e[h] = exp2_reduce(t);
            sv[h] = _mm512_add_ps(sv[h], e[h]);
            dv[h] = _mm512_fmadd_ps(e[h], t, dv[h]);
        }
        _mm512_storeu_ps(kept.add(j * 4).cast(), _mm512_permutex2var_ps(e[0], lo, e[1]));
        _mm512_storeu_ps(kept.add(j * 4 + 64).cast(), _mm512_permutex2var_ps(e[0], hi, e[1]));
    }
    _mm512_reduce_add_ps(_mm512_add_ps(sv[0], sv[1])) + _mm512_reduce_add_ps(_mm512_add_ps(dv[0], dv[1]))
}

/// Part 6's gradient loop: the even and odd blocks rescaled, rounded by one `vcvtne2ps2bf16`
/// (even positions in the low 16 words, odd in the high) and put back in order by one `vpermw`.
#[inline(always)]
unsafe fn gradient_split(kept: *const u8, out: &mut [u16], scale: f32) -> f32 {
    let scale = _mm512_set1_ps(scale);
    let order: [i16; 32] = std::array::from_fn(|i| ((i % 2) * 16 + i / 2) as i16);
    let order = _mm512_loadu_si512(order.as_ptr().cast());
    for j in (0..V).step_by(32) {
        let even = _mm512_loadu_ps(kept.add(j * 4).cast());
        let odd = _mm512_loadu_ps(kept.add(j * 4 + 64).cast());
        let g: __m512i =
            std::mem::transmute(_mm512_cvtne2ps_pbh(_mm512_mul_ps(odd, scale), _mm512_mul_ps(even, scale)));
        _mm512_storeu_si512(out.as_mut_ptr().add(j).cast(), _mm512_permutexvar_epi16(order, g));
    }
    0.0
}

/// Checks part 6's order: the split sweep's gradient equals the plain one's, bit for bit.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
unsafe fn split_matches(base: &[u16]) -> bool {
    let (mut plain, mut split) = (base.to_vec(), base.to_vec());
    let mut kept = vec![0u8; V * 4];
    let s1 = statistics::<false, false, false>(&plain, kept.as_mut_ptr());
    gradient::<false, false, false>(kept.as_ptr(), &mut plain, 0.5);
    let s2 = statistics_split(&split, kept.as_mut_ptr());
    gradient_split(kept.as_ptr(), &mut split, 0.5);
    let mut in_order = base.to_vec();
    let s3 = statistics_split_in_order(&in_order, kept.as_mut_ptr());
    gradient::<false, false, false>(kept.as_ptr(), &mut in_order, 0.5);
    (s1 - s2).abs() <= 1e-3 * s1.abs() && (s1 - s3).abs() <= 1e-3 * s1.abs() && plain == split && plain == in_order
}

/// [`sweep`]'s ways: 16 logits at a time; the gradient rounding 32 a conversion; 32 logits as
/// even / odd positions (part 6), kept in that layout or put back in order as stored.
const SIXTEEN: u8 = 0;
const PAIRS: u8 = 1;
const SPLIT: u8 = 2;
const SPLIT_IN_ORDER: u8 = 3;

/// Parts 3 to 6: the statistics and / or gradient loops of `WAY` over `rows` rows in turn.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
unsafe fn sweep<
    const HALF: bool,
    const STATS: bool,
    const GRAD: bool,
    const PREFETCH: bool,
    const MOVED: bool,
    const WAY: u8,
>(
    what: &str,
    base: &[u16],
    rows: usize,
) {
    let reps = 400 / rows;
    let mut all: Vec<Vec<u16>> = vec![base.to_vec(); rows];
    let mut kept = vec![0u8; V * 4];
    let mut total = 0.0;
    let start = Instant::now();
    for _ in 0..reps {
        for row in all.iter_mut() {
            let (row, kept) = (black_box(&mut *row), black_box(&mut kept));
            if STATS {
                total += match WAY {
                    SPLIT => statistics_split(row, kept.as_mut_ptr()),
                    SPLIT_IN_ORDER => statistics_split_in_order(row, kept.as_mut_ptr()),
                    _ => statistics::<HALF, PREFETCH, MOVED>(row, kept.as_mut_ptr()),
                };
            }
            if GRAD {
                // A scale so small that the logits stay finite from one repetition to the next.
                total += match WAY {
                    PAIRS => gradient_pairs(kept.as_ptr(), row, 1e-30),
                    SPLIT => gradient_split(kept.as_ptr(), row, 1e-30),
                    _ => gradient::<HALF, PREFETCH, MOVED>(kept.as_ptr(), row, 1e-30),
                };
            }
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    black_box((total, &all, &kept));
    report(what, seconds, (reps * rows * V / 16) as f64);
}

fn main() {
    assert!(
        is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16"),
        "needs AVX-512 and AVX512-BF16"
    );
    let logits: Vec<u16> =
        (0..V).map(|i| ((((i * 7919) % 1000) as f32 / 100.0 - 5.0).to_bits() >> 16) as u16).collect();
    // SAFETY: the features were checked above.
    unsafe {
        println!("1. one 512-bit instruction, reciprocal throughput (8 independent chains)");
        throughput("vfmadd231ps", |x, c| _mm512_fmadd_ps(x, c, c));
        throughput("vaddps", |x, c| _mm512_add_ps(x, c));
        throughput("vfmadd231ps + vaddps", |x, c| _mm512_add_ps(_mm512_fmadd_ps(x, c, c), c));
        throughput("vfmadd231ps + vfmadd231ps", |x, c| _mm512_fmadd_ps(_mm512_fmadd_ps(x, c, c), c, c));
        throughput("vreduceps", |x, _| _mm512_reduce_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(x));
        throughput("vfmadd231ps + vreduceps", |x, c| {
            _mm512_reduce_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(_mm512_fmadd_ps(x, c, c))
        });
        throughput("vscalefps", |x, c| _mm512_scalef_ps(x, c));
        throughput("vfmadd231ps + vscalefps", |x, c| _mm512_scalef_ps(_mm512_fmadd_ps(x, c, c), c));
        throughput("vrndscaleps", |x, _| _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(x));
        throughput("vcvtneps2bf16 (the gradient's rounding)", |x, _| {
            _mm512_castsi512_ps(_mm512_castsi256_si512(std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(x))))
        });
        throughput("vcvtne2ps2bf16 (32 values)", |x, c| {
            _mm512_castsi512_ps(std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(x, c)))
        });
        throughput("vpermw (one source)", |x, c| {
            _mm512_castsi512_ps(_mm512_permutexvar_epi16(_mm512_castps_si512(c), _mm512_castps_si512(x)))
        });
        throughput("vpermt2w (two sources)", |x, c| {
            _mm512_castsi512_ps(_mm512_permutex2var_epi16(
                _mm512_castps_si512(x),
                _mm512_castps_si512(c),
                _mm512_castps_si512(x),
            ))
        });
        throughput("vpermt2ps", |x, c| _mm512_permutex2var_ps(x, _mm512_castps_si512(c), x));
        throughput("vfmadd231ps + vpermt2ps", |x, c| {
            _mm512_permutex2var_ps(_mm512_fmadd_ps(x, c, c), _mm512_castps_si512(c), c)
        });
        throughput("vaddps + vscalefps", |x, c| _mm512_scalef_ps(_mm512_add_ps(x, c), c));
        throughput("vreduceps + vscalefps", |x, c| {
            _mm512_scalef_ps(_mm512_reduce_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(x), c)
        });
        throughput("vcvtps2ph + vcvtph2ps", |x, _| _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x)));

        println!("2. the statistics loop's arithmetic per 16 bf16 logits (logits in L1, nothing stored)");
        let in_l1 = &logits[..4096];
        statistics_arithmetic("exp2 as cpu::simd (vreduceps, degree 5)", in_l1, exp2_reduce);
        statistics_arithmetic("vrndscaleps and a subtraction", in_l1, exp2_roundscale);
        statistics_arithmetic("integer exponent instead of vscalefps", in_l1, exp2_integer);
        statistics_arithmetic("degree-4 polynomial (2.6e-6 relative)", in_l1, exp2_degree4);
        statistics_arithmetic("32-entry table, degree 2 (vpermt2ps)", in_l1, exp2_table32);
        statistics_arithmetic("32-entry table, degree 2, no vreduceps", in_l1, exp2_table32_sub);
        statistics_arithmetic("no exp2 (widening, t, the two sums)", in_l1, |t| t);

        println!("3. the in-place sweep per 16 logits, one row of V=151936 in L2");
        sweep::<false, true, false, false, false, SIXTEEN>("statistics loop, kept f32", &logits, 1);
        sweep_checked("statistics loop, kept f32 by a checked index", &logits);
        sweep::<false, false, true, false, false, SIXTEEN>("gradient loop, kept f32", &logits, 1);
        sweep::<false, true, true, false, false, SIXTEEN>("both, kept f32 (as cpu::row)", &logits, 1);
        sweep::<false, true, true, true, false, SIXTEEN>("both, kept f32, prefetchw ahead", &logits, 1);
        sweep::<false, false, true, false, false, PAIRS>("gradient loop, 32 a conversion (vcvtne2ps2bf16)", &logits, 1);
        sweep::<false, true, true, false, false, PAIRS>("both, 32 a conversion", &logits, 1);
        sweep::<true, true, false, false, false, SIXTEEN>("statistics loop, kept f16", &logits, 1);
        sweep::<true, false, true, false, false, SIXTEEN>("gradient loop, kept f16", &logits, 1);
        sweep::<true, true, true, false, false, SIXTEEN>("both, kept f16", &logits, 1);
        println!("4. the same over 16 rows in turn (4.6 MiB of logits, from L3, as the bench's in-cache run)");
        sweep::<false, true, true, false, false, SIXTEEN>("both, kept f32 (as cpu::row)", &logits, 16);
        sweep::<true, true, true, false, false, SIXTEEN>("both, kept f16", &logits, 16);
        println!(
            "5. the entropy's multiply-add moved from the statistics loop to the gradient loop (logits read in place)"
        );
        sweep::<false, true, false, false, true, SIXTEEN>("statistics loop without it", &logits, 1);
        sweep::<false, false, true, false, true, SIXTEEN>("gradient loop with it", &logits, 1);
        sweep::<false, true, true, false, true, SIXTEEN>("both, moved", &logits, 1);
        sweep::<false, true, true, false, true, SIXTEEN>("both, moved, 16 rows in turn", &logits, 16);
        println!("6. 32 logits widened by one shift and one and (even / odd blocks), put back in order by vpermw");
        println!("  the same gradient bits as part 3: {}", split_matches(&logits));
        sweep::<false, true, false, false, false, SIXTEEN>("statistics loop, kept f32 (as part 3)", &logits, 1);
        sweep::<false, true, false, false, false, SPLIT>("statistics loop, split", &logits, 1);
        sweep::<false, true, false, false, false, SPLIT_IN_ORDER>("statistics loop, split, kept in order", &logits, 1);
        sweep::<false, false, true, false, false, SIXTEEN>("gradient loop (as part 3)", &logits, 1);
        sweep::<false, false, true, false, false, SPLIT>("gradient loop, split", &logits, 1);
        sweep::<false, true, true, false, false, SIXTEEN>("both (as part 3)", &logits, 1);
        sweep::<false, true, true, false, false, SPLIT>("both, split", &logits, 1);
        sweep::<false, true, true, false, false, SPLIT_IN_ORDER>("both, split, kept in order", &logits, 1);
        sweep::<false, true, true, false, false, SIXTEEN>("both, 16 rows (as part 4)", &logits, 16);
        sweep::<false, true, true, false, false, SPLIT>("both, split, 16 rows", &logits, 16);
        sweep::<false, true, true, false, false, SPLIT_IN_ORDER>("both, split, kept in order, 16 rows", &logits, 16);
    }
}

//! Every [`Simd`] implementation against f64 and against each other (the AVX2 kernels bit for bit
//! against the portable ones with FMA).

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

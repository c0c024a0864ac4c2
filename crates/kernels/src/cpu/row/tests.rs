//! The statistics pass against f64 on every instruction set: [`statistics`] reports the row's
//! maximum (as [`PartialRowStats`] defines it), whichever path (base 2 or exact) each tile
//! took, and its statistics without the maximum (a whole row's) and [`sweep`]'s give the same
//! `lse`, entropy and `log p`.
use super::super::isa::{with_f32_streams, with_isa, Isa};
use super::super::{GradientTarget, Kernels, RowMax};
use crate::element::{DType, Element};
use crate::objective::RowGradient;
use crate::stats::PartialRowStats;
use crate::synthetic::normal_matrix;

/// Rows that send tiles down each path: plain, a later tile far above the first (exact path,
/// new reference), a later tile a little above (base 2, reference kept below the maximum),
/// masks near `f32::MIN` (`t` overflows; bf16 holds them), logits too large for a base-2
/// reference, a tail shorter than a vector.
fn rows() -> Vec<(&'static str, Vec<f32>)> {
    let plain = normal_matrix(1, 10_007, 2.0, 11);
    let mut spiky = plain.clone();
    spiky[7000] = 60.0;
    let mut above = plain.clone();
    for x in &mut above[4100..4200] {
        *x += 5.0;
    }
    let mut masked = plain.clone();
    for x in masked.iter_mut().skip(3000).step_by(3) {
        *x = -3.0e38;
    }
    let mut huge = plain.clone();
    huge[10] = 5.0e9;
    vec![
        ("plain", plain),
        ("spiky", spiky),
        ("above", above),
        ("masked", masked),
        // Finite masks far beyond 2^24 / log2(e): the base-2 reference would be off by more
        // than its own rounding (every 2^t of the tile below the subnormals).
        ("all -1e15", vec![-1.0e15; 5000]),
        ("all -1e36", vec![-1.0e36; 5000]),
        ("huge first", huge),
        ("short", vec![0.5, -3.0, 9.0]),
    ]
}

/// The statistics of `u = x * inv_t` in f32, summed in f64; the target's `u` the exact product.
fn reference(row: &[f32], inv_t: f32, target: usize) -> PartialRowStats {
    let u: Vec<f32> = row.iter().map(|&x| x * inv_t).collect();
    let m = u.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e = |x: f32| (x as f64 - m as f64).exp();
    PartialRowStats {
        max: m,
        sum_exp: u.iter().map(|&x| e(x)).sum::<f64>() as f32,
        sum_exp_shifted: u.iter().map(|&x| e(x) * (x as f64 - m as f64)).sum::<f64>() as f32,
        sum_u: u.iter().map(|&x| x as f64).sum::<f64>() as f32,
        // The exact product, or beyond what a base-2 reference carries (and in a row shorter
        // than a vector, `check`) its f32 rounding, as the kernels take it.
        target_u: Some(if (row[target] * inv_t).abs() < 1.0e7 {
            row[target] as f64 * inv_t as f64
        } else {
            (row[target] * inv_t) as f64
        }),
        argmax: None,
    }
}

fn check(what: &str, got: PartialRowStats, want: &PartialRowStats) {
    assert_eq!(got.max, want.max, "{what}: max");
    // The exact product, or (a row shorter than a vector) its f32 rounding.
    let (g, w) = (got.target_u.expect("a target"), want.target_u.expect("a target"));
    assert!((g - w).abs() <= w.abs() * f32::EPSILON as f64 / 2.0, "{what}: target {g} vs {w}");
    let close = |a: f32, b: f32, tol: f64| (a as f64 - b as f64).abs() <= tol * b.abs().max(1.0) as f64;
    assert!(close(got.sum_exp, want.sum_exp, 2e-6), "{what}: sum_exp {} vs {}", got.sum_exp, want.sum_exp);
    // `e` in the units of the entropy it gives, `H = ln s - e / s`, against LOSSES.md's 1e-5
    // (the "above" row, values well above the first tile's maximum, is the worst: ~6e-6).
    let (de, s) = ((got.sum_exp_shifted as f64 - want.sum_exp_shifted as f64).abs(), want.sum_exp as f64);
    assert!(de / s <= 1e-5, "{what}: sum_exp_shifted {} vs {}", got.sum_exp_shifted, want.sum_exp_shifted);
    if !want.sum_u.is_finite() {
        return;
    }
    assert!(close(got.sum_u, want.sum_u, 1e-5), "{what}: sum_u {} vs {}", got.sum_u, want.sum_u);
}

fn every_row<T: Element>(isa: Isa) {
    for (name, row) in rows() {
        let row: Vec<T> = row.iter().map(|&x| T::from_f32(x)).collect();
        let widened: Vec<f32> = row.iter().map(|x| x.to_f32()).collect();
        for inv_t in [1.0f32, 1.0 / 0.7] {
            if name == "masked" && inv_t != 1.0 {
                continue; // the masks' u overflows to -inf: a non-finite row
            }
            let target = widened.len() / 2;
            let want = reference(&widened, inv_t, target);
            let what = format!("{isa:?} {name} {} inv_t {inv_t}", std::any::type_name::<T>());
            let k = with_isa(isa, Kernels::<T>::select);
            check(&what, k.statistics(&row, inv_t, Some(target), true, RowMax::Reported), &want);
            // Without the maximum (a whole row's statistics): what `finish` makes of them.
            let loose = k.statistics(&row, inv_t, Some(target), true, RowMax::Unneeded);
            let t = 1.0 / inv_t as f64;
            let (got, want_whole) = (loose.finish(row.len(), t), want.finish(row.len(), t));
            assert!((got.lse - want_whole.lse).abs() <= 1e-6 * want_whole.lse.abs().max(1.0), "{what} (no max): lse");
            assert!((got.entropy - want_whole.entropy).abs() <= 1e-5, "{what} (no max): entropy");
            let mut swept = None;
            let mut out = row.clone();
            k.sweep(GradientTarget::InPlace(&mut out), inv_t, Some(target), true, false, &mut |s, _| {
                swept = Some(s);
                Some(RowGradient::ZERO)
            });
            // The sweep's sums may be relative to a reference below the maximum: what
            // `finish` makes of them is what must agree.
            let (got, want) = (swept.expect("finish called").finish(row.len(), t), want.finish(row.len(), t));
            assert!((got.lse - want.lse).abs() <= 1e-6 * want.lse.abs().max(1.0), "{what} (sweep): lse");
            assert!((got.entropy - want.entropy).abs() <= 1e-5, "{what} (sweep): entropy");
            let (got_logp, want_logp) = (got.logp.expect("a target"), want.logp.expect("a target"));
            assert!((got_logp - want_logp).abs() <= 1e-6 * want_logp.abs().max(1.0), "{what} (sweep): logp");
        }
    }
}

/// [`super::gradient`] (`p` recomputed) against f64 on every instruction set: rows whose
/// length is and is not a multiple of 16, the target in the head, the vectors, the tail or
/// absent, with and without temperature and the `c log p` term, in place and into another
/// buffer (the same bits); with `large`, into a buffer at every offset of a line (streamed
/// where `T` streams: the same bits, nothing outside the row) and in place; outputs in f32's
/// subnormal range (which AVX512-BF16's conversion flushes) and a zero gradient.
fn recomputed_gradient<T: Element>(isa: Isa) {
    // f32 to its accuracy; 16-bit outputs to their rounding (half an ulp: 2^-9, 2^-11) and a
    // margin for `p`'s own error (base 2 on AVX-512 and AVX2).
    let tolerance = match T::DTYPE {
        DType::F32 => 4e-6,
        DType::BF16 => 4.5e-3,
        DType::F16 => 1e-3,
    };
    let k = with_isa(isa, Kernels::<T>::select);
    for len in [1000, 100, 37, 5] {
        let row: Vec<T> = normal_matrix(1, len, 2.0, len as u64).iter().map(|&x| T::from_f32(x)).collect();
        for (inv_t, c, target) in [
            (1.0f32, 0.0f32, Some(len / 2)),
            (1.0 / 0.7, -0.3, Some(len - 1)),
            (1.0, 0.2, None),
            (1.0, 0.0, Some(3.min(len - 1))),
        ] {
            let u: Vec<f64> = row.iter().map(|x| (x.to_f32() * inv_t) as f64).collect();
            let lse = u.iter().map(|&x| x.exp()).sum::<f64>().ln() as f32;
            let tiny = |b: f32| RowGradient { lse, a: 0.0, b, c, d: 0.0 };
            for g in [RowGradient { lse, a: -0.8, b: 0.6, c, d: 0.01 }, tiny(1e-38), tiny(-1e-38), RowGradient::ZERO] {
                let what = format!("{isa:?} {} len {len} inv_t {inv_t} c {c} {g:?}", std::any::type_name::<T>());
                let into = gradients_agree(k, &row, &g, inv_t, target, &what);
                for (j, (&x, got)) in u.iter().zip(&into).enumerate() {
                    let log_p = x - g.lse as f64;
                    let p = if g.is_zero() { 0.0 } else { log_p.exp() };
                    let want = p * (g.b as f64 + g.c as f64 * log_p)
                        + g.d as f64
                        + if target == Some(j) { g.a as f64 } else { 0.0 };
                    let err = (got.to_f32() as f64 - want).abs();
                    assert!(
                        err <= tolerance * want.abs().max(0.01),
                        "{what}: element {j}: {} against {want}",
                        got.to_f32()
                    );
                }
            }
        }
    }
}

/// The gradient of `row` into another buffer, after checking that in place, and with `large`
/// into a buffer at every offset of a line and in place, give the same bits (and nothing is
/// written outside the row).
fn gradients_agree<T: Element>(
    k: Kernels<T>,
    row: &[T],
    g: &RowGradient,
    inv_t: f32,
    target: Option<usize>,
    what: &str,
) -> Vec<T> {
    let len = row.len();
    let bits = |x: &[T]| x.iter().map(|v| v.to_f32().to_bits()).collect::<Vec<_>>();
    let mut into = vec![T::from_f32(0.0); len];
    k.gradient(GradientTarget::Into { logits: row, out: &mut into }, g, inv_t, target, false);
    for large in [false, true] {
        let mut in_place = row.to_vec();
        k.gradient(GradientTarget::InPlace(&mut in_place), g, inv_t, target, large);
        assert_eq!(bits(&into), bits(&in_place), "{what} large {large}: in place and into another buffer");
    }
    for offset in 0..64 / std::mem::size_of::<T>() {
        let mut buffer = vec![T::from_f32(f32::NAN); len + 64];
        let out = &mut buffer[offset..offset + len];
        k.gradient(GradientTarget::Into { logits: row, out }, g, inv_t, target, true);
        assert_eq!(bits(&into), bits(&buffer[offset..offset + len]), "{what} offset {offset}: streamed and plain");
        let mut outside = buffer[..offset].iter().chain(&buffer[offset + len..]);
        assert!(outside.all(|x| x.to_f32().is_nan()), "{what} offset {offset}: a store outside the row");
    }
    into
}

/// `check` with f32 written by plain stores and by streaming ones, whatever the CPU's vendor
/// (`isa::streams_f32`).
fn f32_plain_and_streamed(check: impl Fn()) {
    for streams in [false, true] {
        with_f32_streams(streams, &check);
    }
}

#[test]
fn recomputed_gradient_matches_f64_on_every_instruction_set() {
    for isa in Isa::available() {
        f32_plain_and_streamed(|| recomputed_gradient::<f32>(isa));
        recomputed_gradient::<half::bf16>(isa);
        recomputed_gradient::<half::f16>(isa);
    }
}

/// [`super::sweep`] into another buffer with streaming stores writes the same bits as with
/// plain ones, wherever the output starts (every offset of a 64-byte line), on rows shorter
/// than a line, of a few tiles with a ragged tail, with the target in a tile's head, body and
/// tail, with and without the `c log p` term, for a zero gradient and for subnormal outputs;
/// and the values against f64 (`p (b + c log p) + d + a [j = y]` from the same `lse`), on
/// lengths around the 32-value pairs of [`super::tile_sums`] (their kept layout, the target
/// in a pair's even or odd position or after the pairs).
fn streamed_sweep<T: Element>(isa: Isa) {
    let k = with_isa(isa, Kernels::<T>::select);
    let tile = super::TILE;
    for len in [7, 32, 40, 63, 2 * tile + 77, tile + 48] {
        let row: Vec<T> = normal_matrix(1, len, 2.0, len as u64).iter().map(|&x| T::from_f32(x)).collect();
        // Without `c log p` the target's fix-up reads its kept value through `kept_index`:
        // targets at even (2, len / 2 for the longer rows) and odd (3, len / 2 + 1) positions.
        let cases = [
            (0.0f32, Some(3)),
            (0.0, Some(len - 1)),
            (-0.3, Some(len / 2)),
            (0.0, None),
            (0.0, Some(len / 2 + 1)),
            (0.0, Some(len / 2)),
            (0.0, Some(2)),
        ];
        for (c, target) in cases {
            // The last: outputs in f32's subnormal range, which AVX512-BF16's vector
            // conversion flushes to zero (and so must the scalar heads and tails).
            let tiny = |b: f32| RowGradient { lse: 0.0, a: 0.0, b, c, d: 0.0 };
            let normal = RowGradient { lse: 0.0, a: -0.8, b: 0.6, c, d: 0.01 };
            for g in [normal, RowGradient::ZERO, tiny(1e-38), tiny(-1e-38)] {
                let lse_used = std::cell::Cell::new(0.0f32);
                let swept = |stream: bool, offset: usize| {
                    let mut buffer = vec![T::from_f32(f32::NAN); len + 64];
                    let out = &mut buffer[offset..offset + len];
                    let mut finish = |stats: PartialRowStats, _: &[_]| {
                        let lse = stats.finish(len, 1.0).lse as f32;
                        lse_used.set(lse);
                        Some(if g.is_zero() { g } else { RowGradient { lse, ..g } })
                    };
                    let into = GradientTarget::Into { logits: &row, out };
                    assert!(k.sweep(into, 1.0, target, false, stream, &mut finish));
                    let outside = buffer[..offset].iter().chain(&buffer[offset + len..]);
                    assert!(outside.clone().all(|x| x.to_f32().is_nan()), "a store outside the row");
                    buffer[offset..offset + len].to_vec()
                };
                let plain = swept(false, 0);
                assert!(plain.iter().all(|x| x.to_f32().is_finite()), "every element written");
                if g.b == normal.b {
                    let lse = lse_used.get() as f64;
                    for (j, (x, got)) in row.iter().zip(&plain).enumerate() {
                        let log_p = x.to_f32() as f64 - lse;
                        let hit = if target == Some(j) { g.a as f64 } else { 0.0 };
                        let want = log_p.exp() * (g.b as f64 + g.c as f64 * log_p) + g.d as f64 + hit;
                        let err = (got.to_f32() as f64 - want).abs();
                        // The output's rounding (bf16's half an ulp: 2^-9) and f32's.
                        assert!(
                            err <= want.abs() / 256.0 + 1e-7,
                            "{isa:?} {} len {len} c {c} target {target:?}: element {j} {} against f64 {want}",
                            std::any::type_name::<T>(),
                            got.to_f32()
                        );
                    }
                }
                for offset in 0..64 / std::mem::size_of::<T>() {
                    let what = format!(
                        "{isa:?} {} len {len} c {c} target {target:?} offset {offset}",
                        std::any::type_name::<T>()
                    );
                    let streamed = swept(true, offset);
                    let same = plain.iter().zip(&streamed).all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits());
                    assert!(same, "{what}: streamed and plain stores differ");
                }
            }
        }
    }
}

/// A masked row's gradient ([`super::zero_row`]): positive zeros over the whole row and
/// nothing outside it, streamed or not, wherever the row starts and however long it is.
fn zero_rows<T: Element>(isa: Isa) {
    let k = with_isa(isa, Kernels::<T>::select);
    for len in [0, 1, 7, 16, 31, 40, 100, super::TILE + 77] {
        for offset in 0..64 / std::mem::size_of::<T>() {
            for stream in [false, true] {
                let mut buffer = vec![T::from_f32(f32::NAN); len + 64];
                k.zero_row(&mut buffer[offset..offset + len], stream);
                let what = format!("{isa:?} {} len {len} offset {offset}", std::any::type_name::<T>());
                let (row, outside) =
                    (&buffer[offset..offset + len], buffer[..offset].iter().chain(&buffer[offset + len..]));
                assert!(row.iter().all(|x| x.to_f32().to_bits() == 0), "{what}: not +0 in the row");
                assert!(outside.clone().all(|x| x.to_f32().is_nan()), "{what}: a store outside the row");
            }
        }
    }
}

#[test]
fn masked_rows_are_zeros_on_every_instruction_set() {
    for isa in Isa::available() {
        f32_plain_and_streamed(|| zero_rows::<f32>(isa));
        zero_rows::<half::bf16>(isa);
        zero_rows::<half::f16>(isa);
    }
}

#[test]
fn streamed_sweep_writes_the_same_bits_on_every_instruction_set() {
    for isa in Isa::available() {
        f32_plain_and_streamed(|| streamed_sweep::<f32>(isa));
        streamed_sweep::<half::bf16>(isa);
        streamed_sweep::<half::f16>(isa);
    }
}

/// `log p` of rows of large logits (~20, where half an ulp of `u` is ~1e-6) at temperatures
/// whose f32 inverse is inexact, against f64 at `1 / T`: the base-2 pass's sums are of exact
/// products and `finish` moves them to `1 / T` ([`PartialRowStats::finish`]). The portable
/// kernels (natural units, the f32 `u`) are held to f32's rounding of `u` instead.
fn logp_at_the_exact_temperature<T: Element>(isa: Isa) {
    let k = with_isa(isa, Kernels::<T>::select);
    for len in [33, 4097, 10_007] {
        let row: Vec<T> = normal_matrix(1, len, 2.0, 5).iter().map(|&x| T::from_f32(20.0 + x)).collect();
        let x: Vec<f64> = row.iter().map(|v| v.to_f32() as f64).collect();
        for temperature in [0.7, 0.31, 1.3, 0.9] {
            let u: Vec<f64> = x.iter().map(|&v| v / temperature).collect();
            let m = u.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + u.iter().map(|&v| (v - m).exp()).sum::<f64>().ln();
            let inv_t = crate::stats::inverse_temperature(temperature);
            for y in [0, len / 3, len - 1] {
                let stats = k.statistics(&row, inv_t, Some(y), false, RowMax::Unneeded);
                let (got, want) = (stats.finish(len, temperature).logp.expect("a target"), u[y] - lse);
                let tolerance = if isa == Isa::Generic { f32::EPSILON as f64 * m } else { 4e-7 };
                assert!(
                    (got - want).abs() <= tolerance,
                    "{isa:?} {} len {len} T {temperature} y {y}: {got} vs {want}",
                    std::any::type_name::<T>()
                );
            }
        }
    }
}

#[test]
fn logp_is_that_of_the_exact_temperature_on_every_instruction_set() {
    for isa in Isa::available() {
        logp_at_the_exact_temperature::<f32>(isa);
        logp_at_the_exact_temperature::<half::bf16>(isa);
    }
}

#[test]
fn statistics_report_the_rows_maximum_on_every_instruction_set() {
    for isa in Isa::available() {
        every_row::<f32>(isa);
        every_row::<half::bf16>(isa);
    }
}

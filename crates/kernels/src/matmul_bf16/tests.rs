//! The packed products (every way this machine has: AMX, AVX512-BF16, split and rounded) against
//! f64 loops on ragged shapes (no dimension a multiple of the 32-wide blocking), with strided and
//! accumulated outputs, and bit for bit across thread counts. On a machine with neither kernel
//! these tests check nothing and say so.

use super::{gradients as gradients_into, *};
use crate::synthetic::normal_matrix;

fn bits(x: &[f32]) -> Vec<u16> {
    x.iter().map(|&v| <half::bf16 as crate::Element>::from_f32(v).to_bits()).collect()
}

fn widen_f32(x: &[u16]) -> Vec<f32> {
    x.iter().map(|&b| f32::from_bits((b as u32) << 16)).collect()
}

fn widen(x: &[u16]) -> Vec<f64> {
    x.iter().map(|&b| f32::from_bits((b as u32) << 16) as f64).collect()
}

/// `|got - want| <= tol * sum |terms| + 1e-30` for every element.
fn assert_close(got: &[f32], want: &[f64], scale: &[f64], tol: f64, what: &str) {
    for (i, ((g, w), s)) in got.iter().zip(want).zip(scale).enumerate() {
        assert!((*g as f64 - w).abs() <= tol * s + 1e-30, "{what}: element {i}: {g} vs {w} (scale {s})");
    }
}

/// The last is larger than a macro block of the products in every dimension (`super::MACRO`,
/// `super::K_STEPS`: 256) and ragged against it.
/// (The last but one has whole k-steps and parts of whole blocks: the logits product reads its
/// weight in place on `vdpbf16ps`, and packs the parts left over.)
const SHAPES: [(usize, usize, usize); 8] = [
    (5, 7, 11),
    (33, 50, 70),
    (1, 32, 17),
    (64, 96, 256),
    (40, 130, 97),
    (17, 896, 300),
    (45, 64, 1000),
    (290, 300, 611),
];

/// Vocabulary rows per tile (one per shape): ragged (not multiples of 16) and whole.
const TILES: [usize; 8] = [7, 48, 256, 19, 7, 48, 600, 600];

/// The packed ways this machine has (AMX, AVX512-BF16, each split and rounded).
fn packed_ways() -> Vec<Bf16Products> {
    Bf16Products::available().into_iter().filter(|p| p.packed()).collect()
}

fn skip() -> bool {
    if packed_ways().is_empty() {
        eprintln!("no AMX or AVX512-BF16 on this machine: the packed bf16 products are not exercised here");
        return true;
    }
    false
}

#[test]
fn logits_product_matches_f64() {
    if skip() {
        return;
    }
    // Every way on every shape: the large last shape crosses the macro blocks on each kernel.
    for ((n, h, v), tile) in SHAPES.into_iter().zip(TILES) {
        let hc = bits(&normal_matrix(n, h, 1.0, 1));
        let wt = bits(&normal_matrix(v, h, 0.5, 2));
        let (hc64, wt64) = (widen(&hc), widen(&wt));
        let (mut want, mut scale) = (vec![], vec![]);
        for r in 0..n {
            for c in 0..v {
                let terms = (0..h).map(|k| hc64[r * h + k] * wt64[c * h + k]);
                want.push(2.0 * terms.clone().sum::<f64>());
                scale.push(2.0 * terms.map(f64::abs).sum::<f64>());
            }
        }
        for products in packed_ways() {
            let stride = v + 3;
            let mut z = vec![1.0f32; n * stride];
            let mut packed = PackedHidden::default();
            packed.pack(&hc, n, h, products);
            for accumulate in [false, true] {
                let mut out = MatMut { data: &mut z, rows: n, cols: v, stride };
                logits(&mut out, accumulate, &packed, &wt, tile);
            }
            let mut got = vec![];
            for r in 0..n {
                got.extend_from_slice(&z[r * stride..r * stride + v]);
                assert!(z[r * stride + v..(r + 1) * stride].iter().all(|&x| x == 1.0), "past the columns");
            }
            assert_close(&got, &want, &scale, 1e-5, &format!("logits {n}x{h}x{v} {products:?}"));
        }
    }
}

/// The gradient products of `products`, `tile` vocabulary rows at a time; `dh` starts as garbage, `dw` as 0.25
/// (kept with `accumulate`).
#[allow(clippy::too_many_arguments)]
fn gradients(
    dz: &[f32],
    n: usize,
    v: usize,
    wt: &[u16],
    hc: &[u16],
    h: usize,
    accumulate: bool,
    tile: usize,
    products: Bf16Products,
) -> (Vec<f32>, Vec<f32>) {
    let mut packed = PackedHidden::default();
    packed.pack(hc, n, h, products);
    let (mut dh, mut dw) = (vec![0.5f32; n * h], vec![0.25f32; v * h]);
    let dz = Mat::new(dz, n, v);
    gradients_into(&mut MatMut::new(&mut dh, n, h), Some(&mut dw), accumulate, dz, wt, &packed, tile, &mut vec![]);
    (dh, dw)
}

/// A chunk of no rows adds nothing to `d weight` and packs empty operands without panicking.
#[test]
fn gradient_products_of_no_rows() {
    if skip() {
        return;
    }
    let (h, v) = (40, 70);
    let wt = bits(&normal_matrix(v, h, 0.5, 2));
    for products in packed_ways() {
        for accumulate in [false, true] {
            let (dh, dw) = gradients(&[], 0, v, &wt, &[], h, accumulate, 32, products);
            let want = if accumulate { 0.25 } else { 0.0 };
            assert!(dh.is_empty() && dw.iter().all(|&x| x == want), "{products:?} accumulate {accumulate}");
        }
    }
}

#[test]
fn gradient_products_match_f64() {
    if skip() {
        return;
    }
    for ((n, h, v), tile) in SHAPES.into_iter().zip(TILES.into_iter().cycle()) {
        let hc = bits(&normal_matrix(n, h, 1.0, 3));
        let wt = bits(&normal_matrix(v, h, 0.5, 4));
        let dz = normal_matrix(n, v, 1e-3, 5);
        let (hc64, wt64) = (widen(&hc), widen(&wt));
        // The split takes `dz` to 16 significant bits (checked at the products' 1e-5), the
        // rounded way to bf16 (checked against the products of `dz` rounded).
        let ways = packed_ways().into_iter().map(|p| (p, if p.rounded() { widen_f32(&bits(&dz)) } else { dz.clone() }));
        for ((products, dz), accumulate) in ways.flat_map(|w| [(w.clone(), false), (w, true)]) {
            let (dh, dw) = gradients(&dz, n, v, &wt, &hc, h, accumulate, tile, products);
            let start = |x: f64| if accumulate { x } else { 0.0 };
            let (mut want, mut scale) = (vec![], vec![]);
            for r in 0..n {
                for k in 0..h {
                    let terms = (0..v).map(|c| dz[r * v + c] as f64 * wt64[c * h + k]);
                    want.push(terms.clone().sum::<f64>());
                    scale.push(terms.map(f64::abs).sum::<f64>());
                }
            }
            assert_close(&dh, &want, &scale, 1e-5, &format!("{products:?} d hidden {n}x{h}x{v}"));
            let (mut want, mut scale) = (vec![], vec![]);
            for c in 0..v {
                for k in 0..h {
                    let terms = (0..n).map(|r| dz[r * v + c] as f64 * hc64[r * h + k]);
                    want.push(start(0.25) + terms.clone().sum::<f64>());
                    scale.push(terms.map(f64::abs).sum::<f64>() + 0.25);
                }
            }
            assert_close(&dw, &want, &scale, 1e-5, &format!("{products:?} d weight {n}x{h}x{v}"));
        }
    }
}

#[test]
fn products_are_the_same_bits_for_any_thread_count() {
    if skip() {
        return;
    }
    let (n, h, v) = (70, 96, 333);
    let hc = bits(&normal_matrix(n, h, 1.0, 6));
    let wt = bits(&normal_matrix(v, h, 0.5, 7));
    let dz = normal_matrix(n, v, 1e-3, 8);
    let run = |threads: usize, products: Bf16Products| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let mut packed = PackedHidden::default();
            packed.pack(&hc, n, h, products);
            let mut z = vec![0.0f32; n * v];
            logits(&mut MatMut::new(&mut z, n, v), false, &packed, &wt, 32);
            (z, gradients(&dz, n, v, &wt, &hc, h, false, 16, products))
        })
    };
    for products in packed_ways() {
        let one = run(1, products);
        for threads in [2, 3, 5] {
            assert!(run(threads, products) == one, "{products:?}, {threads} threads");
        }
    }
}

/// A linear layer's shapes `(n, inputs, outputs)`: ragged, a decode step's single row, and the
/// shapes of a Qwen2 layer's products cut down.
const LAYER_SHAPES: [(usize, usize, usize); 6] =
    [(5, 7, 11), (33, 64, 70), (1, 96, 40), (70, 130, 97), (40, 896, 128), (64, 256, 608)];

/// The f64 products of a layer on the bf16 values its kernels read: `y = x @ w^T` (with `scale`,
/// the sum of the terms' magnitudes), `dx = dy @ w`, `dw = dy^T @ x`.
#[allow(clippy::type_complexity)]
fn layer_reference(x: &[f32], w: &[u16], dy: &[f32], (n, k, o): (usize, usize, usize)) -> [(Vec<f64>, Vec<f64>); 3] {
    let x64 = widen(&bits(x));
    let w64 = widen(w);
    let dy64: Vec<f64> = dy.iter().map(|&v| v as f64).collect();
    let sums = |len: usize, term: &dyn Fn(usize, usize) -> f64, count: usize| {
        let (mut want, mut scale) = (vec![], vec![]);
        for e in 0..len {
            want.push((0..count).map(|i| term(e, i)).sum::<f64>());
            scale.push((0..count).map(|i| term(e, i).abs()).sum::<f64>());
        }
        (want, scale)
    };
    [
        sums(n * o, &|e, i| x64[e / o * k + i] * w64[e % o * k + i], k),
        sums(n * k, &|e, i| dy64[e / k * o + i] * w64[i * k + e % k], o),
        sums(o * k, &|e, i| dy64[i * o + e / k] * x64[i * k + e % k], n),
    ]
}

#[test]
fn layer_products_match_f64() {
    if skip() {
        return;
    }
    for (seed, (n, k, o)) in LAYER_SHAPES.into_iter().enumerate() {
        let seed = 10 * seed as u64;
        let x = normal_matrix(n, k, 1.0, seed + 1);
        let w = bits(&normal_matrix(o, k, 0.5, seed + 2));
        let dy = normal_matrix(n, o, 1e-3, seed + 3);
        let [(y_want, y_scale), (dx_want, dx_scale), (dw_want, dw_scale)] = layer_reference(&x, &w, &dy, (n, k, o));
        for (products, accumulate) in packed_ways().into_iter().flat_map(|p| [(p, false), (p, true)]) {
            let stride = o + 5;
            let mut y = vec![0.5f32; n * stride];
            let out = &mut MatMut { data: &mut y, rows: n, cols: o, stride };
            layer::forward(out, accumulate, Mat::new(&x, n, k), &w, products);
            let got: Vec<f32> = (0..n * o).map(|e| y[e / o * stride + e % o]).collect();
            let want: Vec<f64> = y_want.iter().map(|w| w + if accumulate { 0.5 } else { 0.0 }).collect();
            let what = format!("{products:?} layer y {n}x{k}x{o} accumulate {accumulate}");
            assert_close(&got, &want, &y_scale, 1e-6, &what);
        }
        // The split keeps `dy` to 16 bits (1e-5); rounded, `dy` is bf16 (checked at bf16's 2^-8).
        for products in packed_ways() {
            let tol = if products.rounded() { 8e-3 } else { 1e-5 };
            for accumulate in [false, true] {
                let (mut dx, mut dw) = (vec![0.25f32; n * k], vec![0.25f32; o * k]);
                layer::backward(
                    &mut MatMut::new(&mut dx, n, k),
                    accumulate,
                    &mut dw,
                    Mat::new(&dy, n, o),
                    Mat::new(&x, n, k),
                    &w,
                    products,
                );
                let start = if accumulate { 0.25 } else { 0.0 };
                let dx_want: Vec<f64> = dx_want.iter().map(|w| w + start).collect();
                let dw_want: Vec<f64> = dw_want.iter().map(|w| w + 0.25).collect();
                let what = format!("{products:?} {n}x{k}x{o} accumulate {accumulate}");
                let dx_scale: Vec<f64> = dx_scale.iter().map(|s| s + start).collect();
                assert_close(&dx, &dx_want, &dx_scale, tol, &format!("layer dx, {what}"));
                let dw_scale: Vec<f64> = dw_scale.iter().map(|s| s + 0.25).collect();
                assert_close(&dw, &dw_want, &dw_scale, tol, &format!("layer dw, {what}"));
            }
        }
    }
}

/// Any thread count, and any other rows beside a row: the same bits (the sampler's decode step
/// and the update's whole-sequence pass agree exactly).
#[test]
fn layer_products_are_the_same_bits_for_any_thread_count_and_batch() {
    if skip() {
        return;
    }
    let (n, k, o) = (70, 96, 333);
    let x = normal_matrix(n, k, 1.0, 6);
    let w = bits(&normal_matrix(o, k, 0.5, 7));
    let dy = normal_matrix(n, o, 1e-3, 8);
    let run = |threads: usize, products: Bf16Products| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let mut y = vec![0.0f32; n * o];
            layer::forward(&mut MatMut::new(&mut y, n, o), false, Mat::new(&x, n, k), &w, products);
            let (mut dx, mut dw) = (vec![0.0f32; n * k], vec![0.0f32; o * k]);
            let (dy, x) = (Mat::new(&dy, n, o), Mat::new(&x, n, k));
            layer::backward(&mut MatMut::new(&mut dx, n, k), false, &mut dw, dy, x, &w, products);
            (y, dx, dw)
        })
    };
    for products in packed_ways() {
        let one = run(1, products);
        for threads in [2, 3, 5] {
            assert!(run(threads, products) == one, "{products:?}, {threads} threads");
        }
        for row in [0, 37, n - 1] {
            let mut y = vec![0.0f32; o];
            layer::forward(
                &mut MatMut::new(&mut y, 1, o),
                false,
                Mat::new(&x[row * k..(row + 1) * k], 1, k),
                &w,
                products,
            );
            assert!(y == one.0[row * o..(row + 1) * o], "row {row} alone");
        }
    }
}

/// A front end's default: `rounded` only where every gradient comes back in bf16, this CPU has a
/// rounded way and nothing (the environment, the thread) names a way; `auto` otherwise.
#[test]
fn the_front_ends_default_rounds_only_gradients_handed_back_in_bf16() {
    assert_eq!(Bf16Choice::default_for(false), Bf16Choice::Auto);
    let named = Bf16Products::named_by_environment().is_some();
    let rounded_here = Bf16Products::available().iter().any(|p| p.rounded());
    let expected = if rounded_here && !named { Bf16Choice::Rounded } else { Bf16Choice::Auto };
    assert_eq!(Bf16Choice::default_for(true), expected);
    for way in Bf16Products::available() {
        assert_eq!(with_bf16_products(way, || Bf16Choice::default_for(true)), Bf16Choice::Auto, "{way:?}");
    }
}

#[test]
fn the_way_named_for_a_call_is_restored_after_a_caught_panic() {
    let before = current();
    let caught = std::panic::catch_unwind(|| with_bf16_products(Bf16Products::Widened, || panic!("inside")));
    assert!(caught.is_err());
    assert_eq!(current(), before, "the way named inside the panicking call leaked out of it");
}

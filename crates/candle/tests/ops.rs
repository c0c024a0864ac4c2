//! The fused model ops against candle's slow composed versions (forward and gradients), and a
//! finite-difference check of their gradients in f64.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var, D};
use flashgrpo_candle::ops::{embedding, masked_softmax, rms_norm, rope, AttentionMask, RopeTable};
use flashgrpo_kernels::synthetic::normal_matrix;

fn randn(shape: &[usize], seed: u64, dtype: DType) -> Var {
    let n: usize = shape.iter().product();
    let t = Tensor::from_vec(normal_matrix(1, n, 1.0, seed), shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
    Var::from_tensor(&t).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    let a: Vec<f64> = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f64> = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(a.len(), b.len());
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// `sum(f(x) * r)` for a fixed random `r`: a scalar whose gradient exercises every output.
fn probe(y: &Tensor, seed: u64) -> Tensor {
    let r = randn(y.dims(), seed, y.dtype());
    (y * r.as_tensor()).unwrap().sum_all().unwrap()
}

fn composed_rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let r = (x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap() + eps).unwrap().sqrt().unwrap().recip().unwrap();
    x.broadcast_mul(&r).unwrap().broadcast_mul(w).unwrap()
}

#[test]
fn rms_norm_matches_the_composed_version() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        let x = randn(&[3, 5, 24], 1, dtype);
        let w = randn(&[24], 2, dtype);
        let ours = rms_norm(x.as_tensor(), w.as_tensor(), 1e-6).unwrap();
        let slow = composed_rms_norm(x.as_tensor(), w.as_tensor(), 1e-6);
        assert!(max_diff(&ours, &slow) < tol);
        let g1 = probe(&ours, 9).backward().unwrap();
        let g2 = probe(&slow, 9).backward().unwrap();
        for v in [&x, &w] {
            let d = max_diff(g1.get(v).unwrap(), g2.get(v).unwrap());
            assert!(d < tol * 10.0, "{dtype:?} gradient differs by {d}");
        }
    }
}

#[test]
fn embedding_matches_index_select() {
    // Repeated ids (their gradients sum), ids out of order, an unused row.
    let ids = Tensor::new(&[3u32, 0, 3, 5, 1, 3, 0], &Device::Cpu).unwrap();
    for dtype in [DType::F32, DType::BF16, DType::F64] {
        let w = randn(&[7, 6], 4, dtype);
        let ours = embedding(w.as_tensor(), &ids).unwrap();
        let slow = w.as_tensor().index_select(&ids, 0).unwrap();
        assert_eq!(max_diff(&ours, &slow), 0.0);
        let g1 = probe(&ours, 5).backward().unwrap();
        let g2 = probe(&slow, 5).backward().unwrap();
        let (a, b) = (g1.get(&w).unwrap(), g2.get(&w).unwrap());
        assert_eq!(a.dtype(), dtype);
        let tol = match dtype {
            DType::F64 => 1e-14,
            DType::F32 => 1e-6,
            _ => 0.02, // bf16: candle adds in bf16, we sum in f32 and round once
        };
        assert!(max_diff(a, b) < tol, "{dtype:?}: {}", max_diff(a, b));
    }
    let bad = Tensor::new(&[7u32], &Device::Cpu).unwrap();
    let e = embedding(randn(&[7, 6], 4, DType::F32).as_tensor(), &bad).unwrap_err().to_string();
    assert!(e.contains("ids[0] = 7"), "{e}");
}

fn composed_rope(x: &Tensor, table_cos: &Tensor, table_sin: &Tensor) -> Tensor {
    let d = x.dim(D::Minus1).unwrap();
    let (a, b) = (x.narrow(D::Minus1, 0, d / 2).unwrap(), x.narrow(D::Minus1, d / 2, d / 2).unwrap());
    let rotated = Tensor::cat(&[&b.neg().unwrap(), &a], D::Minus1).unwrap();
    let cos = Tensor::cat(&[table_cos, table_cos], D::Minus1).unwrap();
    let sin = Tensor::cat(&[table_sin, table_sin], D::Minus1).unwrap();
    (x.broadcast_mul(&cos).unwrap() + rotated.broadcast_mul(&sin).unwrap()).unwrap()
}

#[test]
fn rope_matches_the_composed_version() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
        let (b, heads, t, d, theta) = (2, 3, 6, 8, 10_000.0);
        let table = RopeTable::new(d, theta, 64);
        // Batch row 0 at positions 0..6, row 1 (left-padded) at 3..9.
        let positions: Vec<u32> = (0..t as u32).chain(3..3 + t as u32).collect();
        let x = randn(&[b, heads, t, d], 3, dtype);
        let ours = rope(x.as_tensor(), &table, &Arc::new(positions.clone())).unwrap();
        // The composed version's cos / sin: [B, 1, T, D/2] from the same angles in f64.
        let angles: Vec<f64> = positions
            .iter()
            .flat_map(|&p| (0..d / 2).map(move |i| p as f64 / f64::powf(theta, (2 * i) as f64 / d as f64)))
            .collect();
        let ang = Tensor::from_vec(angles, (b, 1, t, d / 2), &Device::Cpu).unwrap();
        let (cos, sin) = (ang.cos().unwrap().to_dtype(dtype).unwrap(), ang.sin().unwrap().to_dtype(dtype).unwrap());
        let slow = composed_rope(x.as_tensor(), &cos, &sin);
        assert!(max_diff(&ours, &slow) < tol, "{dtype:?} forward {}", max_diff(&ours, &slow));
        let g1 = probe(&ours, 4).backward().unwrap();
        let g2 = probe(&slow, 4).backward().unwrap();
        assert!(max_diff(g1.get(&x).unwrap(), g2.get(&x).unwrap()) < tol);
    }
    let table = RopeTable::new(4, 10_000.0, 8);
    let x = Tensor::zeros((1, 1, 2, 4), DType::F32, &Device::Cpu).unwrap();
    assert!(rope(&x, &table, &Arc::new(vec![0, 8])).unwrap_err().to_string().contains("max_position_embeddings"));
}

fn composed_softmax(s: &Tensor, additive: &Tensor) -> Tensor {
    let s = s.broadcast_add(additive).unwrap();
    let m = s.max_keepdim(D::Minus1).unwrap().detach();
    let e = s.broadcast_sub(&m).unwrap().exp().unwrap();
    e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap()
}

#[test]
fn masked_softmax_matches_the_composed_version() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 1e-6 } else { 1e-13 };
        let (b, heads, tq, offset) = (2, 2, 4, 3);
        let tk = tq + offset;
        // Row 0: every key real; row 1: keys 0..2 are padding.
        let keys: Vec<u8> = (0..b * tk).map(|i| u8::from(!(i >= tk && i < tk + 2))).collect();
        let mask = AttentionMask { offset, keys: Some(Arc::new(keys.clone())) };
        let s = randn(&[b, heads, tq, tk], 5, dtype);
        let ours = masked_softmax(s.as_tensor(), &mask).unwrap();
        let additive: Vec<f64> = (0..b)
            .flat_map(|bi| {
                let keys = keys.clone();
                (0..tq).flat_map(move |i| {
                    let keys = keys.clone();
                    (0..tk).map(move |j| if j <= offset + i && keys[bi * tk + j] != 0 { 0.0 } else { -1e30 })
                })
            })
            .collect();
        let additive = Tensor::from_vec(additive, (b, 1, tq, tk), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
        let slow = composed_softmax(s.as_tensor(), &additive);
        assert!(max_diff(&ours, &slow) < tol);
        let g1 = probe(&ours, 6).backward().unwrap();
        let g2 = probe(&slow, 6).backward().unwrap();
        assert!(max_diff(g1.get(&s).unwrap(), g2.get(&s).unwrap()) < tol * 10.0);
    }
}

#[test]
fn a_query_that_sees_no_key_gets_zero_weights() {
    let keys = Arc::new(vec![0u8, 0, 1]);
    let mask = AttentionMask { offset: 0, keys: Some(keys) };
    let s = randn(&[1, 1, 3, 3], 7, DType::F32);
    let p = masked_softmax(s.as_tensor(), &mask).unwrap();
    let rows: Vec<Vec<f32>> = p.squeeze(0).unwrap().squeeze(0).unwrap().to_vec2().unwrap();
    assert_eq!(rows[0], vec![0.0; 3]);
    assert_eq!(rows[1], vec![0.0; 3]);
    assert_eq!(rows[2], vec![0.0, 0.0, 1.0]);
    let g = probe(&p, 8).backward().unwrap();
    let gs: Vec<Vec<f32>> = g.get(&s).unwrap().squeeze(0).unwrap().squeeze(0).unwrap().to_vec2().unwrap();
    assert_eq!(gs[0], vec![0.0; 3]);
}

/// Central differences of `f` against its autograd gradient, in f64.
fn finite_difference(x: &Var, f: impl Fn(&Tensor) -> Tensor) {
    let analytic: Vec<f64> =
        f(x.as_tensor()).backward().unwrap().get(x).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let base: Vec<f64> = x.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
    let h = 1e-6;
    for k in 0..base.len() {
        let at = |delta: f64| {
            let mut v = base.clone();
            v[k] += delta;
            let t = Tensor::from_vec(v, x.dims(), &Device::Cpu).unwrap();
            f(&t).to_scalar::<f64>().unwrap()
        };
        let numeric = (at(h) - at(-h)) / (2.0 * h);
        assert!(
            (numeric - analytic[k]).abs() < 1e-6 * analytic[k].abs().max(1.0),
            "element {k}: {numeric} vs {}",
            analytic[k]
        );
    }
}

#[test]
fn gradients_match_finite_differences_in_f64() {
    let w = randn(&[6], 11, DType::F64);
    finite_difference(&randn(&[2, 6], 10, DType::F64), |x| probe(&rms_norm(x, w.as_tensor(), 1e-6).unwrap(), 12));
    let x = randn(&[2, 6], 13, DType::F64);
    finite_difference(&w, |w| probe(&rms_norm(x.as_tensor(), w, 1e-6).unwrap(), 12));
    let table = RopeTable::new(4, 100.0, 16);
    let positions = Arc::new(vec![0, 5, 2, 9]);
    finite_difference(&randn(&[2, 1, 2, 4], 14, DType::F64), |x| probe(&rope(x, &table, &positions).unwrap(), 15));
    let mask = AttentionMask { offset: 1, keys: Some(Arc::new(vec![1, 1, 1, 0, 1, 1])) };
    finite_difference(&randn(&[2, 1, 2, 3], 16, DType::F64), |s| probe(&masked_softmax(s, &mask).unwrap(), 17));
}

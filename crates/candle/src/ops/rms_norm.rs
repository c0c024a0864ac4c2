//! RMSNorm as Qwen2 / Llama compute it: `y = w * x / sqrt(mean(x^2) + eps)` over the last
//! dimension, in f32 (f64 for f64 tensors), with its backward:
//! `dx = r (g w) - x r^3 / H * sum(g w x)`, `dw = sum_rows g x r`, `r = 1 / sqrt(mean(x^2) + eps)`.

use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::Real;
use crate::storage::{compute, floats, out};

/// `rms_norm(x [.., H], w [H], eps)`, differentiable in `x` and `w`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    // One dtype: the backward hands `dw` back in x's.
    if x.dtype() != w.dtype() {
        bail!("rms_norm: x ({:?}) and the weight ({:?}) must share one dtype", x.dtype(), w.dtype());
    }
    let x = x.contiguous()?;
    x.apply_op2(&w.contiguous()?, RmsNorm { eps })
}

struct RmsNorm {
    eps: f64,
}

fn inv_rms<R: Real>(row: &[R], eps: f64) -> R {
    let mean = row.iter().map(|&v| v * v).sum::<R>() / R::from_f64(row.len() as f64);
    R::from_f64(1.0) / (mean + R::from_f64(eps)).sqrt()
}

fn forward<R: Real>(x: &[R], w: &[R], eps: f64) -> Vec<R> {
    let h = w.len();
    let mut y = vec![R::default(); x.len()];
    y.par_chunks_mut(h).zip(x.par_chunks(h)).for_each(|(y, x)| {
        let r = inv_rms(x, eps);
        for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
            *y = w * (x * r);
        }
    });
    y
}

fn grad_x<R: Real>(x: &[R], w: &[R], g: &[R], eps: f64) -> Vec<R> {
    let h = w.len();
    let mut dx = vec![R::default(); x.len()];
    dx.par_chunks_mut(h).zip(x.par_chunks(h)).zip(g.par_chunks(h)).for_each(|((dx, x), g)| {
        let r = inv_rms(x, eps);
        let dot: R = x.iter().zip(g).zip(w).map(|((&x, &g), &w)| g * w * x).sum();
        let k = r * r * r * dot / R::from_f64(h as f64);
        for (((dx, &x), &g), &w) in dx.iter_mut().zip(x).zip(g).zip(w) {
            *dx = r * g * w - x * k;
        }
    });
    dx
}

fn grad_w<R: Real>(x: &[R], g: &[R], h: usize, eps: f64) -> Vec<R> {
    // Rows in order into each column: the same bits for any thread count.
    let rows: Vec<R> = x.chunks(h).map(|row| inv_rms(row, eps)).collect();
    (0..h)
        .into_par_iter()
        .map(|j| x.chunks(h).zip(g.chunks(h)).zip(&rows).map(|((x, g), &r)| g[j] * x[j] * r).sum())
        .collect()
}

fn check(l1: &Layout, l2: &Layout) -> Result<usize> {
    let h = l2.shape().elem_count();
    if l1.shape().dims().last() != Some(&h) || l2.shape().rank() != 1 || h == 0 {
        bail!("rms_norm: x {:?} must end in the weight's size {:?} (not 0)", l1.shape(), l2.shape());
    }
    Ok(h)
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "flashgrpo-rms-norm"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        check(l1, l2)?;
        let (x, w) = (floats(s1, l1, "rms_norm x")?, floats(s2, l2, "rms_norm weight")?);
        let eps = self.eps;
        let y = compute(&x, |x| forward(&x, &w.to_f32(), eps), |x| forward(&x, &w.to_f64(), eps));
        out(y, l1.shape())
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        let dx = x.apply_op3_no_bwd(w, &g, &RmsNormGradX { eps: self.eps })?;
        let dw = x.apply_op2_no_bwd(&g, &RmsNormGradW { eps: self.eps, h: w.elem_count() })?;
        Ok((Some(dx), Some(dw)))
    }
}

struct RmsNormGradX {
    eps: f64,
}

impl CustomOp3 for RmsNormGradX {
    fn name(&self) -> &'static str {
        "flashgrpo-rms-norm-grad-x"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        check(l1, l2)?;
        let (x, w, g) = (floats(s1, l1, "x")?, floats(s2, l2, "weight")?, floats(s3, l3, "gradient")?);
        let eps = self.eps;
        let dx =
            compute(&x, |x| grad_x(&x, &w.to_f32(), &g.to_f32(), eps), |x| grad_x(&x, &w.to_f64(), &g.to_f64(), eps));
        out(dx, l1.shape())
    }
}

struct RmsNormGradW {
    eps: f64,
    h: usize,
}

impl CustomOp2 for RmsNormGradW {
    fn name(&self) -> &'static str {
        "flashgrpo-rms-norm-grad-w"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, g) = (floats(s1, l1, "x")?, floats(s2, l2, "gradient")?);
        let (eps, h) = (self.eps, self.h);
        let dw = compute(&x, |x| grad_w(&x, &g.to_f32(), h, eps), |x| grad_w(&x, &g.to_f64(), h, eps));
        out(dw, &Shape::from(h))
    }
}

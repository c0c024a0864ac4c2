//! Rotary position embedding, Qwen2 / Llama style (`rotate_half`, not interleaved):
//! `y = x cos + rotate_half(x) sin` with `rotate_half([a, b]) = [-b, a]`, per head over the head
//! dimension, at each token's position. Its backward is the rotation by the opposite angle.

use std::sync::Arc;

use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::Real;
use crate::storage::{compute, floats, out};

/// `cos` and `sin` of `position * inv_freq`, `[max_positions, head_dim / 2]`, computed as
/// Hugging Face transformers does (f32 `inv_freq = 1 / theta^(2i / d)`, f32 products), and in f64.
#[derive(Debug)]
pub struct RopeTable {
    half: usize,
    max_positions: usize,
    cos32: Vec<f32>,
    sin32: Vec<f32>,
    cos64: Vec<f64>,
    sin64: Vec<f64>,
}

impl RopeTable {
    pub fn new(head_dim: usize, theta: f64, max_positions: usize) -> Arc<Self> {
        let half = head_dim / 2;
        let inv32: Vec<f32> = (0..half).map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32)).collect();
        let inv64: Vec<f64> = (0..half).map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64)).collect();
        let angles32: Vec<f32> = (0..max_positions).flat_map(|p| inv32.iter().map(move |f| p as f32 * f)).collect();
        let angles64: Vec<f64> = (0..max_positions).flat_map(|p| inv64.iter().map(move |f| p as f64 * f)).collect();
        Arc::new(Self {
            half,
            max_positions,
            cos32: angles32.iter().map(|a| a.cos()).collect(),
            sin32: angles32.iter().map(|a| a.sin()).collect(),
            cos64: angles64.iter().map(|a| a.cos()).collect(),
            sin64: angles64.iter().map(|a| a.sin()).collect(),
        })
    }

    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// The f32 `cos` and `sin` of `position`'s angles, `head_dim / 2` each (for code that rotates
    /// by itself, as the trainer's engine does).
    pub fn cos_sin(&self, position: usize) -> (&[f32], &[f32]) {
        let range = position * self.half..(position + 1) * self.half;
        (&self.cos32[range.clone()], &self.sin32[range])
    }
}

/// Applies the embedding to `x [B, heads, T, head_dim]`; `positions` is `[B * T]` (each batch
/// row's token positions), differentiable in `x`.
pub fn rope(x: &Tensor, table: &Arc<RopeTable>, positions: &Arc<Vec<u32>>) -> Result<Tensor> {
    let (b, _, t, d) = x.dims4()?;
    if d == 0 || d != 2 * table.half {
        bail!("rope: head dimension {d} does not match the table's {}", 2 * table.half);
    }
    if positions.len() != b * t {
        bail!("rope: {} positions for B*T = {}", positions.len(), b * t);
    }
    if let Some(&p) = positions.iter().find(|&&p| p as usize >= table.max_positions) {
        bail!("rope: position {p} is beyond max_position_embeddings = {}", table.max_positions);
    }
    x.contiguous()?.apply_op1(Rope { table: table.clone(), positions: positions.clone(), inverse: false })
}

struct Rope {
    table: Arc<RopeTable>,
    positions: Arc<Vec<u32>>,
    /// Rotate by minus the angle (the backward).
    inverse: bool,
}

impl Rope {
    fn apply<R: Real>(&self, x: &[R], dims: (usize, usize, usize, usize), cos: &[R], sin: &[R]) -> Vec<R> {
        let (_, heads, t, d) = dims;
        let half = d / 2;
        let sign = if self.inverse { -R::from_f64(1.0) } else { R::from_f64(1.0) };
        let mut y = vec![R::default(); x.len()];
        y.par_chunks_mut(d).zip(x.par_chunks(d)).enumerate().for_each(|(row, (y, x))| {
            let (bi, ti) = (row / (heads * t), row % t);
            let p = self.positions[bi * t + ti] as usize;
            let (c, s) = (&cos[p * half..(p + 1) * half], &sin[p * half..(p + 1) * half]);
            for i in 0..half {
                let (a, b) = (x[i], x[i + half]);
                let si = sign * s[i];
                y[i] = a * c[i] - b * si;
                y[i + half] = b * c[i] + a * si;
            }
        });
        y
    }
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "flashgrpo-rope"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = layout.shape().dims4()?;
        let x = floats(storage, layout, "rope input")?;
        let t = &self.table;
        let y = compute(&x, |x| self.apply(&x, dims, &t.cos32, &t.sin32), |x| self.apply(&x, dims, &t.cos64, &t.sin64));
        out(y, layout.shape())
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let inverse = Rope { table: self.table.clone(), positions: self.positions.clone(), inverse: !self.inverse };
        Ok(Some(g.contiguous()?.apply_op1_no_bwd(&inverse)?))
    }
}

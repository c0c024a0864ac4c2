//! Softmax over attention scores `[B, heads, Tq, Tk]` with the causal mask and a key padding mask
//! applied inside (no `-inf` tensor is built), and its backward `dS = P (dP - sum(dP P))`.
//! A query that may see no key at all (a left-padding query) gets all-zero weights, hence a zero
//! attention output, as Hugging Face transformers' default (SDPA) attention gives it; its
//! gradient is zero. (Its eager attention attends uniformly instead; the real tokens' outputs
//! are the same either way.)

use std::sync::Arc;

use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::Real;
use crate::storage::{compute, floats, out};

/// Which keys each query may attend to.
#[derive(Debug, Clone)]
pub struct AttentionMask {
    /// Query `i` sits at key position `offset + i` and may see keys `j <= offset + i`
    /// (the keys of a KV cache come first).
    pub offset: usize,
    /// `[B, Tk]`: 1 for a real key, 0 for padding; `None`: every key is real.
    pub keys: Option<Arc<Vec<u8>>>,
}

impl AttentionMask {
    fn allowed(&self, b: usize, tk: usize, i: usize, j: usize) -> bool {
        j <= self.offset + i && self.keys.as_ref().is_none_or(|k| k[b * tk + j] != 0)
    }
}

/// `softmax(scores)` over the keys the mask allows; differentiable in `scores`.
pub fn masked_softmax(scores: &Tensor, mask: &AttentionMask) -> Result<Tensor> {
    let (b, _, _, tk) = scores.dims4()?;
    if tk == 0 {
        bail!("masked_softmax: scores {:?} have no keys", scores.dims());
    }
    if let Some(k) = &mask.keys {
        if k.len() != b * tk {
            bail!("masked_softmax: key mask of {} entries for B*Tk = {}", k.len(), b * tk);
        }
    }
    scores.contiguous()?.apply_op1(MaskedSoftmax { mask: mask.clone() })
}

struct MaskedSoftmax {
    mask: AttentionMask,
}

impl MaskedSoftmax {
    fn forward<R: Real>(&self, s: &[R], dims: (usize, usize, usize, usize)) -> Vec<R> {
        let (_, heads, tq, tk) = dims;
        let mut p = vec![R::default(); s.len()];
        p.par_chunks_mut(tk).zip(s.par_chunks(tk)).enumerate().for_each(|(row, (p, s))| {
            let (b, i) = (row / (heads * tq), row % tq);
            let allowed = |j: usize| self.mask.allowed(b, tk, i, j);
            let mut max = None::<R>;
            for (j, &v) in s.iter().enumerate() {
                if allowed(j) && max.is_none_or(|m| v > m) {
                    max = Some(v);
                }
            }
            let Some(max) = max else {
                return; // sees no key: all zero
            };
            let mut sum = R::default();
            for (j, (p, &v)) in p.iter_mut().zip(s).enumerate() {
                if allowed(j) {
                    *p = (v - max).exp();
                    sum += *p;
                }
            }
            for p in p.iter_mut() {
                *p = *p / sum;
            }
        });
        p
    }

    fn backward<R: Real>(&self, p: &[R], g: &[R], dims: (usize, usize, usize, usize)) -> Vec<R> {
        let (_, heads, tq, tk) = dims;
        let mut ds = vec![R::default(); p.len()];
        ds.par_chunks_mut(tk).zip(p.par_chunks(tk)).zip(g.par_chunks(tk)).enumerate().for_each(
            |(row, ((ds, p), g))| {
                let (b, i) = (row / (heads * tq), row % tq);
                if !(0..tk).any(|j| self.mask.allowed(b, tk, i, j)) {
                    return; // uniform, independent of the scores
                }
                let dot: R = p.iter().zip(g).map(|(&p, &g)| p * g).sum();
                for ((d, &p), &g) in ds.iter_mut().zip(p).zip(g) {
                    *d = p * (g - dot);
                }
            },
        );
        ds
    }
}

impl CustomOp1 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "flashgrpo-masked-softmax"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = layout.shape().dims4()?;
        let s = floats(storage, layout, "attention scores")?;
        let p = compute(&s, |s| self.forward(&s, dims), |s| self.forward(&s, dims));
        out(p, layout.shape())
    }

    fn bwd(&self, _s: &Tensor, p: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let backward = MaskedSoftmaxBackward { mask: self.mask.clone() };
        Ok(Some(p.contiguous()?.apply_op2_no_bwd(&g.contiguous()?, &backward)?))
    }
}

struct MaskedSoftmaxBackward {
    mask: AttentionMask,
}

impl CustomOp2 for MaskedSoftmaxBackward {
    fn name(&self) -> &'static str {
        "flashgrpo-masked-softmax-backward"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = l1.shape().dims4()?;
        let (p, g) = (floats(s1, l1, "probabilities")?, floats(s2, l2, "gradient")?);
        let op = MaskedSoftmax { mask: self.mask.clone() };
        let ds = compute(&p, |p| op.backward(&p, &g.to_f32(), dims), |p| op.backward(&p, &g.to_f64(), dims));
        out(ds, l1.shape())
    }
}

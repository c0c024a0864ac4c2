//! Embedding lookup with a backward that builds the `[V, H]` weight gradient in one buffer.
//! candle's `index_select` backward allocates a zero `[V, H]` tensor and then a second one for
//! `index_add`'s result: for Qwen2.5's 151936 x 896 embedding that is 544 MiB of f32 spent twice
//! per step. Rows are summed per token in position order (f32, f64 for f64): deterministic.

use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::storage::{floats, Floats};

/// `weight [V, H]` rows at `ids [N]` (u32) as `[N, H]`, differentiable in `weight`.
pub fn embedding(weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
    weight.contiguous()?.apply_op2(&ids.contiguous()?, Embedding)
}

struct Embedding;

fn ids_of<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [u32]> {
    let (Some((start, end)), CpuStorage::U32(v)) = (layout.contiguous_offsets(), storage) else {
        bail!("embedding: ids must be a contiguous u32 tensor")
    };
    Ok(&v[start..end])
}

fn check(weight: &Layout, ids: &[u32]) -> Result<(usize, usize)> {
    let (v, h) = weight.shape().dims2()?;
    if let Some((n, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= v) {
        bail!("embedding: ids[{n}] = {id} is out of range for a vocabulary of {v}");
    }
    Ok((v, h))
}

fn gather<T: Copy + Send + Sync>(w: &[T], ids: &[u32], h: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(ids.len() * h);
    for &id in ids {
        out.extend_from_slice(&w[id as usize * h..(id as usize + 1) * h]);
    }
    out
}

impl CustomOp2 for Embedding {
    fn name(&self) -> &'static str {
        "flashgrpo-embedding"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let ids = ids_of(s2, l2)?;
        let (_, h) = check(l1, ids)?;
        let out = match floats(s1, l1, "embedding weight")? {
            Floats::F32(w) => CpuStorage::F32(gather(w, ids, h)),
            Floats::BF16(w) => CpuStorage::BF16(gather(w, ids, h)),
            Floats::F16(w) => CpuStorage::F16(gather(w, ids, h)),
            Floats::F64(w) => CpuStorage::F64(gather(w, ids, h)),
        };
        Ok((out, Shape::from((ids.len(), h))))
    }

    fn bwd(
        &self,
        weight: &Tensor,
        ids: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dw = weight.apply_op2_no_bwd(&grad.contiguous()?, &EmbeddingGrad { ids: ids.flatten_all()?.to_vec1()? })?;
        Ok((Some(dw), None))
    }
}

/// `dW[v] = sum of grad[n] over positions n with ids[n] = v`, in `weight`'s shape and dtype.
struct EmbeddingGrad {
    ids: Vec<u32>,
}

/// Positions grouped by token, in position order within a token.
fn groups(ids: &[u32]) -> Vec<(u32, Vec<usize>)> {
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_by_key(|&n| ids[n]);
    let mut out: Vec<(u32, Vec<usize>)> = Vec::new();
    for n in order {
        match out.last_mut() {
            Some((id, positions)) if *id == ids[n] => positions.push(n),
            _ => out.push((ids[n], vec![n])),
        }
    }
    out
}

/// Scatters per-token sums into a zero `[V, H]` buffer of `T`.
fn scatter<T: Copy + Default + Send + Sync, A: Copy + Default + std::ops::AddAssign + Send + Sync>(
    grad: &[A],
    ids: &[u32],
    v: usize,
    h: usize,
    to: fn(A) -> T,
) -> Vec<T> {
    let sums: Vec<(u32, Vec<A>)> = groups(ids)
        .into_par_iter()
        .map(|(id, positions)| {
            let mut row = vec![A::default(); h];
            for n in positions {
                row.iter_mut().zip(&grad[n * h..(n + 1) * h]).for_each(|(r, &g)| *r += g);
            }
            (id, row)
        })
        .collect();
    let mut out = vec![T::default(); v * h];
    for (id, row) in sums {
        out[id as usize * h..(id as usize + 1) * h].iter_mut().zip(row).for_each(|(o, r)| *o = to(r));
    }
    out
}

impl CustomOp2 for EmbeddingGrad {
    fn name(&self) -> &'static str {
        "flashgrpo-embedding-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (v, h) = check(l1, &self.ids)?;
        let ids = &self.ids;
        let grad = floats(s2, l2, "embedding output gradient")?;
        let out = match (floats(s1, l1, "embedding weight")?, &grad) {
            (Floats::F64(_), Floats::F64(g)) => CpuStorage::F64(scatter(g, ids, v, h, |x| x)),
            (Floats::F32(_), Floats::F32(g)) => CpuStorage::F32(scatter(g, ids, v, h, |x| x)),
            (Floats::BF16(_), _) => CpuStorage::BF16(scatter(&grad.to_f32(), ids, v, h, bf16::from_f32)),
            (Floats::F16(_), _) => CpuStorage::F16(scatter(&grad.to_f32(), ids, v, h, f16::from_f32)),
            _ => bail!("embedding: the gradient's dtype differs from the weight's"),
        };
        Ok((out, l1.shape().clone()))
    }
}

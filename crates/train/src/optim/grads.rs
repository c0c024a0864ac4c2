//! Gradients summed on the host in f32 over the micro-batches of an accumulation window: one
//! buffer per parameter, whatever the parameters' dtype (bf16 gradients would lose the small
//! micro-batch contributions).

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, Result, Storage, Tensor};
use rayon::prelude::*;

use flashgrpo_collective::{Collective, ReduceOp};

use crate::model::Params;

/// The largest all-reduce bucket of small gradients: 4 Mi floats (16 MiB), large enough that
/// the per-call latency is paid a few times per step, small enough to stay a modest copy (a
/// larger parameter goes alone, in place).
pub const BUCKET_FLOATS: usize = 4 << 20;

/// One f32 buffer per parameter, in the parameters' order.
pub struct GradBuffers {
    buffers: Vec<Vec<f32>>,
}

impl GradBuffers {
    pub fn new(params: &Params) -> Self {
        // Faulted in now: the first backward adds into them (`huge_pages::zeroed_resident`).
        let zeros = |n| flashgrpo_kernels::huge_pages::zeroed_resident::<f32>(n);
        Self { buffers: params.iter().map(|(_, v)| zeros(v.elem_count())).collect() }
    }

    /// Adds the gradients of a backward. A parameter the loss does not reach adds nothing.
    pub fn add(&mut self, params: &Params, store: &GradStore) -> Result<()> {
        for ((_, var), buffer) in params.iter().zip(&mut self.buffers) {
            let Some(grad) = store.get(var.as_tensor()) else { continue };
            with_f32(grad, |grad| {
                buffer.par_chunks_mut(1 << 16).zip(grad.par_chunks(1 << 16)).for_each(|(b, g)| {
                    b.iter_mut().zip(g).for_each(|(b, g)| *b += g);
                })
            })?;
        }
        Ok(())
    }

    /// The global L2 norm over every parameter (f64 sum in a fixed order: deterministic); not
    /// finite when any gradient is not.
    pub fn global_norm(&self) -> f64 {
        let squares: Vec<f64> = self
            .buffers
            .iter()
            .map(|b| b.par_chunks(1 << 16).map(|c| c.iter().map(|&g| g as f64 * g as f64).sum::<f64>()).collect())
            .map(|parts: Vec<f64>| parts.iter().sum())
            .collect();
        squares.iter().sum::<f64>().sqrt()
    }

    /// Scales the gradients to a global norm of at most `max_norm`, as `torch.nn.utils.clip_grad_norm_`
    /// (factor `max_norm / (norm + 1e-6)`, applied only when below 1). Returns the norm before.
    pub fn clip(&mut self, max_norm: f64) -> f64 {
        let norm = self.global_norm();
        let factor = max_norm / (norm + 1e-6);
        if norm.is_finite() && factor < 1.0 {
            let k = factor as f32;
            for b in &mut self.buffers {
                b.par_iter_mut().for_each(|g| *g *= k);
            }
        }
        norm
    }

    /// Moves buffer `index` out (an empty one stays in its place until [`GradBuffers::put`]).
    pub fn take(&mut self, index: usize) -> Vec<f32> {
        std::mem::take(&mut self.buffers[index])
    }

    pub fn put(&mut self, index: usize, buffer: Vec<f32>) {
        self.buffers[index] = buffer;
    }

    /// Sums every buffer over the ranks of `comm`, in buckets of at most [`BUCKET_FLOATS`]
    /// (small parameters share a bucket, so a step makes a few large all-reduces rather than one
    /// per parameter; a large one goes by itself, in place).
    pub fn all_reduce(&mut self, comm: &dyn Collective) -> crate::error::Result<()> {
        self.all_reduce_except(comm, &[])
    }

    /// [`GradBuffers::all_reduce`] of every buffer but those of `done` (summed already).
    pub fn all_reduce_except(&mut self, comm: &dyn Collective, done: &[usize]) -> crate::error::Result<()> {
        if comm.size() == 1 {
            return Ok(());
        }
        let mut bucket: Vec<usize> = Vec::new();
        let mut floats = 0;
        for i in (0..self.buffers.len()).filter(|i| !done.contains(i)) {
            let n = self.buffers[i].len();
            if !bucket.is_empty() && floats + n > BUCKET_FLOATS {
                self.sum_bucket(comm, &std::mem::take(&mut bucket))?;
                floats = 0;
            }
            bucket.push(i);
            floats += n;
        }
        self.sum_bucket(comm, &bucket)
    }

    /// Sums buffers `indices` over the ranks in one all-reduce.
    fn sum_bucket(&mut self, comm: &dyn Collective, indices: &[usize]) -> crate::error::Result<()> {
        let mut buffers: Vec<Vec<f32>> = indices.iter().map(|&i| self.take(i)).collect();
        let summed = sum_together(comm, &mut buffers);
        for (&i, b) in indices.iter().zip(buffers) {
            self.put(i, b);
        }
        summed
    }

    pub fn zero(&mut self) {
        for b in &mut self.buffers {
            b.par_iter_mut().for_each(|g| *g = 0.0);
        }
    }

    pub fn get(&self, index: usize) -> &[f32] {
        &self.buffers[index]
    }

    /// Parameter `index`'s buffer, for code that computes gradients itself (the engine) and adds
    /// them in place.
    pub fn get_mut(&mut self, index: usize) -> &mut [f32] {
        &mut self.buffers[index]
    }
}

/// Sums `buffers` over the ranks of `comm` in one all-reduce: a single buffer in place, several
/// laid end to end (one call's latency instead of one per buffer).
pub(crate) fn sum_together(comm: &dyn Collective, buffers: &mut [Vec<f32>]) -> crate::error::Result<()> {
    match buffers {
        [] => Ok(()),
        [one] => Ok(comm.all_reduce_f32(one, ReduceOp::Sum)?),
        _ => {
            let mut flat: Vec<f32> = buffers.iter().flatten().copied().collect();
            comm.all_reduce_f32(&mut flat, ReduceOp::Sum)?;
            let mut at = 0;
            for b in buffers.iter_mut() {
                let n = b.len();
                b.copy_from_slice(&flat[at..at + n]);
                at += n;
            }
            Ok(())
        }
    }
}

/// Runs `f` on a tensor's values as f32: a contiguous f32 CPU tensor is read where it lies (an
/// embedding gradient is `V x H` floats: no copy of it), anything else is converted first.
pub(crate) fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(CpuStorage::F32(v)), Some((start, end))) = (&*storage, layout.contiguous_offsets()) {
            return Ok(f(&v[start..end]));
        }
    }
    let values = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(f(&values))
}

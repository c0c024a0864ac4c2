//! Gradients summed on the host in f32 over the micro-batches of an accumulation window: one
//! buffer per parameter, whatever the parameters' dtype (bf16 gradients would lose the small
//! micro-batch contributions).

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, Result, Storage, Tensor};
use rayon::prelude::*;

use flashgrpo_collective::{Collective, ReduceOp};

use crate::model::Params;

/// The largest all-reduce bucket of small gradients: 4 Mi floats (16 MiB), large enough that
/// the per-call latency is paid a few times per step, small enough to stay a modest copy.
pub const BUCKET_FLOATS: usize = 4 << 20;

/// One f32 buffer per parameter, in the parameters' order.
pub struct GradBuffers {
    buffers: Vec<Vec<f32>>,
}

impl GradBuffers {
    pub fn new(params: &Params) -> Self {
        Self { buffers: params.iter().map(|(_, v)| vec![0.0; v.elem_count()]).collect() }
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
        let mut bucket: Vec<f32> = Vec::with_capacity(BUCKET_FLOATS);
        let mut members: Vec<usize> = Vec::new();
        let flush = |bucket: &mut Vec<f32>, members: &mut Vec<usize>, buffers: &mut [Vec<f32>]| {
            if bucket.is_empty() {
                return Ok::<(), crate::error::TrainError>(());
            }
            comm.all_reduce_f32(bucket, ReduceOp::Sum)?;
            let mut at = 0;
            for &i in members.iter() {
                let n = buffers[i].len();
                buffers[i].copy_from_slice(&bucket[at..at + n]);
                at += n;
            }
            bucket.clear();
            members.clear();
            Ok(())
        };
        for i in (0..self.buffers.len()).filter(|i| !done.contains(i)) {
            let n = self.buffers[i].len();
            if n >= BUCKET_FLOATS {
                comm.all_reduce_f32(&mut self.buffers[i], ReduceOp::Sum)?;
                continue;
            }
            if bucket.len() + n > BUCKET_FLOATS {
                flush(&mut bucket, &mut members, &mut self.buffers)?;
            }
            bucket.extend_from_slice(&self.buffers[i]);
            members.push(i);
        }
        flush(&mut bucket, &mut members, &mut self.buffers)
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

//! Fused-linear losses on the GPU: the loss of `logits = hidden @ weight^T (+ bias)` from `hidden
//! [N, H]` and `weight [V, H]` on the device, in chunks of rows so that the `[N, V]` logits never
//! exist whole. Per chunk: cuBLAS writes the chunk's f32 logits, rows.cu's statistics pass reads
//! them, the host evaluates the objective, the gradient pass writes `dz` (over the f32 logits for
//! f32 inputs; in the inputs' dtype for f16 / bf16, so the two backward products run on tensor
//! cores), and cuBLAS turns it into `dh = dz @ W` and `dW += dz^T @ h`.
//!
//! As on the CPU ([`crate::linear`]): row-local objectives take three products per chunk in one
//! pass; sequence-level GRPO needs every row's statistics first, so it recomputes the logits in a
//! second pass (four products). Gradients are f32, overwritten.

use std::ops::Range;

use cudarc::driver::{CudaSlice, DevicePtr, PushKernelArg};

use super::blas::{gemm, Operand};
use super::device::{cuda_error, optional_ptr, CudaDevice, CudaElement};
use super::passes::{active_mask, vocab_i32, RowBlock};
use crate::engine::{LossSpec, PreparedLoss};
use crate::error::LossError;
use crate::linear::{shapes, ChunkBudget};
use crate::objective::{LossOutput, RowGradient};
use crate::stats::PartialRowStats;

/// The inputs of a fused-linear loss on the GPU (one dtype for all three).
#[derive(Debug, Clone, Copy)]
pub struct CudaLinearInputs<'a, T> {
    /// `[N, H]`, row-major.
    pub hidden: &'a CudaSlice<T>,
    /// `[V, H]` (the lm_head's layout).
    pub weight: &'a CudaSlice<T>,
    /// `[V]`.
    pub bias: Option<&'a CudaSlice<T>>,
    pub hidden_size: usize,
}

/// Where the gradients go: f32, overwritten. `weight` and `bias` may be left out (a frozen
/// lm_head), which skips their products.
#[derive(Debug)]
pub struct CudaLinearGradients<'a> {
    /// `[N, H]`.
    pub hidden: &'a mut CudaSlice<f32>,
    /// `[V, H]`.
    pub weight: Option<&'a mut CudaSlice<f32>>,
    /// `[V]`.
    pub bias: Option<&'a mut CudaSlice<f32>>,
}

/// Rows per chunk: as many as the budget holds (the chunk's f32 logits, and its `dz` when that is
/// in another dtype), in chunks of equal size.
fn rows_per_chunk<T: CudaElement>(n: usize, vocab: usize, budget: ChunkBudget) -> usize {
    let separate_dz = if T::as_f32_slice(&[]).is_none() { std::mem::size_of::<T>() } else { 0 };
    let per_row = vocab.max(1) * (4 + separate_dz);
    crate::linear::even_chunk_rows(n, budget.bytes / per_row)
}

/// One fused-linear call's device state: the inputs' pointers, the chunk buffers, the O(N) inputs.
struct Streamer<'d, 'p, 'a, T> {
    device: &'d CudaDevice,
    prepared: &'p PreparedLoss<'a>,
    inputs: CudaLinearInputs<'p, T>,
    chunk_rows: usize,
    /// f32 logits of one chunk, `[chunk_rows, V]`; `dz` in place for f32 inputs.
    z: CudaSlice<f32>,
    /// `dz` in the inputs' dtype (f16 / bf16 inputs only).
    dz: Option<CudaSlice<T>>,
    targets: Option<CudaSlice<i64>>,
    active: CudaSlice<f32>,
    stats: CudaSlice<f32>,
}

impl<'d, 'p, 'a, T: CudaElement> Streamer<'d, 'p, 'a, T> {
    fn new(
        device: &'d CudaDevice,
        prepared: &'p PreparedLoss<'a>,
        inputs: CudaLinearInputs<'p, T>,
        budget: ChunkBudget,
        gradient: bool,
    ) -> Result<Self, LossError> {
        let rows = &prepared.spec().rows;
        let (n, h, v) = (rows.len(), inputs.hidden_size, rows.vocab);
        let bias = inputs.bias.map(CudaSlice::len);
        shapes::check_inputs(rows, h, v, inputs.hidden.len(), inputs.weight.len(), bias)?;
        let chunk_rows = rows_per_chunk::<T>(n, v, budget);
        let separate_dz = gradient && T::as_f32_slice(&[]).is_none();
        Ok(Self {
            device,
            prepared,
            inputs,
            chunk_rows,
            z: device.zeros(chunk_rows * v)?,
            dz: if separate_dz { Some(device.zeros(chunk_rows * v)?) } else { None },
            targets: rows.targets.map(|t| device.upload(t)).transpose()?,
            active: device.upload(&active_mask(prepared.active_rows()))?,
            stats: device.zeros(chunk_rows * 5)?,
        })
    }

    fn chunks(&self) -> Vec<Range<usize>> {
        let (n, step) = (self.prepared.spec().rows.len(), self.chunk_rows);
        (0..n).step_by(step).map(|r| r..(r + step).min(n)).collect()
    }

    fn hidden_size(&self) -> usize {
        self.inputs.hidden_size
    }

    fn vocab(&self) -> usize {
        self.prepared.spec().rows.vocab
    }

    /// The chunk's f32 logits into `self.z`: the bias broadcast, then `+= h_chunk @ W^T`.
    fn logits(&mut self, chunk: &Range<usize>) -> Result<(), LossError> {
        let (h, v, stream) = (self.hidden_size(), self.vocab(), self.device.stream().clone());
        let (z, _z) = self.z.device_ptr(&stream);
        if let Some(bias) = self.inputs.bias {
            let function = self.device.function(&format!("bias_rows_{}", T::SUFFIX))?;
            let (rows, vocab) = (chunk.len() as i64, vocab_i32(v)?);
            let mut launch = stream.launch_builder(&function);
            launch.arg(&z).arg(bias).arg(&rows).arg(&vocab);
            // SAFETY: matches `bias_rows_*`: `z` holds rows*vocab floats, `bias` vocab values.
            unsafe { launch.launch(CudaDevice::per_item(chunk.len() * v, 65_536)) }
                .map_err(cuda_error("launching bias_rows"))?;
        }
        let (hidden, _h) = self.inputs.hidden.device_ptr(&stream);
        let (weight, _w) = self.inputs.weight.device_ptr(&stream);
        let size = std::mem::size_of::<T>() as u64;
        let hc =
            Operand { ptr: hidden + (chunk.start * h) as u64 * size, ld: h, dtype: T::BLAS_TYPE, transposed: false };
        let wt = Operand { ptr: weight, ld: h, dtype: T::BLAS_TYPE, transposed: true };
        let beta = if self.inputs.bias.is_some() { 1.0 } else { 0.0 };
        gemm(self.device.blas()?, (chunk.len(), v, h), hc, wt, z, v, beta)
    }

    /// The row block of the chunk's logits in `self.z`.
    fn block(&self, chunk: &Range<usize>) -> RowBlock {
        let stream = self.device.stream();
        let (z, _z) = self.z.device_ptr(stream);
        let (targets, _t) = optional_ptr(self.targets.as_ref(), stream);
        let (active, _a) = self.active.device_ptr(stream);
        let all_rows = RowBlock {
            logits: 0,
            rows: self.prepared.spec().rows.len(),
            vocab: self.vocab(),
            inv_temperature: (1.0 / self.prepared.spec().options.temperature) as f32,
            targets,
            active,
        };
        // The chunk's targets and mask are the batch's rows; its logits are `z` from its first row.
        RowBlock { logits: z, ..all_rows.rows_of(chunk, 0) }
    }

    /// The chunk's partial statistics (after [`logits`](Self::logits)), checked for NaN / Inf.
    fn statistics(&mut self, chunk: &Range<usize>) -> Result<Vec<PartialRowStats>, LossError> {
        let block = self.block(chunk);
        self.device.row_stats("f32", block, &mut self.stats, self.prepared, chunk.start)
    }

    /// `dz` of the chunk from its rows' gradient scalars, then `dh`, `dW` and `db`.
    fn backward(
        &mut self,
        chunk: &Range<usize>,
        row_grads: &[RowGradient],
        grads: &mut CudaLinearGradients<'_>,
        first_chunk: bool,
    ) -> Result<(), LossError> {
        let (h, v, n) = (self.hidden_size(), self.vocab(), chunk.len());
        let stream = self.device.stream().clone();
        let block = self.block(chunk);
        let (dz, dz_type, _d, kernel) = match &self.dz {
            Some(dz) => {
                let (p, guard) = dz.device_ptr(&stream);
                (p, T::BLAS_TYPE, Some(guard), format!("row_gradient_f32_to_{}", T::SUFFIX))
            }
            None => (block.logits, <f32 as CudaElement>::BLAS_TYPE, None, "row_gradient_f32".to_string()),
        };
        self.device.row_gradient(&kernel, block, dz, row_grads)?;
        let blas = self.device.blas()?;
        let size = std::mem::size_of::<T>() as u64;
        let (hidden, _h) = self.inputs.hidden.device_ptr(&stream);
        let (weight, _w) = self.inputs.weight.device_ptr(&stream);
        let hc = hidden + (chunk.start * h) as u64 * size;
        let dz_op = |transposed| Operand { ptr: dz, ld: v, dtype: dz_type, transposed };
        {
            let (dh, _g) = grads.hidden.device_ptr(&stream);
            let w = Operand { ptr: weight, ld: h, dtype: T::BLAS_TYPE, transposed: false };
            gemm(blas, (n, h, v), dz_op(false), w, dh + 4 * (chunk.start * h) as u64, h, 0.0)?;
        }
        if let Some(dw) = grads.weight.as_deref() {
            let (dw, _g) = dw.device_ptr(&stream);
            let hc = Operand { ptr: hc, ld: h, dtype: T::BLAS_TYPE, transposed: false };
            gemm(blas, (v, h, n), dz_op(true), hc, dw, h, if first_chunk { 0.0 } else { 1.0 })?;
        }
        if let Some(db) = grads.bias.as_deref() {
            let (db, _g) = db.device_ptr(&stream);
            let suffix = if self.dz.is_some() { T::SUFFIX } else { "f32" };
            let function = self.device.function(&format!("bias_grad_{suffix}"))?;
            let (rows, vocab, accumulate) = (n as i32, vocab_i32(v)?, i32::from(!first_chunk));
            let mut launch = stream.launch_builder(&function);
            launch.arg(&dz).arg(&db).arg(&rows).arg(&vocab).arg(&accumulate);
            // SAFETY: matches `bias_grad_*`: `dz` holds rows*vocab values of the suffix's type,
            // `db` vocab floats; one thread per column.
            unsafe { launch.launch(CudaDevice::per_item(v, usize::MAX)) }.map_err(cuda_error("launching bias_grad"))?;
        }
        Ok(())
    }
}

impl CudaDevice {
    /// The loss and per-token outputs of `hidden @ weight^T (+ bias)` on this device, no gradient.
    pub fn linear_forward<T: CudaElement>(
        &self,
        spec: LossSpec<'_>,
        inputs: CudaLinearInputs<'_, T>,
        budget: ChunkBudget,
    ) -> Result<LossOutput, LossError> {
        let prepared = PreparedLoss::new(spec)?;
        if spec.rows.is_empty() {
            return Ok(prepared.objective(&[])?.0);
        }
        let mut streamer = Streamer::new(self, &prepared, inputs, budget, false)?;
        let mut stats = Vec::with_capacity(spec.rows.len());
        for chunk in streamer.chunks() {
            streamer.logits(&chunk)?;
            stats.extend(streamer.statistics(&chunk)?);
        }
        Ok(prepared.objective(&stats)?.0)
    }

    /// The loss, per-token outputs, and the f32 gradients with respect to `hidden`, `weight` and
    /// `bias` (those asked for) on this device.
    pub fn linear_forward_backward<T: CudaElement>(
        &self,
        spec: LossSpec<'_>,
        inputs: CudaLinearInputs<'_, T>,
        mut grads: CudaLinearGradients<'_>,
        budget: ChunkBudget,
    ) -> Result<LossOutput, LossError> {
        let prepared = PreparedLoss::new(spec)?.expecting_gradient()?;
        let rows = &spec.rows;
        let (weight, bias) = (grads.weight.as_deref().map(CudaSlice::len), grads.bias.as_deref().map(CudaSlice::len));
        shapes::check_gradients(rows, inputs.hidden_size, rows.vocab, grads.hidden.len(), weight, bias)?;
        if rows.is_empty() {
            // No rows: no logits, and zero gradients for the lm_head.
            for g in [grads.weight.as_deref_mut(), grads.bias.as_deref_mut()].into_iter().flatten() {
                self.stream().memset_zeros(g).map_err(cuda_error("zeroing a gradient"))?;
            }
            return Ok(prepared.objective(&[])?.0);
        }
        let mut streamer = Streamer::new(self, &prepared, inputs, budget, true)?;
        let active = prepared.active_rows();
        let chunks = streamer.chunks();
        let output = if let Some(objective) = prepared.row_local_objective() {
            let (mut all_stats, mut outcomes) = (Vec::with_capacity(rows.len()), Vec::with_capacity(rows.len()));
            for (i, chunk) in chunks.iter().enumerate() {
                streamer.logits(chunk)?;
                let partial = streamer.statistics(chunk)?;
                let (stats, chunk_outcomes): (Vec<_>, Vec<_>) =
                    objective.block(active, rows.vocab, chunk.start, &partial).into_iter().unzip();
                let row_grads: Vec<RowGradient> = chunk_outcomes.iter().map(|o| o.grad).collect();
                streamer.backward(chunk, &row_grads, &mut grads, i == 0)?;
                all_stats.extend(stats);
                outcomes.extend(chunk_outcomes);
            }
            objective.output(rows, active, &all_stats, &outcomes)
        } else {
            let mut partial = Vec::with_capacity(rows.len());
            for chunk in &chunks {
                streamer.logits(chunk)?;
                partial.extend(streamer.statistics(chunk)?);
            }
            let (output, row_grads) = prepared.objective(&partial)?;
            for (i, chunk) in chunks.iter().enumerate() {
                streamer.logits(chunk)?;
                streamer.backward(chunk, &row_grads[chunk.clone()], &mut grads, i == 0)?;
            }
            output
        };
        self.synchronize()?;
        Ok(output)
    }
}

impl CudaDevice {
    /// The rate of cuBLAS's product on the fused-linear forward shape (`[rows, h] @ [h, vocab]`,
    /// `T` operands, f32 output) on this device, in TFLOP/s: median of ten after two warm-ups, on
    /// random operands (never zeros: they run faster than real data).
    pub fn matmul_tflops<T: CudaElement>(
        &self,
        rows: usize,
        hidden_size: usize,
        vocab: usize,
    ) -> Result<f64, LossError> {
        let (n, h, v) = (rows.max(1), hidden_size.max(1), vocab.max(1));
        let random = |len: usize, seed: u64| -> Vec<T> {
            crate::synthetic::normal_matrix(1, len, 1.0, seed).iter().map(|&x| T::from_f32(x)).collect()
        };
        let hidden = self.upload(&random(n * h, 1))?;
        let weight = self.upload(&random(v * h, 2))?;
        let z = self.zeros::<f32>(n * v)?;
        let stream = self.stream().clone();
        let (hp, _h) = hidden.device_ptr(&stream);
        let (wp, _w) = weight.device_ptr(&stream);
        let (zp, _z) = z.device_ptr(&stream);
        let a = Operand { ptr: hp, ld: h, dtype: T::BLAS_TYPE, transposed: false };
        let b = Operand { ptr: wp, ld: h, dtype: T::BLAS_TYPE, transposed: true };
        let blas = self.blas()?;
        let mut times = Vec::new();
        for i in 0..12 {
            let ((), ms) = self.time_ms::<_, LossError>(|| gemm(blas, (n, v, h), a, b, zp, v, 0.0))?;
            if i >= 2 {
                times.push(ms as f64 / 1e3);
            }
        }
        times.sort_by(f64::total_cmp);
        Ok(2.0 * (n * h * v) as f64 / times[times.len() / 2] / 1e12)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_fit_the_budget_and_are_even() {
        // bf16 at V = 151936: 6 bytes a column per row (f32 logits + bf16 dz).
        let rows = rows_per_chunk::<half::bf16>(4096, 151_936, ChunkBudget::from_mb(1024));
        assert!(rows * 151_936 * 6 <= 1024 << 20, "{rows}");
        assert!(4096usize.div_ceil(rows) * rows - 4096 < rows);
        assert_eq!(rows_per_chunk::<f32>(10, 1000, ChunkBudget::from_mb(1024)), 10);
        assert_eq!(rows_per_chunk::<f32>(10, 1000, ChunkBudget::from_bytes(1)), 1);
    }
}

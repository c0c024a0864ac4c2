//! Fused-linear losses on the GPU: the loss of `logits = hidden @ weight^T (+ bias)` from `hidden
//! [N, H]` and `weight [V, H]` on the device, in chunks of rows so that the `[N, V]` logits never
//! exist whole. Per chunk: cuBLAS writes the chunk's f32 logits, rows.cu's statistics pass reads
//! them, the host evaluates the objective, the gradient pass writes `dz` (over the f32 logits for
//! f32 inputs; in the inputs' dtype for f16 / bf16, so the two backward products run on tensor
//! cores), and cuBLAS turns it into `dh = dz @ W` and `dW += dz^T @ h`.
//!
//! As on the CPU ([`crate::linear`]): row-local objectives take three products per chunk in one
//! pass; sequence-level GRPO needs every row's statistics first, so it recomputes the logits in a
//! second pass (four products). Only active rows go through the products (a masked row's, or an
//! ignored target's, logits are never read and its gradient rows are zero): the chunks hold the
//! active rows alone, gathered by rows.cu's `gather_rows_*` where a masked row falls between them,
//! their `d hidden` scattered back, and the skipped rows' `d hidden` zeroed. Gradients are f32,
//! overwritten.

use std::ops::Range;

use cudarc::driver::{CudaSlice, DevicePtr, PushKernelArg};

use super::blas::{gemm, Operand};
use super::device::{cuda_error, optional_ptr, CudaDevice, CudaElement};
use super::passes::{vocab_i32, RowBlock};
use crate::engine::{LossSpec, PreparedLoss};
use crate::error::LossError;
use crate::linear::{shapes, ChunkBudget};
use crate::objective::{LossOutput, RowGradient, RowOutcome};
use crate::stats::{PartialRowStats, RowStats};

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

/// The rows of `prepared`'s batch that go through the products, ascending: the active ones.
fn computed_rows(prepared: &PreparedLoss<'_>) -> Vec<usize> {
    (0..prepared.spec().rows.len()).filter(|&i| prepared.active_rows()[i]).collect()
}

/// The first of `rows` when they are consecutive (a chunk with no skipped row inside: its hidden
/// states and `d hidden` are read and written in place).
fn consecutive(rows: &[usize]) -> Option<usize> {
    let first = *rows.first()?;
    rows.iter().enumerate().all(|(k, &r)| r == first + k).then_some(first)
}

/// One fused-linear call's device state: the inputs' pointers, the chunk buffers, the O(N) inputs.
/// Chunks are ranges of `computed`, and the row passes see the computed rows alone (their targets
/// in that order, no mask: every one is active).
struct Streamer<'d, 'p, 'a, T> {
    device: &'d CudaDevice,
    prepared: &'p PreparedLoss<'a>,
    inputs: CudaLinearInputs<'p, T>,
    chunk_rows: usize,
    /// f32 logits of one chunk, `[chunk_rows, V]`; `dz` in place for f32 inputs.
    z: CudaSlice<f32>,
    /// `dz` in the inputs' dtype (f16 / bf16 inputs only).
    dz: Option<CudaSlice<T>>,
    /// The batch rows that go through the products, ascending (not empty).
    computed: Vec<usize>,
    /// The targets of the computed rows, in their order.
    targets: Option<CudaSlice<i64>>,
    stats: CudaSlice<f32>,
    /// Where some row is skipped: `computed` on the device, and a chunk's gathered hidden states
    /// `[chunk_rows, H]` and `d hidden` (f32) for chunks whose rows are not consecutive.
    gathering: Option<Gathering<T>>,
}

/// The buffers of chunks whose rows are not consecutive.
struct Gathering<T> {
    index: CudaSlice<i64>,
    hidden: CudaSlice<T>,
    grad: CudaSlice<f32>,
}

impl<'d, 'p, 'a, T: CudaElement> Streamer<'d, 'p, 'a, T> {
    /// For the rows `computed` (not empty) of `prepared`'s batch, whose inputs the caller checked.
    fn new(
        device: &'d CudaDevice,
        prepared: &'p PreparedLoss<'a>,
        inputs: CudaLinearInputs<'p, T>,
        computed: Vec<usize>,
        budget: ChunkBudget,
        gradient: bool,
    ) -> Result<Self, LossError> {
        let rows = &prepared.spec().rows;
        let (h, v) = (inputs.hidden_size, rows.vocab);
        let chunk_rows = rows_per_chunk::<T>(computed.len(), v, budget);
        let separate_dz = gradient && T::as_f32_slice(&[]).is_none();
        let targets: Option<Vec<i64>> = rows.targets.map(|t| computed.iter().map(|&i| t[i]).collect());
        let gathering = if computed.len() < rows.len() {
            let index: Vec<i64> = computed.iter().map(|&i| i as i64).collect();
            let hidden = device.zeros(chunk_rows * h)?;
            let grad = if gradient { device.zeros(chunk_rows * h)? } else { device.zeros(1)? };
            Some(Gathering { index: device.upload(&index)?, hidden, grad })
        } else {
            None
        };
        Ok(Self {
            device,
            prepared,
            inputs,
            chunk_rows,
            z: device.zeros(chunk_rows * v)?,
            dz: if separate_dz { Some(device.zeros(chunk_rows * v)?) } else { None },
            targets: targets.map(|t| device.upload(&t)).transpose()?,
            stats: device.zeros(chunk_rows * 5)?,
            computed,
            gathering,
        })
    }

    /// Ranges of `computed`.
    fn chunks(&self) -> Vec<Range<usize>> {
        let (n, step) = (self.computed.len(), self.chunk_rows);
        (0..n).step_by(step).map(|r| r..(r + step).min(n)).collect()
    }

    /// The batch rows of a chunk.
    fn rows(&self, chunk: &Range<usize>) -> &[usize] {
        &self.computed[chunk.clone()]
    }

    /// The pointer to the chunk's hidden states `[chunk.len(), H]`: in place where its rows are
    /// consecutive, else gathered (by the chunk's [`logits`](Self::logits), before the backward
    /// products read them again).
    fn chunk_hidden(&self, chunk: &Range<usize>) -> u64 {
        let stream = self.device.stream();
        if let Some(first) = consecutive(self.rows(chunk)) {
            let (hidden, _h) = self.inputs.hidden.device_ptr(stream);
            return hidden + (first * self.hidden_size() * std::mem::size_of::<T>()) as u64;
        }
        let gathering = self.gathering.as_ref().expect("rows are skipped only with a gathering");
        let (hidden, _h) = gathering.hidden.device_ptr(stream);
        hidden
    }

    /// `gather_rows_*` or `scatter_rows_f32` of the chunk's rows between `from` and `to`.
    fn move_rows(&self, kernel: &str, chunk: &Range<usize>, from: u64, to: u64) -> Result<(), LossError> {
        let stream = self.device.stream();
        let gathering = self.gathering.as_ref().expect("rows are skipped only with a gathering");
        let (index, _i) = gathering.index.device_ptr(stream);
        let index = index + 8 * chunk.start as u64;
        let h = self.hidden_size();
        let width =
            i32::try_from(h).map_err(|_| LossError::Cuda(format!("a hidden size of {h} exceeds the kernels' i32")))?;
        let rows = chunk.len() as i64;
        let function = self.device.function(kernel)?;
        let mut launch = stream.launch_builder(&function);
        launch.arg(&from).arg(&to).arg(&index).arg(&rows).arg(&width);
        // SAFETY: matches `gather_rows_*` / `scatter_rows_f32`: `index` holds the chunk's rows'
        // indices (each below the batch's rows), the gathered side `rows * width` elements, the
        // batch side `[N, width]`.
        unsafe { launch.launch(CudaDevice::per_item(chunk.len() * self.hidden_size(), 65_536)) }
            .map_err(cuda_error("launching a row gather or scatter"))?;
        Ok(())
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
        if consecutive(self.rows(chunk)).is_none() {
            let (hidden, _h) = self.inputs.hidden.device_ptr(&stream);
            self.move_rows(&format!("gather_rows_{}", T::SUFFIX), chunk, hidden, self.chunk_hidden(chunk))?;
        }
        let (weight, _w) = self.inputs.weight.device_ptr(&stream);
        let hc = Operand { ptr: self.chunk_hidden(chunk), ld: h, dtype: T::BLAS_TYPE, transposed: false };
        let wt = Operand { ptr: weight, ld: h, dtype: T::BLAS_TYPE, transposed: true };
        let beta = if self.inputs.bias.is_some() { 1.0 } else { 0.0 };
        gemm(self.device.blas()?, (chunk.len(), v, h), hc, wt, z, v, beta)
    }

    /// The row block of the chunk's logits in `self.z`.
    fn block(&self, chunk: &Range<usize>) -> RowBlock {
        let stream = self.device.stream();
        let (z, _z) = self.z.device_ptr(stream);
        let (targets, _t) = optional_ptr(self.targets.as_ref(), stream);
        let computed = RowBlock {
            logits: 0,
            rows: self.computed.len(),
            vocab: self.vocab(),
            inv_temperature: (1.0 / self.prepared.spec().options.temperature) as f32,
            targets,
            active: 0,
        };
        // The chunk's targets are the computed rows'; its logits are `z` from its first row.
        RowBlock { logits: z, ..computed.rows_of(chunk, 0) }
    }

    /// The chunk's partial statistics (after [`logits`](Self::logits)), checked for NaN / Inf.
    fn statistics(&mut self, chunk: &Range<usize>) -> Result<Vec<PartialRowStats>, LossError> {
        let block = self.block(chunk);
        let rows = &self.computed[chunk.clone()];
        self.device.row_stats("f32", block, &mut self.stats, self.prepared, |k| rows[k])
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
        let (weight, _w) = self.inputs.weight.device_ptr(&stream);
        let hc = self.chunk_hidden(chunk);
        let dz_op = |transposed| Operand { ptr: dz, ld: v, dtype: dz_type, transposed };
        {
            let (dh, _g) = grads.hidden.device_ptr(&stream);
            let w = Operand { ptr: weight, ld: h, dtype: T::BLAS_TYPE, transposed: false };
            match consecutive(self.rows(chunk)) {
                Some(first) => gemm(blas, (n, h, v), dz_op(false), w, dh + 4 * (first * h) as u64, h, 0.0)?,
                None => {
                    let gathering = self.gathering.as_ref().expect("rows are skipped only with a gathering");
                    let (gathered, _g) = gathering.grad.device_ptr(&stream);
                    gemm(blas, (n, h, v), dz_op(false), w, gathered, h, 0.0)?;
                    self.move_rows("scatter_rows_f32", chunk, gathered, dh)?;
                }
            }
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
        let rows = &spec.rows;
        let bias = inputs.bias.map(CudaSlice::len);
        shapes::check_inputs(rows, inputs.hidden_size, rows.vocab, inputs.hidden.len(), inputs.weight.len(), bias)?;
        let computed = computed_rows(&prepared);
        // A skipped row's statistics, as the row passes give an inactive row.
        let mut stats = vec![PartialRowStats::EMPTY; rows.len()];
        if !computed.is_empty() {
            let mut streamer = Streamer::new(self, &prepared, inputs, computed, budget, false)?;
            for chunk in streamer.chunks() {
                streamer.logits(&chunk)?;
                let got = streamer.statistics(&chunk)?;
                for (&row, s) in streamer.rows(&chunk).iter().zip(got) {
                    stats[row] = s;
                }
            }
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
        let bias = inputs.bias.map(CudaSlice::len);
        shapes::check_inputs(rows, inputs.hidden_size, rows.vocab, inputs.hidden.len(), inputs.weight.len(), bias)?;
        let computed = computed_rows(&prepared);
        if computed.len() < rows.len() {
            // The skipped rows' `d hidden` (the computed rows' is overwritten).
            self.stream().memset_zeros(&mut *grads.hidden).map_err(cuda_error("zeroing a gradient"))?;
        }
        if computed.is_empty() {
            // No row goes through the products: zero gradients for the lm_head too.
            for g in [grads.weight.as_deref_mut(), grads.bias.as_deref_mut()].into_iter().flatten() {
                self.stream().memset_zeros(g).map_err(cuda_error("zeroing a gradient"))?;
            }
            self.synchronize()?;
            return Ok(prepared.objective(&vec![PartialRowStats::EMPTY; rows.len()])?.0);
        }
        let mut streamer = Streamer::new(self, &prepared, inputs, computed, budget, true)?;
        let active = prepared.active_rows();
        let chunks = streamer.chunks();
        let output = if let Some(objective) = prepared.row_local_objective() {
            // A skipped row's, as the row passes give an inactive row.
            let mut results = vec![(RowStats::default(), RowOutcome::ZERO); rows.len()];
            for (i, chunk) in chunks.iter().enumerate() {
                streamer.logits(chunk)?;
                let partial = streamer.statistics(chunk)?;
                let chunk_rows = streamer.rows(chunk);
                let done = objective.block(active, rows.vocab, |k| chunk_rows[k], &partial);
                let row_grads: Vec<RowGradient> = done.iter().map(|(_, o)| o.grad).collect();
                for (&row, r) in chunk_rows.iter().zip(done) {
                    results[row] = r;
                }
                streamer.backward(chunk, &row_grads, &mut grads, i == 0)?;
            }
            let (stats, outcomes): (Vec<_>, Vec<_>) = results.into_iter().unzip();
            objective.output(rows, active, &stats, &outcomes)
        } else {
            let mut partial = vec![PartialRowStats::EMPTY; rows.len()];
            for chunk in &chunks {
                streamer.logits(chunk)?;
                let got = streamer.statistics(chunk)?;
                for (&row, s) in streamer.rows(chunk).iter().zip(got) {
                    partial[row] = s;
                }
            }
            let (output, row_grads) = prepared.objective(&partial)?;
            for (i, chunk) in chunks.iter().enumerate() {
                streamer.logits(chunk)?;
                let chunk_grads: Vec<RowGradient> = streamer.rows(chunk).iter().map(|&row| row_grads[row]).collect();
                streamer.backward(chunk, &chunk_grads, &mut grads, i == 0)?;
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

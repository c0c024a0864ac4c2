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
use crate::linear::{computed_rows, consecutive, ranges, shapes, ChunkBudget};
use crate::objective::{LossOutput, Objective, RowGradient, RowOutcome};
use crate::stats::{inverse_temperature, PartialRowStats, RowStats};

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

/// Rows per chunk: as many as the budget holds (the chunk's f32 logits, its `dz` when that is in
/// another dtype, and, as on the CPU, its gathered hidden states and f32 `d hidden`), in chunks of
/// equal size.
fn rows_per_chunk<T: CudaElement>(n: usize, vocab: usize, hidden_size: usize, budget: ChunkBudget) -> usize {
    let size = std::mem::size_of::<T>();
    let separate_dz = if T::as_f32_slice(&[]).is_none() { size } else { 0 };
    let per_row = vocab.max(1) * (4 + separate_dz) + hidden_size * (size + 4);
    crate::linear::even_chunk_rows(n, budget.bytes / per_row)
}

/// The inputs' shapes against the batch's.
fn check_inputs<T: CudaElement>(
    prepared: &PreparedLoss<'_>,
    inputs: &CudaLinearInputs<'_, T>,
) -> Result<(), LossError> {
    let rows = &prepared.spec().rows;
    let bias = inputs.bias.map(CudaSlice::len);
    shapes::check_inputs(rows, inputs.hidden_size, rows.vocab, inputs.hidden.len(), inputs.weight.len(), bias)
}

/// One fused-linear call's device state: the inputs' pointers, the chunk buffers, the O(N) inputs.
/// Chunks are ranges of `computed` ([`computed_rows`]), and the row passes see the computed rows
/// alone (their targets in that order, no mask: every one is active).
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
    /// Only where some chunk has a masked row between its rows.
    gathering: Option<Gathering<T>>,
}

/// The buffers of chunks whose rows are not consecutive: `computed` on the device (the gathers'
/// indices), a chunk's gathered hidden states `[chunk_rows, H]` and its `d hidden` (f32).
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
        let chunk_rows = rows_per_chunk::<T>(computed.len(), v, h, budget);
        let separate_dz = gradient && T::as_f32_slice(&[]).is_none();
        let targets: Option<Vec<i64>> = rows.targets.map(|t| computed.iter().map(|&i| t[i]).collect());
        let gathering = if ranges(computed.len(), chunk_rows).into_iter().any(|c| consecutive(&computed[c]).is_none()) {
            let index: Vec<i64> = computed.iter().map(|&i| i as i64).collect();
            let hidden = device.zeros(chunk_rows * h)?;
            let grad = device.zeros(if gradient { chunk_rows * h } else { 1 })?;
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

    /// Ranges of `computed` (the ones `new` sized the gathering by).
    fn chunks(&self) -> Vec<Range<usize>> {
        ranges(self.computed.len(), self.chunk_rows)
    }

    /// The batch rows of a chunk.
    fn rows(&self, chunk: &Range<usize>) -> &[usize] {
        &self.computed[chunk.clone()]
    }

    fn gathering(&self) -> &Gathering<T> {
        self.gathering.as_ref().expect("`new` made gather buffers for a chunk with a gap")
    }

    fn hidden_size(&self) -> usize {
        self.inputs.hidden_size
    }

    fn vocab(&self) -> usize {
        self.prepared.spec().rows.vocab
    }

    /// The chunk's hidden states `[chunk.len(), H]` for its products: in place where its rows are
    /// consecutive, else gathered into the gather buffer (queued now, before the products that
    /// read them; the two-pass path gathers again for its second pass).
    fn hidden_of(&self, chunk: &Range<usize>) -> Result<u64, LossError> {
        let stream = self.device.stream();
        let (hidden, _h) = self.inputs.hidden.device_ptr(stream);
        if let Some(first) = consecutive(self.rows(chunk)) {
            return Ok(hidden + (first * self.hidden_size() * std::mem::size_of::<T>()) as u64);
        }
        let (gathered, _g) = self.gathering().hidden.device_ptr(stream);
        self.move_rows(&format!("gather_rows_{}", T::SUFFIX), chunk, hidden, gathered)?;
        Ok(gathered)
    }

    /// `gather_rows_*` or `scatter_rows_f32` of the chunk's rows between `from` and `to`.
    fn move_rows(&self, kernel: &str, chunk: &Range<usize>, from: u64, to: u64) -> Result<(), LossError> {
        let stream = self.device.stream();
        let (index, _i) = self.gathering().index.device_ptr(stream);
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
        unsafe { launch.launch(CudaDevice::per_item(chunk.len() * h, 65_536)) }
            .map_err(cuda_error("launching a row gather or scatter"))?;
        Ok(())
    }

    /// The chunk's f32 logits into `self.z`: the bias broadcast, then `+= h_chunk @ W^T`. Returns
    /// the chunk's hidden states (for [`backward`](Self::backward)).
    fn logits(&mut self, chunk: &Range<usize>) -> Result<u64, LossError> {
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
        let hidden = self.hidden_of(chunk)?;
        let (weight, _w) = self.inputs.weight.device_ptr(&stream);
        let hc = Operand { ptr: hidden, ld: h, dtype: T::BLAS_TYPE, transposed: false };
        let wt = Operand { ptr: weight, ld: h, dtype: T::BLAS_TYPE, transposed: true };
        let beta = if self.inputs.bias.is_some() { 1.0 } else { 0.0 };
        gemm(self.device.blas()?, (chunk.len(), v, h), hc, wt, z, v, beta)?;
        Ok(hidden)
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
            inv_temperature: inverse_temperature(self.prepared.spec().options.temperature),
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

    /// Every computed row's partial statistics, the skipped rows' as the row passes give an
    /// inactive row (pass 1 of the two-pass path, and the forward).
    fn statistics_of_all(&mut self) -> Result<Vec<PartialRowStats>, LossError> {
        let mut partial = vec![PartialRowStats::EMPTY; self.prepared.spec().rows.len()];
        for chunk in self.chunks() {
            self.logits(&chunk)?;
            let got = self.statistics(&chunk)?;
            for (&row, s) in self.rows(&chunk).iter().zip(got) {
                partial[row] = s;
            }
        }
        Ok(partial)
    }

    /// The one-pass path of a row-local objective: per chunk, logits, statistics, the chunk's
    /// objective on the host, then its gradient and products.
    fn sweep(
        &mut self,
        objective: &Objective<'_>,
        grads: &mut CudaLinearGradients<'_>,
    ) -> Result<LossOutput, LossError> {
        let prepared = self.prepared;
        let (rows, active) = (&prepared.spec().rows, prepared.active_rows());
        // A skipped row's, as the row passes give an inactive row.
        let mut results = vec![(RowStats::default(), RowOutcome::ZERO); rows.len()];
        for (i, chunk) in self.chunks().iter().enumerate() {
            let hidden = self.logits(chunk)?;
            let partial = self.statistics(chunk)?;
            let chunk_rows = self.rows(chunk);
            let temperature = prepared.spec().options.temperature;
            let done = objective.block(active, rows.vocab, temperature, |k| chunk_rows[k], &partial);
            let row_grads: Vec<RowGradient> = done.iter().map(|(_, o)| o.grad).collect();
            for (&row, r) in chunk_rows.iter().zip(done) {
                results[row] = r;
            }
            self.backward(chunk, hidden, &row_grads, grads, i == 0)?;
        }
        let (stats, outcomes): (Vec<_>, Vec<_>) = results.into_iter().unzip();
        // `cuda::prepare` refuses predicted tokens: were it to stop, the missing argmax would panic here.
        Ok(objective.output(rows, active, &stats, &outcomes, prepared.spec().options.predicted_tokens))
    }

    /// The two-pass path (sequence-level objectives): every row's statistics, the objective, then
    /// the gradients with the logits recomputed.
    fn two_passes(&mut self, grads: &mut CudaLinearGradients<'_>) -> Result<LossOutput, LossError> {
        let partial = self.statistics_of_all()?;
        let (output, row_grads) = self.prepared.objective(&partial)?;
        for (i, chunk) in self.chunks().iter().enumerate() {
            let hidden = self.logits(chunk)?;
            let chunk_grads: Vec<RowGradient> = self.rows(chunk).iter().map(|&row| row_grads[row]).collect();
            self.backward(chunk, hidden, &chunk_grads, grads, i == 0)?;
        }
        Ok(output)
    }

    /// `dz` of the chunk from its rows' gradient scalars, then `dh`, `dW` and `db` (`hidden`: the
    /// chunk's hidden states, as [`logits`](Self::logits) returned them).
    fn backward(
        &mut self,
        chunk: &Range<usize>,
        hidden: u64,
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
        let dz_op = |transposed| Operand { ptr: dz, ld: v, dtype: dz_type, transposed };
        self.hidden_gradient(chunk, dz_op(false), grads)?;
        if let Some(dw) = grads.weight.as_deref() {
            let (dw, _g) = dw.device_ptr(&stream);
            let hc = Operand { ptr: hidden, ld: h, dtype: T::BLAS_TYPE, transposed: false };
            gemm(self.device.blas()?, (v, h, n), dz_op(true), hc, dw, h, if first_chunk { 0.0 } else { 1.0 })?;
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

    /// `dh = dz @ W` of the chunk into its rows of the `d hidden` gradient: directly where they are
    /// consecutive, else into the gather buffer and scattered back.
    fn hidden_gradient(
        &self,
        chunk: &Range<usize>,
        dz: Operand,
        grads: &mut CudaLinearGradients<'_>,
    ) -> Result<(), LossError> {
        let (h, v, n, stream) = (self.hidden_size(), self.vocab(), chunk.len(), self.device.stream());
        let (weight, _w) = self.inputs.weight.device_ptr(stream);
        let w = Operand { ptr: weight, ld: h, dtype: T::BLAS_TYPE, transposed: false };
        let (dh, _g) = grads.hidden.device_ptr(stream);
        let blas = self.device.blas()?;
        match consecutive(self.rows(chunk)) {
            Some(first) => gemm(blas, (n, h, v), dz, w, dh + 4 * (first * h) as u64, h, 0.0),
            None => {
                let (gathered, _b) = self.gathering().grad.device_ptr(stream);
                gemm(blas, (n, h, v), dz, w, gathered, h, 0.0)?;
                self.move_rows("scatter_rows_f32", chunk, gathered, dh)
            }
        }
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
        let prepared = super::prepare(spec)?;
        check_inputs(&prepared, &inputs)?;
        let computed = computed_rows(&prepared);
        let partial = if computed.is_empty() {
            vec![PartialRowStats::EMPTY; spec.rows.len()]
        } else {
            Streamer::new(self, &prepared, inputs, computed, budget, false)?.statistics_of_all()?
        };
        Ok(prepared.objective(&partial)?.0)
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
        let prepared = super::prepare(spec)?.expecting_gradient()?;
        let rows = &spec.rows;
        let (weight, bias) = (grads.weight.as_deref().map(CudaSlice::len), grads.bias.as_deref().map(CudaSlice::len));
        shapes::check_gradients(rows, inputs.hidden_size, rows.vocab, grads.hidden.len(), weight, bias)?;
        check_inputs(&prepared, &inputs)?;
        let computed = computed_rows(&prepared);
        self.zero_skipped_gradients(&mut grads, computed.len(), rows.len())?;
        if computed.is_empty() {
            return Ok(prepared.objective(&vec![PartialRowStats::EMPTY; rows.len()])?.0);
        }
        let mut streamer = Streamer::new(self, &prepared, inputs, computed, budget, true)?;
        let output = match prepared.row_local_objective() {
            Some(objective) => streamer.sweep(&objective, &mut grads)?,
            None => streamer.two_passes(&mut grads)?,
        };
        self.synchronize()?;
        Ok(output)
    }

    /// Zeros where no product writes: `d hidden` when some of the `rows` rows are skipped (the
    /// `computed` ones' is overwritten), and the lm_head's gradients when none is computed.
    fn zero_skipped_gradients(
        &self,
        grads: &mut CudaLinearGradients<'_>,
        computed: usize,
        rows: usize,
    ) -> Result<(), LossError> {
        let zero = |g: &mut CudaSlice<f32>| self.stream().memset_zeros(g).map_err(cuda_error("zeroing a gradient"));
        if computed < rows {
            zero(&mut *grads.hidden)?;
        }
        if computed == 0 {
            for g in [grads.weight.as_deref_mut(), grads.bias.as_deref_mut()].into_iter().flatten() {
                zero(g)?;
            }
            self.synchronize()?;
        }
        Ok(())
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
        // bf16 at V = 151936, H = 1536: 6 bytes a column (f32 logits + bf16 dz) and 6 a hidden
        // unit (gathered bf16 hidden state + f32 d hidden) per row.
        let rows = rows_per_chunk::<half::bf16>(4096, 151_936, 1536, ChunkBudget::from_mb(1024));
        assert!(rows * (151_936 * 6 + 1536 * 6) <= 1024 << 20, "{rows}");
        assert!(4096usize.div_ceil(rows) * rows - 4096 < rows);
        assert_eq!(rows_per_chunk::<f32>(10, 1000, 64, ChunkBudget::from_mb(1024)), 10);
        assert_eq!(rows_per_chunk::<f32>(10, 1000, 64, ChunkBudget::from_bytes(1)), 1);
    }
}

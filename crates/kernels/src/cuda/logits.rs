//! Losses of `[N, V]` logits already on the GPU: statistics on the GPU, the token objective on the
//! host, the gradient on the GPU (into a separate buffer, or over the logits: then the peak is the
//! logits and O(N)). Row-local objectives overlap the host's part with the GPU's (`overlap`).

use cudarc::driver::{CudaSlice, DevicePtr};

use super::device::{optional_ptr, CudaDevice, CudaElement};
use super::passes::{active_mask, RowBlock};
use super::phases::PhaseClock;
use crate::engine::{LossSpec, PreparedLoss};
use crate::error::LossError;
use crate::objective::{LossOutput, RowGradient};
use crate::stats::inverse_temperature;

/// Steps 1 and 2's results.
struct Evaluated {
    output: LossOutput,
    grads: Vec<RowGradient>,
}

/// The O(N) inputs of a call on the device, kept alive while its passes run.
struct RowInputs {
    block: RowBlock,
    _targets: Option<CudaSlice<i64>>,
    _active: CudaSlice<f32>,
}

impl CudaDevice {
    /// `logits` checked against the batch's shape, and the targets and mask copied up (`None` for
    /// an empty batch).
    fn row_inputs<T: CudaElement>(
        &self,
        prepared: &PreparedLoss<'_>,
        logits: &CudaSlice<T>,
    ) -> Result<Option<RowInputs>, LossError> {
        let spec = prepared.spec();
        let rows = &spec.rows;
        let n = rows.len();
        if logits.len() != n * rows.vocab {
            return Err(LossError::Shape {
                tensor: "logits",
                got: vec![logits.len()],
                expected: format!("it must hold N*V = {n}*{} elements", rows.vocab),
            });
        }
        if n == 0 {
            return Ok(None);
        }
        let targets = rows.targets.map(|t| self.upload(t)).transpose()?;
        let active = self.upload(&active_mask(prepared.active_rows()))?;
        let block = {
            let (targets_ptr, _t) = optional_ptr(targets.as_ref(), self.stream());
            let (active_ptr, _a) = active.device_ptr(self.stream());
            let (logits_ptr, _l) = logits.device_ptr(self.stream());
            RowBlock {
                logits: logits_ptr,
                rows: n,
                vocab: rows.vocab,
                inv_temperature: inverse_temperature(spec.options.temperature),
                targets: targets_ptr,
                active: active_ptr,
            }
        };
        Ok(Some(RowInputs { block, _targets: targets, _active: active }))
    }

    /// Runs steps 1 and 2 on `logits`, then `then` with the row block (its O(N) inputs on the
    /// device while it runs) and the row gradients.
    fn with_statistics<T: CudaElement, R>(
        &self,
        prepared: &PreparedLoss<'_>,
        logits: &CudaSlice<T>,
        mut clock: PhaseClock,
        then: impl FnOnce(RowBlock, Evaluated, PhaseClock) -> Result<R, LossError>,
    ) -> Result<R, LossError> {
        let Some(inputs) = self.row_inputs(prepared, logits)? else {
            let vocab = prepared.spec().rows.vocab;
            let block = RowBlock { logits: 0, rows: 0, vocab, inv_temperature: 1.0, targets: 0, active: 0 };
            let (output, grads) = prepared.objective(&[])?;
            return then(block, Evaluated { output, grads }, clock);
        };
        clock.mark("inputs");
        let mut out = self.zeros::<f32>(inputs.block.rows * 5)?;
        let stats = self.row_stats(T::SUFFIX, inputs.block, &mut out, prepared, |k| k)?;
        clock.mark("statistics");
        let (output, grads) = prepared.objective(&stats)?;
        clock.mark("objective");
        then(inputs.block, Evaluated { output, grads }, clock)
    }

    /// The loss and per-token outputs of `logits` on this device.
    pub fn forward<T: CudaElement>(&self, spec: LossSpec<'_>, logits: &CudaSlice<T>) -> Result<LossOutput, LossError> {
        let mut clock = PhaseClock::start(spec.rows.len());
        let prepared = super::prepare(spec)?;
        clock.mark("prepare");
        self.with_statistics(&prepared, logits, clock, |_, evaluated, clock| {
            clock.report();
            Ok(evaluated.output)
        })
    }

    /// Forward and backward: the gradient into `grad` (same shape and dtype as `logits`), or, with
    /// `grad = None`, over the logits themselves. A row-local objective is evaluated a block of
    /// rows at a time while the GPU streams the next block (`overlap`); others between the two
    /// whole passes. NaN or Inf logits are an error naming the lowest such row, found as the
    /// statistics come back: in place, earlier blocks' logits may have been overwritten by then.
    pub fn forward_backward<T: CudaElement>(
        &self,
        spec: LossSpec<'_>,
        logits: &mut CudaSlice<T>,
        grad: Option<&mut CudaSlice<T>>,
    ) -> Result<LossOutput, LossError> {
        let mut clock = PhaseClock::start(spec.rows.len());
        let prepared = super::prepare(spec)?.expecting_gradient()?;
        clock.mark("prepare");
        if let Some(g) = grad.as_ref().filter(|g| g.len() != logits.len()) {
            return Err(LossError::GradientBuffer { got: g.len(), expected: logits.len() });
        }
        let (grad_ptr, _g) = optional_ptr(grad.as_deref(), self.stream());
        if let Some(objective) = prepared.row_local_objective() {
            if let Some(inputs) = self.row_inputs(&prepared, logits)? {
                clock.mark("inputs");
                let target = if grad_ptr != 0 { grad_ptr } else { inputs.block.logits };
                let result =
                    self.forward_backward_overlapped::<T>(&prepared, &objective, inputs.block, target, &mut clock);
                // Also after an error: blocks' passes and copies may still be queued, and the
                // caller may free what they write as soon as this returns.
                let synchronized = self.synchronize();
                let output = result?;
                synchronized?;
                clock.mark("gradient");
                clock.report();
                return Ok(output);
            }
        }
        self.with_statistics(&prepared, logits, clock, |block, Evaluated { output, grads }, mut clock| {
            let target = if grad_ptr != 0 { grad_ptr } else { block.logits };
            self.row_gradient(&format!("row_gradient_{}", T::SUFFIX), block, target, &grads)?;
            self.synchronize()?;
            clock.mark("gradient");
            clock.report();
            Ok(output)
        })
    }
}

//! Losses of `[N, V]` logits already on the GPU: statistics on the GPU, the token objective on the
//! host, the gradient on the GPU (into a separate buffer, or over the logits: then the peak is the
//! logits and O(N)).

use cudarc::driver::{CudaSlice, DevicePtr};

use super::device::{optional_ptr, CudaDevice, CudaElement};
use super::passes::{active_mask, RowBlock};
use super::phases::PhaseClock;
use crate::engine::{LossSpec, PreparedLoss};
use crate::error::LossError;
use crate::objective::{LossOutput, RowGradient};

/// Steps 1 and 2's results.
struct Evaluated {
    output: LossOutput,
    grads: Vec<RowGradient>,
}

impl CudaDevice {
    /// Runs steps 1 and 2 on `logits`, then `then` with the row block (its O(N) inputs on the
    /// device while it runs) and the row gradients.
    fn with_statistics<T: CudaElement, R>(
        &self,
        prepared: &PreparedLoss<'_>,
        logits: &CudaSlice<T>,
        mut clock: PhaseClock,
        then: impl FnOnce(RowBlock, Evaluated, PhaseClock) -> Result<R, LossError>,
    ) -> Result<R, LossError> {
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
            let block = RowBlock { logits: 0, rows: 0, vocab: rows.vocab, inv_temperature: 1.0, targets: 0, active: 0 };
            let (output, grads) = prepared.objective(&[])?;
            return then(block, Evaluated { output, grads }, clock);
        }
        let targets = rows.targets.map(|t| self.upload(t)).transpose()?;
        let active = self.upload(&active_mask(prepared.active_rows()))?;
        let mut out = self.zeros::<f32>(n * 5)?;
        let (targets_ptr, _t) = optional_ptr(targets.as_ref(), self.stream());
        let (active_ptr, _a) = active.device_ptr(self.stream());
        let (logits_ptr, _l) = logits.device_ptr(self.stream());
        let block = RowBlock {
            logits: logits_ptr,
            rows: n,
            vocab: rows.vocab,
            inv_temperature: (1.0 / spec.options.temperature) as f32,
            targets: targets_ptr,
            active: active_ptr,
        };
        clock.mark("inputs");
        let stats = self.row_stats(T::SUFFIX, block, &mut out, prepared, 0)?;
        clock.mark("statistics");
        let (output, grads) = prepared.objective(&stats)?;
        clock.mark("objective");
        then(block, Evaluated { output, grads }, clock)
    }

    /// The loss and per-token outputs of `logits` on this device.
    pub fn forward<T: CudaElement>(&self, spec: LossSpec<'_>, logits: &CudaSlice<T>) -> Result<LossOutput, LossError> {
        let mut clock = PhaseClock::start(spec.rows.len());
        let prepared = PreparedLoss::new(spec)?;
        clock.mark("prepare");
        self.with_statistics(&prepared, logits, clock, |_, evaluated, clock| {
            clock.report();
            Ok(evaluated.output)
        })
    }

    /// Forward and backward: the gradient into `grad` (same shape and dtype as `logits`), or, with
    /// `grad = None`, over the logits themselves.
    pub fn forward_backward<T: CudaElement>(
        &self,
        spec: LossSpec<'_>,
        logits: &mut CudaSlice<T>,
        grad: Option<&mut CudaSlice<T>>,
    ) -> Result<LossOutput, LossError> {
        let mut clock = PhaseClock::start(spec.rows.len());
        let prepared = PreparedLoss::new(spec)?.expecting_gradient()?;
        clock.mark("prepare");
        if let Some(g) = grad.as_ref().filter(|g| g.len() != logits.len()) {
            return Err(LossError::GradientBuffer { got: g.len(), expected: logits.len() });
        }
        let (grad_ptr, _g) = optional_ptr(grad.as_deref(), self.stream());
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

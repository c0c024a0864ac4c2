//! The row passes of rows.cu, launched over a block of consecutive rows given by raw device
//! pointers (the whole logits, or one chunk of fused-linear's), and the conversions of their O(N)
//! inputs and outputs between the host and the GPU.

use std::ops::Range;

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::device::{cuda_error, CudaDevice};
use crate::cpu::non_finite;
use crate::engine::PreparedLoss;
use crate::error::LossError;
use crate::inputs::Rows;
use crate::objective::RowGradient;
use crate::stats::PartialRowStats;

/// A block of `rows` consecutive rows of `vocab` logits on the GPU, with the per-row inputs of the
/// same rows (null pointers where absent).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowBlock {
    pub logits: u64,
    pub rows: usize,
    pub vocab: usize,
    pub inv_temperature: f32,
    /// `i64` targets of these rows, or 0.
    pub targets: u64,
    /// `f32` 0/1 of these rows (0: skipped), or 0.
    pub active: u64,
}

impl RowBlock {
    /// The rows `range` of this block (`element_bytes`: the size of one logit).
    pub fn rows_of(&self, range: &Range<usize>, element_bytes: usize) -> RowBlock {
        let offset =
            |ptr: u64, bytes_per_row: usize| if ptr == 0 { 0 } else { ptr + (range.start * bytes_per_row) as u64 };
        RowBlock {
            logits: offset(self.logits, self.vocab * element_bytes),
            rows: range.len(),
            targets: offset(self.targets, 8),
            active: offset(self.active, 4),
            ..*self
        }
    }
}

pub(crate) fn vocab_i32(vocab: usize) -> Result<i32, LossError> {
    i32::try_from(vocab).map_err(|_| LossError::Cuda(format!("a vocabulary of {vocab} exceeds the kernels' i32")))
}

impl CudaDevice {
    /// Statistics pass: `row_stats_{suffix}` over the block, whose `k`-th row is `prepared`'s
    /// batch row `row_of(k)` (five floats per row through `out`, at least `5 * block.rows` long),
    /// copied back and checked for NaN / Inf.
    pub(crate) fn row_stats(
        &self,
        suffix: &str,
        block: RowBlock,
        out: &mut CudaSlice<f32>,
        prepared: &PreparedLoss<'_>,
        row_of: impl Fn(usize) -> usize,
    ) -> Result<Vec<PartialRowStats>, LossError> {
        self.launch_row_stats(suffix, block, out)?;
        if block.rows == 0 {
            return Ok(Vec::new());
        }
        let raw = self.stream().clone_dtoh(&out.slice(..5 * block.rows)).map_err(cuda_error("copying from the GPU"))?;
        self.checked_stats(&raw, prepared, row_of)
    }

    /// The statistics pass queued on the stream, not waited for.
    pub(crate) fn launch_row_stats(
        &self,
        suffix: &str,
        block: RowBlock,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), LossError> {
        if out.len() < 5 * block.rows {
            return Err(LossError::Cuda(format!("{} statistics for {} rows", out.len() / 5, block.rows)));
        }
        if block.rows == 0 {
            return Ok(());
        }
        let vocab = vocab_i32(block.vocab)?;
        let function = self.function(&format!("row_stats_{suffix}"))?;
        let mut launch = self.stream().launch_builder(&function);
        launch
            .arg(&block.logits)
            .arg(&vocab)
            .arg(&block.inv_temperature)
            .arg(&block.targets)
            .arg(&block.active)
            .arg(&mut *out);
        // SAFETY: the arguments match `row_stats_*`'s signature in rows.cu; the block's pointers hold
        // rows*vocab logits, `rows` targets and mask values (or are null), `out` 5*rows floats.
        unsafe { launch.launch(Self::per_row(block.rows)?) }.map_err(cuda_error("launching row_stats"))?;
        Ok(())
    }

    /// Statistics copied back (five floats a row, the `k`-th of batch row `row_of(k)`), checked
    /// for NaN / Inf.
    pub(crate) fn checked_stats(
        &self,
        raw: &[f32],
        prepared: &PreparedLoss<'_>,
        row_of: impl Fn(usize) -> usize,
    ) -> Result<Vec<PartialRowStats>, LossError> {
        let rows = &prepared.spec().rows;
        let stats = statistics_from(raw, rows.targets.is_some());
        check_finite(rows, prepared.active_rows(), row_of, &stats)?;
        Ok(stats)
    }

    /// Gradient pass: `kernel` (`row_gradient_*`) writes the block's gradient to `grad` (which may
    /// be `block.logits`) from the rows' gradient scalars.
    pub(crate) fn row_gradient(
        &self,
        kernel: &str,
        block: RowBlock,
        grad: u64,
        row_grads: &[RowGradient],
    ) -> Result<(), LossError> {
        if block.rows == 0 {
            return Ok(());
        }
        if row_grads.len() != block.rows {
            return Err(LossError::Cuda(format!("{} row gradients for {} rows", row_grads.len(), block.rows)));
        }
        let scalars = self.upload(&scalars_of(row_grads))?;
        let vocab = vocab_i32(block.vocab)?;
        let function = self.function(kernel)?;
        let mut launch = self.stream().launch_builder(&function);
        launch.arg(&block.logits).arg(&grad).arg(&vocab).arg(&block.inv_temperature).arg(&block.targets).arg(&scalars);
        // SAFETY: the arguments match `row_gradient_*`'s signature; `grad` holds as many elements
        // as the block's logits (or is the logits: each element is read before the same thread
        // writes it), `scalars` five floats per row.
        unsafe { launch.launch(Self::per_row(block.rows)?) }.map_err(cuda_error("launching row_gradient"))?;
        Ok(())
    }
}

/// The kernels' five floats per row as statistics. With targets, `target_u` is kept as written,
/// the f32 `u` the kernel's sums were taken of (active rows' targets are in range, so a NaN there
/// is a NaN logit, which the finiteness check must see); without targets (entropy), there is none.
fn statistics_from(raw: &[f32], with_targets: bool) -> Vec<PartialRowStats> {
    raw.chunks_exact(5)
        .map(|s| PartialRowStats {
            max: s[0],
            sum_exp: s[1],
            sum_exp_shifted: s[2],
            sum_u: s[3],
            target_u: with_targets.then_some(s[4] as f64),
            argmax: None, // `cuda::prepare` refuses `predicted_tokens`
        })
        .collect()
}

/// Five floats per row for the gradient kernels: `lse, a, b, c, d`.
fn scalars_of(grads: &[RowGradient]) -> Vec<f32> {
    grads.iter().flat_map(|g| [g.lse, g.a, g.b, g.c, g.d]).collect()
}

/// The NaN / Inf check of the statistics of rows `row_of(0), row_of(1), ...` (ascending): the
/// lowest active row with non-finite logits, named.
fn check_finite(
    rows: &Rows,
    active: &[bool],
    row_of: impl Fn(usize) -> usize,
    stats: &[PartialRowStats],
) -> Result<(), LossError> {
    match stats.iter().enumerate().position(|(k, s)| active[row_of(k)] && !s.is_finite()) {
        Some(k) => Err(non_finite(rows, row_of(k))),
        None => Ok(()),
    }
}

/// `active` as the kernels' 0/1 floats.
pub(crate) fn active_mask(active: &[bool]) -> Vec<f32> {
    active.iter().map(|&a| if a { 1.0 } else { 0.0 }).collect()
}

//! A logits-level forward and backward whose objective is row-local, with the host's objective
//! overlapped with the GPU's passes: the rows go in blocks, and while the host evaluates one
//! block's objective, the GPU computes the next block's statistics (and, queued before them, the
//! previous block's gradient). With the two whole passes around one whole objective, the GPU
//! waited for the host 0.23 – 0.52 ms of a 1.4 – 1.5 ms step at B=1 T=4096 and 1.3 – 1.7 ms of
//! 9.7 – 9.8 ms at B=16 T=2048 on an H200; in blocks, the same steps took 1.21 – 1.24 ms and
//! 8.56 ms (docs/BENCHMARKS.md, "Third GPU session").
//!
//! The results are the same bits as the whole passes' (each row's statistics and outcome are its
//! own; the loss is summed in row order at the end). A NaN or Inf is reported for the lowest such
//! row, as before; in place, earlier blocks' logits have been overwritten by then, as on the CPU
//! (`forward_backward_in_place`'s doc).

use std::ops::Range;

use cudarc::driver::{CudaSlice, PinnedHostSlice};

use super::device::{cuda_error, CudaDevice, CudaElement};
use super::passes::RowBlock;
use super::phases::PhaseClock;
use crate::engine::PreparedLoss;
use crate::error::LossError;
use crate::objective::{LossOutput, Objective, RowGradient};

/// How a logits-level call with a row-local objective is split into blocks of rows: at most
/// `blocks` blocks of equal length, each of at least `min_rows` rows (a pass over fewer rows than
/// the GPU holds at once leaves it part empty: on an H200, blocks of 512 rows made each pass
/// slower per row than over 4096). More blocks leave less of the objective exposed; each costs a
/// copy back, a copy up and two launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowBlocks {
    pub blocks: usize,
    pub min_rows: usize,
}

impl RowBlocks {
    /// For a GPU of `multiprocessors`: 8 blocks of at least one full wave of row passes (256
    /// threads a row, 8 rows resident per multiprocessor at the kernels' 32 registers).
    pub fn for_multiprocessors(multiprocessors: usize) -> Self {
        Self { blocks: 8, min_rows: 8 * multiprocessors.max(1) }
    }

    /// The rows `0..n` in consecutive ranges of equal length (the last shorter).
    pub fn ranges(&self, n: usize) -> Vec<Range<usize>> {
        let per_block = n.div_ceil(self.blocks.max(1)).max(self.min_rows).max(1);
        (0..n).step_by(per_block).map(|start| start..(start + per_block).min(n)).collect()
    }
}

impl CudaDevice {
    /// Steps 1 to 3 over `whole` (every row of `prepared`'s batch, `n > 0`), the gradient written
    /// at `grad` (which may be `whole.logits`: in place), a block of rows at a time.
    ///
    /// Two blocks ahead are queued: block `k`'s statistics pass and their copy back into the
    /// page-locked `staging[k % 2]` (an asynchronous copy needs one), so that while the host
    /// evaluates block `k`'s objective the GPU still has block `k - 1`'s gradient and block
    /// `k + 1`'s statistics to run. One device buffer serves every block's statistics: the stream
    /// runs each block's copy back before the next block's pass.
    pub(super) fn forward_backward_overlapped<T: CudaElement>(
        &self,
        prepared: &PreparedLoss<'_>,
        objective: &Objective<'_>,
        whole: RowBlock,
        grad: u64,
        clock: &mut PhaseClock,
    ) -> Result<LossOutput, LossError> {
        let rows = &prepared.spec().rows;
        let active = prepared.active_rows();
        let size = std::mem::size_of::<T>();
        let kernel = format!("row_gradient_{}", T::SUFFIX);
        let ranges = self.row_blocks.ranges(whole.rows);
        let mut staging = self.staging(5 * ranges[0].len())?;
        // `out` as long as the staging buffers, copied whole each time (cudarc copies the
        // destination's length; rows past a block's are left from an earlier one, never read),
        // then an event to wait on: cudarc records the pinned buffer's own event only when it
        // tracks several streams.
        let mut out = self.zeros::<f32>(staging[0].len())?;
        let queue_statistics = |k: usize, out: &mut CudaSlice<f32>, host: &mut PinnedHostSlice<f32>| {
            self.launch_row_stats(T::SUFFIX, whole.rows_of(&ranges[k], size), out)?;
            debug_assert_eq!(out.len(), host.len(), "a copy back moves the staging buffer's length");
            self.stream().memcpy_dtoh(&*out, host).map_err(cuda_error("copying from the GPU"))?;
            self.stream().record_event(None).map_err(cuda_error("recording an event"))
        };
        let mut copied = Vec::with_capacity(2);
        for k in 0..ranges.len().min(2) {
            copied.push(queue_statistics(k, &mut out, &mut staging[k])?);
        }
        let (mut stats, mut outcomes) = (Vec::with_capacity(whole.rows), Vec::with_capacity(whole.rows));
        for (k, range) in ranges.iter().enumerate() {
            copied[k % 2].synchronize().map_err(cuda_error("waiting for the GPU"))?;
            let raw = staging[k % 2].as_slice().map_err(cuda_error("reading page-locked memory"))?;
            let row_of = |k| range.start + k;
            let partial = self.checked_stats(&raw[..5 * range.len()], prepared, row_of)?;
            let done = objective.block(active, rows.vocab, prepared.spec().options.temperature, row_of, &partial);
            let grads: Vec<RowGradient> = done.iter().map(|(_, o)| o.grad).collect();
            let target = RowBlock { logits: grad, ..whole }.rows_of(range, size).logits;
            self.row_gradient(&kernel, whole.rows_of(range, size), target, &grads)?;
            if k + 2 < ranges.len() {
                copied[k % 2] = queue_statistics(k + 2, &mut out, &mut staging[k % 2])?;
            }
            let (s, o): (Vec<_>, Vec<_>) = done.into_iter().unzip();
            stats.extend(s);
            outcomes.extend(o);
        }
        clock.mark("blocks");
        // `cuda::prepare` refuses predicted tokens: were it to stop, the missing argmax would panic here.
        let output = objective.output(rows, active, &stats, &outcomes, prepared.spec().options.predicted_tokens);
        clock.mark("output");
        Ok(output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_every_row_once_in_order() {
        for policy in [
            RowBlocks::for_multiprocessors(132),
            RowBlocks { blocks: 8, min_rows: 1 },
            RowBlocks { blocks: 3, min_rows: 5 },
        ] {
            for n in [1, 2, 7, 8, 9, 21, 1055, 4096, 32_768, 32_771] {
                let blocks = policy.ranges(n);
                assert!(blocks.len() <= policy.blocks, "{n} {policy:?}");
                assert_eq!(blocks.first().unwrap().start, 0);
                assert_eq!(blocks.last().unwrap().end, n);
                assert!(blocks.windows(2).all(|w| w[0].end == w[1].start && w[0].len() >= w[1].len()), "{n}");
                assert!(blocks.iter().all(|b| !b.is_empty()), "{n}");
                assert!(blocks.len() == 1 || blocks[0].len() >= policy.min_rows, "{n} {policy:?}");
            }
        }
        // An H100 / H200 (132 multiprocessors): B=1 T=4096 in 4 blocks, B=16 T=2048 in 8.
        assert_eq!(RowBlocks::for_multiprocessors(132).ranges(4096).len(), 4);
        assert_eq!(RowBlocks::for_multiprocessors(132).ranges(32_768).len(), 8);
    }
}

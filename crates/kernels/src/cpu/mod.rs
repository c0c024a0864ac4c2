//! The CPU streaming engine: steps 1 and 3 over all rows, rows spread over rayon's threads.
//! Each row is computed by one thread in a fixed order, so the results do not depend on the
//! number of threads; rows are whole cache lines apart, so threads never share one.

mod math;
mod row;

use std::ops::Range;

use rayon::prelude::*;

use crate::element::Element;
use crate::error::LossError;
use crate::inputs::Rows;
use crate::objective::RowGradient;
use crate::stats::PartialRowStats;

/// Rows per rayon task: enough elements that scheduling costs nothing next to the work.
fn rows_per_task(width: usize) -> usize {
    (1 << 15) / width.max(1) + 1
}

/// The target's index within the columns `columns`, if it falls there.
fn local_target(rows: &Rows, row: usize, columns: &Range<usize>) -> Option<usize> {
    let y = *rows.targets?.get(row)?;
    (y >= columns.start as i64 && y < columns.end as i64).then(|| y as usize - columns.start)
}

/// Step 1: partial statistics of every active row over the columns `columns` of the vocabulary
/// (`logits` holds `[N, columns.len()]`). Inactive rows are not read. A NaN or Inf makes the
/// lowest such row an error.
pub(crate) fn statistics<T: Element>(
    logits: &[T],
    columns: Range<usize>,
    rows: &Rows,
    active: &[bool],
    temperature: f64,
) -> Result<Vec<PartialRowStats>, LossError> {
    let width = columns.len();
    let inv_t = (1.0 / temperature) as f32;
    if width == 0 {
        return Ok(vec![PartialRowStats::EMPTY; rows.len()]);
    }
    let stats: Vec<PartialRowStats> = logits
        .par_chunks(width)
        .with_min_len(rows_per_task(width))
        .enumerate()
        .map(|(i, r)| {
            if active[i] {
                row::statistics(r, inv_t, local_target(rows, i, &columns))
            } else {
                PartialRowStats::EMPTY
            }
        })
        .collect();
    if let Some(row) = stats.iter().zip(active).position(|(s, &a)| a && !s.is_finite()) {
        let (b, t) = rows.position(row);
        return Err(LossError::NonFiniteLogits { row, b, t });
    }
    Ok(stats)
}

/// Where step 3 writes (for a whole batch, or for one row).
pub enum GradientTarget<'a, T> {
    /// Read the logits, write the gradient into `out` (same shape).
    Into { logits: &'a [T], out: &'a mut [T] },
    /// Overwrite the logits with their gradient.
    InPlace(&'a mut [T]),
}

/// Step 3: the gradient of every row over the columns `columns`.
pub(crate) fn gradient<T: Element>(
    target: GradientTarget<'_, T>,
    columns: Range<usize>,
    rows: &Rows,
    grads: &[RowGradient],
    temperature: f64,
) {
    let width = columns.len();
    if width == 0 {
        return;
    }
    let inv_t = (1.0 / temperature) as f32;
    let min_len = rows_per_task(width);
    match target {
        GradientTarget::Into { logits, out } => out
            .par_chunks_mut(width)
            .zip(logits.par_chunks(width))
            .with_min_len(min_len)
            .enumerate()
            .for_each(|(i, (out, logits))| {
                row::gradient(GradientTarget::Into { logits, out }, &grads[i], inv_t, local_target(rows, i, &columns))
            }),
        GradientTarget::InPlace(logits) => {
            logits.par_chunks_mut(width).with_min_len(min_len).enumerate().for_each(|(i, r)| {
                row::gradient(GradientTarget::InPlace(r), &grads[i], inv_t, local_target(rows, i, &columns))
            })
        }
    }
}

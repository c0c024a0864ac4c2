//! The streaming engine as public API: row statistics -> token objective -> gradient pass.
//!
//! [`PreparedLoss`] exposes the three steps separately, over any vocabulary shard, so a
//! tensor-parallel caller streams its own columns, all-reduces the partial statistics
//! ([`combine_shards`]) and streams its columns again for the gradient. [`forward`],
//! [`forward_backward`] and [`forward_backward_in_place`] are the same steps with one shard
//! holding the whole vocabulary.

use std::ops::Range;

use rayon::prelude::*;

use crate::cpu::{self, Block, GradientTarget, LogitMap, RowMax, SumU, Wanted};
use crate::element::Element;
use crate::error::LossError;
use crate::inputs::{validate, BatchShard, Loss, Rows};
use crate::objective::{self, LossOutput, Objective, OutputUpstreams, RowGradient};
use crate::options::LossOptions;
use crate::stats::{PartialRowStats, RowStats};

/// Everything a loss is computed on, except the logits.
#[derive(Debug, Clone, Copy)]
pub struct LossSpec<'a> {
    pub loss: Loss<'a>,
    pub rows: Rows<'a>,
    pub options: &'a LossOptions,
    /// Global normalisers when the batch is split over devices; `None` for a whole batch.
    pub batch_shard: Option<BatchShard>,
}

impl LossSpec<'_> {
    /// Whether the op has a gradient output ([`Loss::has_gradient`]).
    pub fn has_gradient(&self) -> bool {
        self.loss.has_gradient(self.options)
    }
}

/// A loss whose inputs have been checked, ready to stream logits through.
#[derive(Debug, Clone)]
pub struct PreparedLoss<'a> {
    spec: LossSpec<'a>,
    active: Vec<bool>,
}

impl<'a> PreparedLoss<'a> {
    /// Validates options, shapes, mask, targets and GRPO inputs (everything but the logits).
    pub fn new(spec: LossSpec<'a>) -> Result<Self, LossError> {
        let active = validate(&spec.loss, &spec.rows, spec.options)?;
        check_shard_normalisers(&spec)?;
        Ok(Self { spec, active })
    }

    pub(crate) fn expecting_gradient(self) -> Result<Self, LossError> {
        if self.spec.has_gradient() {
            Ok(self)
        } else {
            Err(LossError::NoGradient { op: self.spec.loss.name() })
        }
    }

    pub(crate) fn spec(&self) -> &LossSpec<'a> {
        &self.spec
    }

    /// `sum u` feeds label smoothing only (class-weighted with class weights); the statistics
    /// skip it otherwise.
    pub(crate) fn sum_u(&self) -> SumU<'a> {
        match self.spec.loss {
            Loss::CrossEntropy(inputs) if self.spec.options.label_smoothing != 0.0 => {
                inputs.class_weights.map_or(SumU::Plain, SumU::Weighted)
            }
            _ => SumU::Skip,
        }
    }

    /// Each row's argmax (its predicted token) is asked for.
    pub(crate) fn needs_argmax(&self) -> bool {
        self.spec.options.predicted_tokens
    }

    /// What the statistics pass adds to the row kernels' own statistics.
    pub(crate) fn wanted(&self) -> Wanted<'a> {
        Wanted { sum_u: self.sum_u(), argmax: self.needs_argmax() }
    }

    /// Whether each row takes part (mask 1, and not cross-entropy's `ignore_index`).
    pub fn active_rows(&self) -> &[bool] {
        &self.active
    }

    /// The objective prepared for this batch, when it is row-local: a backend may then evaluate it
    /// a row at a time as it streams (the CPU sweep) or a block of rows at a time while its passes
    /// go on (the CUDA backend); else `None`, and step 2 needs every row's statistics first.
    pub(crate) fn row_local_objective(&self) -> Option<Objective<'a>> {
        let spec = &self.spec;
        let objective = Objective::new(&spec.loss, &spec.rows, spec.options, spec.batch_shard, &self.active);
        objective.is_row_local().then_some(objective)
    }

    fn check_shard_len(&self, len: usize, columns: &Range<usize>) -> Result<(), LossError> {
        let rows = &self.spec.rows;
        if columns.end > rows.vocab || columns.start > columns.end {
            return Err(LossError::Shard(format!(
                "columns {columns:?} are not inside the vocabulary [0, {})",
                rows.vocab
            )));
        }
        if len != rows.len() * columns.len() {
            return Err(LossError::Shape {
                tensor: "logits",
                got: vec![len],
                expected: format!("it must hold B*T*V = {}*{}*{} elements", rows.batch, rows.seq_len, columns.len()),
            });
        }
        Ok(())
    }

    /// Step 1 over the columns `columns` of the vocabulary; `logits` is `[N, columns.len()]`.
    pub fn statistics<T: Element>(
        &self,
        logits: &[T],
        columns: Range<usize>,
    ) -> Result<Vec<PartialRowStats>, LossError> {
        self.statistics_with(logits, columns, RowMax::Reported)
    }

    /// Step 1 over the whole vocabulary, for [`Self::objective`] alone (the sums perhaps relative
    /// to a reference below each row's maximum, [`RowMax::Unneeded`]).
    fn whole_statistics<T: Element>(&self, logits: &[T]) -> Result<Vec<PartialRowStats>, LossError> {
        self.statistics_with(logits, 0..self.spec.rows.vocab, RowMax::Unneeded)
    }

    fn statistics_with<T: Element>(
        &self,
        logits: &[T],
        columns: Range<usize>,
        max: RowMax,
    ) -> Result<Vec<PartialRowStats>, LossError> {
        self.check_shard_len(logits.len(), &columns)?;
        let block = Block::all_rows(&self.spec.rows, &self.active, columns);
        let map = LogitMap::of(self.spec.options);
        cpu::statistics(logits, &block, map, self.wanted(), max)
    }

    /// Step 2 from the statistics of the whole vocabulary (one shard's, or [`combine_shards`]'s).
    pub fn objective(&self, stats: &[PartialRowStats]) -> Result<(LossOutput, Vec<RowGradient>), LossError> {
        let finished = self.finished(stats)?;
        let spec = &self.spec;
        Ok(objective::evaluate(&spec.loss, &spec.rows, spec.options, spec.batch_shard, &self.active, &finished))
    }

    /// Step 2's row gradients for a per-token loss back-propagated with a per-token upstream
    /// gradient: those of the loss with each row's weight in the reduction times `upstream[i]`
    /// (`Objective::all`). With sequence-level importance sampling a sequence's rows share the
    /// gradient of its weight, so this is not each row's gradient times its upstream (as it is
    /// for a row-local loss). Refused for `geo_mean`, for an `upstream` not of one per row, and
    /// for an op without a gradient (`entropy` without `entropy_gradient`).
    pub fn upstream_gradients(
        &self,
        stats: &[PartialRowStats],
        upstream: &[f32],
    ) -> Result<Vec<RowGradient>, LossError> {
        self.output_gradients(stats, &OutputUpstreams { loss: Some(upstream), ..OutputUpstreams::default() })
    }

    /// Step 2's row gradients of `sum_i (up.loss[i] * term_i + up.entropy[i] * H_i + up.lse[i] *
    /// lse_i)`: the loss's as [`Self::upstream_gradients`] weighs it, plus those of the per-token
    /// `entropy` and `lse` outputs (an absent upstream is zero), for a caller that differentiates
    /// those outputs too. One gradient pass then writes all of it.
    pub fn output_gradients(
        &self,
        stats: &[PartialRowStats],
        upstreams: &OutputUpstreams,
    ) -> Result<Vec<RowGradient>, LossError> {
        let spec = &self.spec;
        upstreams.check(&spec.loss, &spec.rows, spec.options)?;
        let finished = self.finished(stats)?;
        let mut grads: Vec<RowGradient> = match upstreams.loss {
            Some(upstream) => {
                let objective = Objective::new(&spec.loss, &spec.rows, spec.options, spec.batch_shard, &self.active);
                objective.all(&self.active, &finished, Some(upstream)).into_iter().map(|o| o.grad).collect()
            }
            None => vec![RowGradient::ZERO; finished.len()],
        };
        objective::add_output_terms(&mut grads, &self.active, &finished, upstreams, spec.options.temperature);
        Ok(grads)
    }

    /// The per-row quantities of the statistics of the whole vocabulary (active rows; the others
    /// default), after checking that every active row's target column was seen.
    fn finished(&self, stats: &[PartialRowStats]) -> Result<Vec<RowStats>, LossError> {
        let rows = &self.spec.rows;
        if stats.len() != rows.len() {
            return Err(LossError::Shard(format!("{} rows of statistics for {} rows", stats.len(), rows.len())));
        }
        // The lowest active row missing its target column, whatever the thread count.
        let missing = |(s, &a): (&PartialRowStats, &bool)| a && s.target_u.is_none();
        if rows.targets.is_some() {
            if let Some(i) = stats.par_iter().zip(&self.active).position_first(missing) {
                return Err(LossError::Shard(format!("no shard holds the target column of row {i}")));
            }
        }
        // Statistics from an exchange that drops the argmax (the option came later than many).
        let no_argmax = |(s, &a): (&PartialRowStats, &bool)| a && s.argmax.is_none();
        if self.needs_argmax() {
            if let Some(i) = stats.par_iter().zip(&self.active).position_first(no_argmax) {
                return Err(LossError::Shard(format!(
                    "the statistics of row {i} carry no argmax, which predicted_tokens needs (every shard's \
                     PartialRowStats::argmax must reach combine_shards)"
                )));
            }
        }
        let finished: Vec<RowStats> = stats
            .par_iter()
            .zip(&self.active)
            .with_min_len(objective::ROWS_PER_TASK)
            .map(|(s, &a)| if a { s.finish(rows.vocab, self.spec.options.temperature) } else { RowStats::default() })
            .collect();
        Ok(finished)
    }

    /// Step 3 over the columns `columns`.
    pub fn gradient<T: Element>(
        &self,
        target: GradientTarget<'_, T>,
        columns: Range<usize>,
        grads: &[RowGradient],
    ) -> Result<(), LossError> {
        if !self.spec.has_gradient() {
            return Err(LossError::NoGradient { op: self.spec.loss.name() });
        }
        let len = match &target {
            GradientTarget::Into { logits, out } => {
                if logits.len() != out.len() {
                    return Err(LossError::GradientBuffer { got: out.len(), expected: logits.len() });
                }
                logits.len()
            }
            GradientTarget::InPlace(logits) => logits.len(),
        };
        self.check_shard_len(len, &columns)?;
        if grads.len() != self.spec.rows.len() {
            return Err(LossError::Shard(format!("{} row gradients for {} rows", grads.len(), self.spec.rows.len())));
        }
        cpu::gradient(
            target,
            &Block::all_rows(&self.spec.rows, &self.active, columns),
            grads,
            LogitMap::of(self.spec.options),
            self.sum_u().weights(),
        );
        Ok(())
    }
}

/// A batch shard of a class-weighted `mean` cross-entropy must carry the whole batch's summed target
/// weight: each shard's own sum would make the shard losses not sum to the batch's.
fn check_shard_normalisers(spec: &LossSpec<'_>) -> Result<(), LossError> {
    let weighted_mean = spec.loss.class_weights().is_some() && spec.options.reduction == crate::Reduction::Mean;
    match spec.batch_shard {
        Some(shard) if weighted_mean && shard.global_target_weight.is_none() => Err(LossError::MissingInput {
            tensor: "global_target_weight",
            why: "a batch shard of a class-weighted `mean` cross-entropy divides by the whole batch's summed \
                  target weights: set BatchShard::global_target_weight"
                .into(),
        }),
        _ => Ok(()),
    }
}

/// Combines the partial statistics of vocabulary shards, given with the columns each covers.
/// The shards must tile `[0, vocab)` exactly (in any order).
pub fn combine_shards(
    vocab: usize,
    shards: &[(Range<usize>, Vec<PartialRowStats>)],
) -> Result<Vec<PartialRowStats>, LossError> {
    let mut ranges: Vec<Range<usize>> = shards.iter().map(|(r, _)| r.clone()).collect();
    ranges.sort_by_key(|r| r.start);
    let mut next = 0;
    for r in &ranges {
        if r.start != next {
            return Err(LossError::Shard(format!(
                "the shards {ranges:?} do not tile the vocabulary [0, {vocab}) (gap or overlap at column {next})"
            )));
        }
        next = r.end;
    }
    if next != vocab {
        return Err(LossError::Shard(format!(
            "the shards {ranges:?} end at column {next}, not at the vocabulary size {vocab}"
        )));
    }
    let n = shards.first().map_or(0, |(_, s)| s.len());
    if let Some((r, s)) = shards.iter().find(|(_, s)| s.len() != n) {
        return Err(LossError::Shard(format!("shard {r:?} has {} rows of statistics, the first has {n}", s.len())));
    }
    Ok((0..n).map(|i| shards.iter().fold(PartialRowStats::EMPTY, |acc, (_, s)| acc.combine(s[i]))).collect())
}

/// Steps 1 to 3 over the whole vocabulary: row by row (one read of the logits) when the
/// objective is row-local, else statistics of all rows, then the objective, then the gradients.
fn run_with_gradient<T: Element>(
    prepared: &PreparedLoss<'_>,
    target: GradientTarget<'_, T>,
) -> Result<LossOutput, LossError> {
    let spec = &prepared.spec;
    let Some(objective) = prepared.row_local_objective() else {
        let stats = prepared.whole_statistics(target.logits())?;
        let (output, grads) = prepared.objective(&stats)?;
        prepared.gradient(target, 0..spec.rows.vocab, &grads)?;
        return Ok(output);
    };
    prepared.check_shard_len(target.logits().len(), &(0..spec.rows.vocab))?;
    let block = Block::all_rows(&spec.rows, &prepared.active, 0..spec.rows.vocab);
    let map = LogitMap::of(spec.options);
    let rows = cpu::sweep(target, &block, &objective, map, prepared.wanted())?;
    let (stats, outcomes): (Vec<RowStats>, Vec<_>) = rows.into_iter().unzip();
    Ok(objective.output(&spec.rows, &prepared.active, &stats, &outcomes, spec.options.predicted_tokens))
}

/// The loss and per-token outputs, no gradient.
pub fn forward<T: Element>(spec: LossSpec<'_>, logits: &[T]) -> Result<LossOutput, LossError> {
    let prepared = PreparedLoss::new(spec)?;
    let stats = prepared.whole_statistics(logits)?;
    Ok(prepared.objective(&stats)?.0)
}

/// The loss, per-token outputs, and the gradient of the loss written into `grad` (same shape
/// and dtype as `logits`).
pub fn forward_backward<T: Element>(spec: LossSpec<'_>, logits: &[T], grad: &mut [T]) -> Result<LossOutput, LossError> {
    let prepared = PreparedLoss::new(spec)?.expecting_gradient()?;
    if grad.len() != logits.len() {
        return Err(LossError::GradientBuffer { got: grad.len(), expected: logits.len() });
    }
    run_with_gradient(&prepared, GradientTarget::Into { logits, out: grad })
}

/// Like [`forward_backward`], with the gradient written over the logits: the peak memory is
/// the logits and O(N). Invalid inputs are reported before the logits are touched; but NaN or
/// Inf logits are found while streaming, and by then other rows may have been overwritten.
pub fn forward_backward_in_place<T: Element>(spec: LossSpec<'_>, logits: &mut [T]) -> Result<LossOutput, LossError> {
    let prepared = PreparedLoss::new(spec)?.expecting_gradient()?;
    run_with_gradient(&prepared, GradientTarget::InPlace(logits))
}

//! Step 2 of every loss: the token objective. Pure scalar math over the O(N) row statistics,
//! in f64, producing the loss, the per-token outputs and four gradient scalars per row such that
//!
//! `dL/dlogits_j = a*[j = y] + p_j * (b + c * log p_j) + d`
//!
//! (the `1/temperature` already folded in). A new loss is a new objective here, not a new kernel.

mod cross_entropy;
mod grpo;
mod output_upstreams;
mod policy_terms;
mod token_selection;

pub(crate) use output_upstreams::add_output_terms;
pub use output_upstreams::OutputUpstreams;

pub(crate) use policy_terms::{bound_ratio, vespo_phi};
pub use token_selection::quantile;
pub(crate) use token_selection::{covariance_selection, high_entropy_counts, trains};
mod simple;

use rayon::prelude::*;

use crate::error::LossError;
use crate::inputs::{BatchShard, Loss, Normalisers, Rows};
use crate::options::{LossOptions, LossType};
#[cfg(feature = "cuda")]
use crate::stats::PartialRowStats;
use crate::stats::RowStats;

/// What every op returns besides the gradient. Per-token outputs are `[B*T]`, row-major, and
/// 0 on rows that take no part (mask 0, or cross-entropy's `ignore_index`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LossOutput {
    pub loss: f64,
    pub per_token_loss: Vec<f32>,
    /// `log p(target)`; `None` only for `entropy` without targets.
    pub logp: Option<Vec<f32>>,
    pub entropy: Vec<f32>,
    /// GRPO: the (bias-corrected, if asked) k3 KL per token; zeros when no `ref_logp` is given.
    pub kl: Option<Vec<f32>>,
    /// GRPO: 1 where the clipped branch is active, else 0.
    pub is_clipped: Option<Vec<f32>>,
    /// `lse = log sum_j exp(u_j)` of each row (0 where the row takes no part): what Liger's
    /// z-loss output (`return_z_loss`, `lse_square_scale * lse^2`) is made of.
    pub lse: Vec<f32>,
    /// With `LossOptions::predicted_tokens`: each row's predicted token ([`crate::Argmax`]), -1
    /// where the row takes no part (Liger's `predicted_tokens`).
    pub predicted: Option<Vec<i64>>,
}

/// The four scalars of one row's gradient and the row's `lse`, all in f32 as the gradient pass
/// uses them: `dlogits_j = (a [j = y] + p_j (b + c log p_j) + d) / T` with `p_j = exp(u_j - lse)`
/// and `log p_j = u_j - lse` taken with this `lse` (`GradTerms::finish` folds its rounding into
/// `b` and `c`). With class weights `c` (cross-entropy) the last term is `d c_j`, column by column.
/// A row whose scalars are all zero gets a zero gradient without reading its logits.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RowGradient {
    pub lse: f32,
    pub a: f32,
    pub b: f32,
    pub c: f32,
    pub d: f32,
}

impl RowGradient {
    pub const ZERO: Self = Self { lse: 0.0, a: 0.0, b: 0.0, c: 0.0, d: 0.0 };

    pub fn is_zero(&self) -> bool {
        self.a == 0.0 && self.b == 0.0 && self.c == 0.0 && self.d == 0.0
    }

    /// The gradient without its `d` term (which a pass of its own adds, times class weights).
    pub(crate) fn without_d(&self) -> Self {
        Self { d: 0.0, ..*self }
    }

    /// The sum of two gradients of one row (a zero one carries none).
    ///
    /// # Panics
    /// If both are non-zero and were finished with different `lse` (not the same row's
    /// statistics): their `p_j` would differ.
    pub fn plus(&self, other: &Self) -> Self {
        match (self.is_zero(), other.is_zero()) {
            (true, _) => *other,
            (_, true) => *self,
            _ => {
                assert_eq!(self.lse.to_bits(), other.lse.to_bits(), "gradients of one row share its lse");
                Self { a: self.a + other.a, b: self.b + other.b, c: self.c + other.c, d: self.d + other.d, ..*self }
            }
        }
    }

    /// The gradient times `k` (a row without a gradient stays without one, whatever `k`: an
    /// infinite or NaN upstream on a masked row writes no NaN).
    pub fn times(&self, k: f32) -> Self {
        if self.is_zero() {
            *self
        } else {
            Self { a: self.a * k, b: self.b * k, c: self.c * k, d: self.d * k, ..*self }
        }
    }
}

/// Accumulates the gradient scalars of a row term by term (LOSSES.md, "Gradients"), in f64.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct GradTerms {
    a: f64,
    b: f64,
    c: f64,
    d: f64,
}

impl GradTerms {
    /// A term `g * logp`: `dlogp/du_j = [j = y] - p_j`.
    pub fn logp(&mut self, g: f64) {
        self.a += g;
        self.b -= g;
    }

    /// A term `gh * H`: `dH/du_j = -p_j (log p_j + H)`.
    pub fn entropy(&mut self, gh: f64, entropy: f64) {
        self.b -= gh * entropy;
        self.c -= gh;
    }

    /// A term `g * lse`: `dlse/du_j = p_j`.
    pub fn lse(&mut self, g: f64) {
        self.b += g;
    }

    /// A term `g * mean_j u_j`: `d mean/du_j = 1/V` (with class weights `c`, of
    /// `sum_j c_j u_j / V`: `c_j / V`, which the gradient pass applies).
    pub fn mean_u(&mut self, g: f64, vocab: usize) {
        self.d += g / vocab as f64;
    }

    /// The scalars for the gradient pass, with `lse` rounded to f32. The pass takes `p_j` and
    /// `log p_j` relative to that `lse`, which is off the f64 one by `lo` (up to half an ulp:
    /// ~1e-6 at `|lse|` ~ 30, logits far from 0): its `p_j` is `p_j e^lo` and its `log p_j` is
    /// `log p_j + lo`. So `b` and `c` take `e^-lo` (and `b` the `-c lo`), and every `p_j` term
    /// is the f64 `lse`'s. Without it, where the gradient is a difference of nearly equal terms
    /// (`a + p_y b` of a token with `p_y` near 1), that `e^lo` was all of its error: 6.6e-4
    /// against TRL's float32 4.3e-5 on logits near -9 (bench/tools/logits_fuzz.py).
    pub fn finish(self, stats: &RowStats, temperature: f64) -> RowGradient {
        let k = 1.0 / temperature;
        let lse = stats.lse as f32;
        let lo = stats.lse - lse as f64;
        let (fold, lo) = if lo.is_finite() { ((-lo).exp(), lo) } else { (1.0, 0.0) };
        RowGradient {
            lse,
            a: (self.a * k) as f32,
            b: ((self.b - self.c * lo) * fold * k) as f32,
            c: (self.c * fold * k) as f32,
            d: (self.d * k) as f32,
        }
    }
}

/// One row's share of the result.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct RowOutcome {
    /// The per-token loss.
    pub loss: f64,
    /// Its contribution to the reduced loss.
    pub weighted_loss: f64,
    pub kl: f64,
    pub clipped: bool,
    pub grad: RowGradient,
}

impl RowOutcome {
    pub const ZERO: Self = Self { loss: 0.0, weighted_loss: 0.0, kl: 0.0, clipped: false, grad: RowGradient::ZERO };
}

/// A loss's objective, prepared for one batch (normalisers resolved).
pub(crate) enum Objective<'a> {
    Grpo(Box<grpo::Grpo<'a>>),
    CrossEntropy(cross_entropy::CrossEntropy<'a>),
    Entropy(simple::Entropy),
    Logprob(f64),
}

impl<'a> Objective<'a> {
    pub fn new(
        loss: &Loss<'a>,
        rows: &Rows<'a>,
        options: &'a LossOptions,
        shard: Option<BatchShard>,
        active: &[bool],
    ) -> Self {
        let norm = Normalisers::resolve(loss, rows, active, options, shard);
        match loss {
            Loss::Grpo(inputs) => {
                Objective::Grpo(Box::new(grpo::Grpo::new(*inputs, *rows, options, norm, shard, active)))
            }
            Loss::CrossEntropy(inputs) => {
                let class_weights = inputs.class_weights.zip(rows.targets);
                Objective::CrossEntropy(cross_entropy::CrossEntropy::new(options, rows.vocab, class_weights, &norm))
            }
            Loss::Entropy => Objective::Entropy(simple::Entropy::new(options, &norm)),
            Loss::Logprob => Objective::Logprob(options.temperature),
        }
    }

    /// Whether [`row`](Self::row) may be used: each row's outcome depends on that row alone, so
    /// the gradient pass can follow a row's statistics pass while the row is still in cache.
    pub fn is_row_local(&self) -> bool {
        match self {
            Objective::Grpo(g) => g.is_row_local(),
            _ => true,
        }
    }

    /// The outcome of one unmasked row (row-local objectives only).
    pub fn row(&self, row: usize, stats: &RowStats) -> RowOutcome {
        match self {
            Objective::Grpo(g) => g.row(row, stats),
            Objective::CrossEntropy(c) => c.row(row, stats),
            Objective::Entropy(e) => e.row(stats),
            Objective::Logprob(temperature) => simple::logprob(stats, *temperature),
        }
    }

    /// The statistics and outcomes of the rows `row_of(0), row_of(1), ...` (one a `partial`), from
    /// their statistics over the whole vocabulary (rows that take no part: zeros), in parallel.
    /// For a backend that streams rows in blocks (fused-linear's chunks of active rows, the CUDA
    /// passes' consecutive rows) and evaluates a row-local objective one block at a time.
    #[cfg(feature = "cuda")]
    pub fn block(
        &self,
        active: &[bool],
        vocab: usize,
        temperature: f64,
        row_of: impl Fn(usize) -> usize + Sync,
        partial: &[PartialRowStats],
    ) -> Vec<(RowStats, RowOutcome)> {
        debug_assert!(self.is_row_local(), "a block at a time needs a row-local objective");
        partial
            .par_iter()
            .enumerate()
            .with_min_len(ROWS_PER_TASK)
            .map(|(k, p)| {
                let row = row_of(k);
                if !active[row] {
                    return (RowStats::default(), RowOutcome::ZERO);
                }
                let stats = p.finish(vocab, temperature);
                (stats, self.row(row, &stats))
            })
            .collect()
    }

    /// The outcome of every row; with `upstream` (checked by [`check_upstream`]), its gradients
    /// are those of the reduced loss with each row's weight times `upstream[i]`: what a per-token
    /// loss back-propagated with a per-token upstream gradient needs (the per-token loss of a loss
    /// reduced by `token-sum` has weight 1). Where each row's loss depends on that row alone, each
    /// row's gradient times its upstream; at sequence level (GSPO) the gradient of a sequence's
    /// shared importance weight is the upstream-weighted sum of its rows' ([`grpo::Grpo::all`]).
    pub fn all(&self, active: &[bool], stats: &[RowStats], upstream: Option<&[f32]>) -> Vec<RowOutcome> {
        let up = |i: usize| upstream.map_or(1.0, |u| u[i]);
        match self {
            Objective::Grpo(g) => g.all(active, stats, upstream),
            _ => each_active_row(active, |i| {
                let outcome = self.row(i, &stats[i]);
                RowOutcome { grad: outcome.grad.times(up(i)), ..outcome }
            }),
        }
    }

    /// Gathers the rows' outcomes into the op's outputs; the loss is summed in row order. With
    /// `predicted`, each active row's statistics carry its argmax (`LossOptions::predicted_tokens`).
    pub fn output(
        &self,
        rows: &Rows,
        active: &[bool],
        stats: &[RowStats],
        outcomes: &[RowOutcome],
        predicted: bool,
    ) -> LossOutput {
        let grpo = matches!(self, Objective::Grpo(_));
        LossOutput {
            loss: ordered_sum(outcomes.iter().map(|o| o.weighted_loss)),
            per_token_loss: outcomes.iter().map(|o| o.loss as f32).collect(),
            logp: rows.targets.map(|_| per_active_row(active, |i| stats[i].logp.unwrap_or(0.0))),
            entropy: per_active_row(active, |i| stats[i].entropy),
            kl: grpo.then(|| outcomes.iter().map(|o| o.kl as f32).collect()),
            is_clipped: grpo.then(|| outcomes.iter().map(|o| if o.clipped { 1.0 } else { 0.0 }).collect()),
            lse: per_active_row(active, |i| stats[i].lse),
            predicted: predicted.then(|| predicted_tokens(active, stats)),
        }
    }
}

/// Evaluates the objective of `loss` over the rows. `stats[i]` is ignored where `active[i]` is false.
///
/// # Panics
/// With `options.predicted_tokens`, if an active row's statistics carry no argmax
/// (`PreparedLoss::objective` checks it and returns an error instead); with cross-entropy's class
/// weights, if an active row's target lies outside `0..V` (`validate`, which `PreparedLoss::new`
/// calls, refuses such targets; `active` is trusted here).
pub fn evaluate(
    loss: &Loss,
    rows: &Rows,
    options: &LossOptions,
    shard: Option<BatchShard>,
    active: &[bool],
    stats: &[RowStats],
) -> (LossOutput, Vec<RowGradient>) {
    debug_assert_eq!(active.len(), stats.len(), "one activity flag per row of statistics");
    let objective = Objective::new(loss, rows, options, shard, active);
    let outcomes = objective.all(active, stats, None);
    let output = objective.output(rows, active, stats, &outcomes, options.predicted_tokens);
    (output, outcomes.into_iter().map(|o| o.grad).collect())
}

/// Each row's predicted token, -1 where it takes no part.
///
/// # Panics
/// If an active row's statistics carry no argmax (the statistics pass was not asked for it).
fn predicted_tokens(active: &[bool], stats: &[RowStats]) -> Vec<i64> {
    let column = |(s, &a): (&RowStats, &bool)| {
        if a {
            s.argmax.expect("the statistics of an active row carry its argmax when predicted tokens are asked for")
                as i64
        } else {
            -1
        }
    };
    stats.iter().zip(active).map(column).collect()
}

/// Refuses a per-token upstream gradient the objective cannot take ([`Objective::all`]'s
/// `upstream`): one of another length than the rows, or `geo_mean`'s, whose rows share one
/// sequence term with no per-token gradient to weight. Shared with the f64 reference.
pub(crate) fn check_upstream(
    loss: &Loss,
    rows: &Rows,
    options: &LossOptions,
    upstream: &[f32],
) -> Result<(), LossError> {
    if matches!(loss, Loss::Grpo(_)) && options.loss_type == LossType::GeoMean {
        return Err(LossError::InvalidOption {
            name: "loss_type",
            message: "geo_mean's rows share one sequence term: its gradient cannot be weighted per token".into(),
        });
    }
    if upstream.len() != rows.len() {
        return Err(LossError::Shape {
            tensor: "upstream",
            got: vec![upstream.len()],
            expected: format!("one upstream gradient per row, B*T = {}", rows.len()),
        });
    }
    Ok(())
}

/// Rows per parallel task of the objective: a row costs ~100 ns, so a task of this many (~25 us)
/// outweighs its scheduling many times over, and a GPU's host splits a few thousand rows over its
/// cores: with 2048 a task the 4096 rows of B=1 T=4096 ran on two threads while the GPU waited
/// (on an H100's 16-core host the objective took 0.6 ms on one thread, 0.3 ms on four or more).
pub(crate) const ROWS_PER_TASK: usize = 256;

/// `f(i)` for every active row, `RowOutcome::ZERO` elsewhere, in row order. In parallel: on a GPU
/// the objective runs on the host between the two passes, with the GPU waiting (tens of thousands
/// of rows per call); each row's outcome is its own, so any thread count gives the same bits.
pub(crate) fn each_active_row(active: &[bool], f: impl Fn(usize) -> RowOutcome + Sync) -> Vec<RowOutcome> {
    active
        .par_iter()
        .enumerate()
        .with_min_len(ROWS_PER_TASK)
        .map(|(i, &a)| if a { f(i) } else { RowOutcome::ZERO })
        .collect()
}

/// Sequences per parallel task of the objective, for sequences of `seq_len` rows.
pub(crate) fn sequences_per_task(seq_len: usize) -> usize {
    ROWS_PER_TASK.div_ceil(seq_len.max(1))
}

/// Fixed-order f64 sum, so the loss is the same bits for any thread count.
pub(crate) fn ordered_sum(values: impl Iterator<Item = f64>) -> f64 {
    values.fold(0.0, |acc, v| acc + v)
}

/// `f(row)` on active rows, 0 elsewhere, as f32.
pub(crate) fn per_active_row(active: &[bool], f: impl Fn(usize) -> f64) -> Vec<f32> {
    active.iter().enumerate().map(|(i, &a)| if a { f(i) as f32 } else { 0.0 }).collect()
}

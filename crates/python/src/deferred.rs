//! A gradient written in the backward instead of the forward, for the front ends whose contract
//! says so: Liger-Kernel's `triton_grpo_loss(inplace=True)` writes the gradient over the logits
//! in the backward (the logits keep their values until then), and a per-token loss back-propagated
//! with a per-token upstream gradient (`reduction="none"`, per-token log-probabilities) needs the
//! upstream folded into each row's gradient before the pass that writes it, which for a
//! fused-linear loss mixes the rows.
//!
//! The forward runs steps 1 and 2 of the engine (row statistics, the token objective) and keeps
//! an owned copy of the loss description ([`LossInputs`]), the rows' statistics and the four
//! gradient scalars of every row; the backward scales those by a scalar upstream gradient (they
//! are linear in it), or runs step 2's gradients again with a per-token one (with sequence-level
//! importance sampling a sequence's rows share the gradient of its weight, so a row's gradient is
//! not its own gradient times its upstream: [`PreparedLoss::upstream_gradients`]), adds those of
//! upstreams on each row's `entropy` and `lse` outputs where given
//! ([`PreparedLoss::output_gradients`]: `token_stats`), and runs step 3, the same pass the eager
//! calls run. The caller keeps the logits (or hidden states and
//! lm_head) alive and unchanged in between (PyTorch's saved-tensor version check enforces it).

use std::sync::Mutex;

use flashgrpo_kernels::{
    with_element, ChunkBudget, DType, GradientTarget, LinearGradients, LossInputs, LossOutput, LossSpec, Op,
    OutputUpstreams, PartialRowStats, PreparedLinearLoss, PreparedLoss, RowGradient,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::buffers::{Address, Result};
use crate::call::{linear_addresses, linear_inputs, GradientAddresses, LINEAR_GRADIENTS, LINEAR_INPUTS};

/// Where the scores of a deferred loss come from (a fused-linear loss's chunk budget is kept in
/// its [`LossInputs`]).
#[derive(Debug, Clone, Copy)]
pub enum Scores {
    Logits,
    Linear { hidden_size: usize },
}

/// f32 values per row and output in [`DeferredGradient::unit_row_values`].
pub const ROW_VALUES: usize = 5;

/// The per-token outputs whose unit row gradients a JAX forward keeps for its backward (the
/// custom calls' `outputs` attribute): the loss's per-token term (a row-local one: cross-entropy
/// with `reduction="none"`, log-probabilities, the entropy with its gradient), or the token
/// statistics `logp`, `entropy` and `lse` (`token_stats`), each back-propagated with its own
/// upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeptRows {
    Loss,
    TokenStats,
}

impl KeptRows {
    /// The kept outputs, in the order of their unit gradients and upstreams.
    pub fn outputs(self) -> &'static [&'static str] {
        match self {
            Self::Loss => &["loss"],
            Self::TokenStats => &["logp", "entropy", "lse"],
        }
    }

    /// Refuses an op whose kept gradients would not be linear in each row's own upstream: the
    /// token statistics are the `logprob` op's; a per-token loss term is kept for the row-local
    /// ops only (not GRPO, whose rows share a sequence's or the batch's weights).
    fn check(self, op: Op) -> Result<()> {
        let allowed: &[Op] = match self {
            Self::Loss => &[Op::Logprob, Op::CrossEntropy, Op::Entropy],
            Self::TokenStats => &[Op::Logprob],
        };
        if allowed.contains(&op) {
            Ok(())
        } else {
            let names: Vec<_> = allowed.iter().map(|op| op.name()).collect();
            Err(format!("kept outputs `{self:?}` are for the ops {names:?}, not `{}`", op.name()))
        }
    }
}

impl std::str::FromStr for KeptRows {
    type Err = String;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "loss" => Ok(Self::Loss),
            "token_stats" => Ok(Self::TokenStats),
            other => Err(format!("the attribute `outputs` is `{other}`: expected `loss` or `token_stats`")),
        }
    }
}

/// The row gradients of one loss, waiting for the backward.
#[pyclass(frozen, module = "flashgrpo._native")]
pub struct DeferredGradient {
    inputs: LossInputs,
    dtype: DType,
    vocab: usize,
    scores: Scores,
    /// Forgotten once the one backward has written the gradient.
    kept: Mutex<Option<Kept>>,
}

/// What the forward leaves for the backward.
struct Kept {
    /// The row gradients of the loss.
    rows: Vec<RowGradient>,
    /// The rows' statistics over the whole vocabulary, for a per-token upstream gradient (`None`
    /// from [`DeferredGradient::from_rows`], whose rows hold their upstreams already).
    stats: Option<Vec<PartialRowStats>>,
}

fn message(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Steps 1 and 2 over logits `[N, V]`: the output and the deferred gradient.
///
/// # Safety
/// The module's contract for `logits` (see [`crate::buffers`]).
pub unsafe fn logits_forward(
    spec: LossSpec<'_>,
    dtype: DType,
    logits: Address,
) -> Result<(LossOutput, DeferredGradient)> {
    let prepared = PreparedLoss::new(spec).map_err(message)?;
    let vocab = spec.rows.vocab;
    let stats = with_element!(dtype, T => prepared.statistics::<T>(unsafe { logits.required()? }, 0..vocab));
    let stats = stats.map_err(message)?;
    let (output, rows) = prepared.objective(&stats).map_err(message)?;
    let kept = Kept { rows, stats: Some(stats) };
    Ok((output, DeferredGradient::new(&spec, ChunkBudget::default(), dtype, Scores::Logits, kept)))
}

/// Steps 1 and 2 over `hidden @ weight^T (+ bias)`: the output and the deferred gradient.
///
/// # Safety
/// The module's contract for every address.
pub unsafe fn linear_forward(
    spec: LossSpec<'_>,
    dtype: DType,
    inputs: [Address; 3],
    hidden_size: usize,
    budget: ChunkBudget,
) -> Result<(LossOutput, DeferredGradient)> {
    let prepared = PreparedLinearLoss::new(spec, budget).map_err(message)?;
    let vocab = spec.rows.vocab;
    let stats = with_element!(dtype, T => {
        let shard = unsafe { linear_inputs::<T>(inputs, hidden_size)? };
        prepared.statistics(shard, 0..vocab)
    });
    let stats = stats.map_err(message)?;
    let (output, rows) = prepared.objective(&stats).map_err(message)?;
    let kept = Kept { rows, stats: Some(stats) };
    Ok((output, DeferredGradient::new(&spec, budget, dtype, Scores::Linear { hidden_size }, kept)))
}

impl DeferredGradient {
    /// The forward's results for the backward: an owned copy of `spec` (with `budget`), the row
    /// gradients and statistics.
    fn new(spec: &LossSpec<'_>, budget: ChunkBudget, dtype: DType, scores: Scores, kept: Kept) -> Self {
        Self {
            inputs: LossInputs::from_spec(spec, budget),
            dtype,
            vocab: spec.rows.vocab,
            scores,
            kept: Mutex::new(Some(kept)),
        }
    }

    /// A deferred gradient from the unit row gradients of the outputs `kept` that a caller kept
    /// ([`Self::unit_row_values`]: a JAX forward's residual) and the upstream of each of those
    /// outputs (`upstreams`, one per row each, in [`KeptRows::outputs`] order), so that the
    /// backward streams the vocabulary once, not twice. Each row's gradient is
    /// `sum_k upstream_k[i] * unit_k[i]`: every kept output's gradient is linear in its upstream
    /// (a row-local loss term, the entropy, the `lse`).
    pub(crate) fn from_rows(
        spec: &LossSpec<'_>,
        budget: ChunkBudget,
        dtype: DType,
        scores: Scores,
        (kept, values): (KeptRows, &[f32]),
        upstreams: &[&[f32]],
    ) -> Result<Self> {
        kept.check(spec.loss.op())?;
        let (n, outputs) = (spec.rows.len(), kept.outputs());
        if values.len() != ROW_VALUES * outputs.len() * n {
            return Err(format!("{} row-gradient values for {n} rows and the outputs {outputs:?}", values.len()));
        }
        if upstreams.len() != outputs.len() {
            return Err(format!("{} upstreams for the outputs {outputs:?}", upstreams.len()));
        }
        if let Some((name, u)) = outputs.iter().zip(upstreams).find(|(_, u)| u.len() != n) {
            return Err(format!("the upstream of `{name}` has {} values, expected one per row, {n}", u.len()));
        }
        let unit = |v: &[f32]| RowGradient { lse: v[0], a: v[1], b: v[2], c: v[3], d: v[4] };
        let rows = values.chunks_exact(ROW_VALUES * outputs.len()).enumerate().map(|(i, row)| {
            let terms = row.chunks_exact(ROW_VALUES).zip(upstreams).map(|(v, u)| unit(v).times(u[i]));
            terms.fold(RowGradient::ZERO, |sum, g| sum.plus(&g))
        });
        Ok(Self::new(spec, budget, dtype, scores, Kept { rows: rows.collect(), stats: None }))
    }

    /// The row gradients of each of `outputs` at a unit upstream, `ROW_VALUES` f32 each (`lse, a,
    /// b, c, d`), row by row, the outputs in [`KeptRows::outputs`] order: what a JAX forward keeps
    /// for its backward ([`Self::from_rows`]).
    pub(crate) fn unit_row_values(&self, outputs: KeptRows) -> Result<Vec<f32>> {
        let spec = self.inputs.spec(self.vocab);
        outputs.check(spec.loss.op())?;
        let kept = self.kept.lock().map_err(|_| message("a previous backward panicked"))?;
        let kept = kept.as_ref().ok_or_else(|| message("the row gradients were already used"))?;
        let values = |g: &RowGradient| [g.lse, g.a, g.b, g.c, g.d];
        let KeptRows::TokenStats = outputs else {
            return Ok(kept.rows.iter().flat_map(values).collect());
        };
        let stats = kept.stats.as_ref().ok_or_else(|| message("the forward's statistics were not kept"))?;
        let ones = vec![1.0f32; self.rows()];
        let prepared = PreparedLoss::new(spec).map_err(message)?;
        let unit = |up: OutputUpstreams| prepared.output_gradients(stats, &up).map_err(message);
        let logp = unit(OutputUpstreams { loss: Some(&ones), ..OutputUpstreams::default() })?;
        let entropy = unit(OutputUpstreams { entropy: Some(&ones), ..OutputUpstreams::default() })?;
        let lse = unit(OutputUpstreams { lse: Some(&ones), ..OutputUpstreams::default() })?;
        let rows = logp.iter().zip(&entropy).zip(&lse);
        Ok(rows.flat_map(|((p, h), l)| [values(p), values(h), values(l)]).flatten().collect())
    }

    fn rows(&self) -> usize {
        self.inputs.batch * self.inputs.seq_len
    }

    /// The row gradients times the upstream gradient: `up.scale`, and with `up.rows` (an f32
    /// buffer of `N`, the upstream of each row's loss) those of the loss with each row's weight
    /// times `rows[i]`, from the kept statistics; plus, with `up.entropy` / `up.lse` (f32
    /// buffers of `N`, the upstreams of each row's `entropy` and `lse` outputs), the gradients of
    /// those ([`PreparedLoss::output_gradients`]). Rows without a gradient (masked) stay zero
    /// whatever their upstream (an infinite or NaN upstream on a masked row writes no NaN). What
    /// was kept is forgotten by [`written`](Self::written) only once the gradient is written, so a
    /// backward that fails on its inputs can be retried.
    ///
    /// # Safety
    /// The module's contract for `up`'s buffers.
    unsafe fn scaled_rows(&self, up: Upstreams) -> Result<Vec<RowGradient>> {
        let kept = self.kept.lock().map_err(|_| message("a previous backward panicked"))?;
        let kept = kept.as_ref().ok_or_else(|| {
            message(
                "this loss's gradient was already written; backward through it twice (retain_graph=True) is not \
                 supported",
            )
        })?;
        let n = self.rows();
        let per_row = unsafe { Address::new("upstream rows", up.rows, n).slice::<f32>()? };
        let spec = self.inputs.spec(self.vocab);
        let rows: Vec<RowGradient> = match (per_row, &kept.stats) {
            (Some(upstream), Some(stats)) => {
                let prepared = PreparedLoss::new(spec).map_err(message)?;
                prepared.upstream_gradients(stats, upstream).map_err(message)?
            }
            // From rows alone ([`Self::from_rows`]), whose upstreams are folded in already.
            (Some(_), None) => {
                return Err(message("a per-row upstream needs the forward's statistics (not kept here)"))
            }
            (None, _) => kept.rows.clone(),
        };
        let rows = rows.iter().map(|g| g.times(up.scale));
        let entropy = unsafe { Address::new("upstream entropy", up.entropy, n).slice::<f32>()? };
        let lse = unsafe { Address::new("upstream lse", up.lse, n).slice::<f32>()? };
        if entropy.is_none() && lse.is_none() {
            return Ok(rows.collect());
        }
        let stats = kept.stats.as_ref().ok_or_else(|| {
            message("the gradients of the entropy and lse outputs need the forward's statistics (not kept here)")
        })?;
        let prepared = PreparedLoss::new(spec).map_err(message)?;
        let extra = prepared.output_gradients(stats, &OutputUpstreams { loss: None, entropy, lse }).map_err(message)?;
        Ok(rows.zip(&extra).map(|(g, e)| g.plus(e)).collect())
    }

    /// Forgets what the forward kept: the gradient has been written.
    fn written(&self) {
        if let Ok(mut kept) = self.kept.lock() {
            *kept = None;
        }
    }

    /// Writes the gradient of the logits into `out` (same dtype and shape; 0: over the logits,
    /// Liger's `inplace`, whose logits keep their values until the backward).
    ///
    /// # Safety
    /// The module's contract; `out` does not overlap the logits.
    pub(crate) unsafe fn logits_gradient(&self, logits: usize, out: usize, up: Upstreams) -> Result<()> {
        if !matches!(self.scores, Scores::Logits) {
            return Err(message("a fused-linear loss's gradient is written with `write_linear`"));
        }
        let rows = unsafe { self.scaled_rows(up)? };
        let len = self.rows() * self.vocab;
        let (logits, out) = (Address::new("logits", logits, len), Address::new("grad", out, len));
        let prepared = PreparedLoss::new(self.inputs.spec(self.vocab)).map_err(message)?;
        with_element!(self.dtype, T => {
            let target = match unsafe { out.slice_mut::<T>()? } {
                Some(out) => GradientTarget::Into { logits: unsafe { logits.required()? }, out },
                None => GradientTarget::InPlace(
                    unsafe { logits.slice_mut::<T>()? }.ok_or_else(|| message("`logits` is required"))?,
                ),
            };
            prepared.gradient(target, 0..self.vocab, &rows).map_err(message)
        })?;
        self.written();
        Ok(())
    }

    /// # Safety
    /// The module's contract; no gradient buffer overlaps another buffer.
    pub(crate) unsafe fn linear_gradients(
        &self,
        inputs: [usize; 3],
        grads: GradientAddresses,
        up: Upstreams,
    ) -> Result<()> {
        let Scores::Linear { hidden_size } = self.scores else {
            return Err(message("a logits-level loss's gradient is written with `write_logits`"));
        };
        let rows = unsafe { self.scaled_rows(up)? };
        let (n, v, h) = (self.rows(), self.vocab, hidden_size);
        let inputs = linear_addresses(LINEAR_INPUTS, inputs, n, v, h);
        let [gh, gw, gb] = linear_addresses(LINEAR_GRADIENTS, [grads.hidden, grads.weight, grads.bias], n, v, h);
        let gradients = LinearGradients {
            hidden: unsafe { gh.slice_mut::<f32>()? }.ok_or_else(|| message("`grad_hidden` is required"))?,
            weight: unsafe { gw.slice_mut()? },
            bias: unsafe { gb.slice_mut()? },
            accumulate: grads.accumulate,
        };
        let prepared = PreparedLinearLoss::new(self.inputs.spec(v), self.inputs.budget).map_err(message)?;
        with_element!(self.dtype, T => {
            let shard = unsafe { linear_inputs::<T>(inputs, h)? };
            prepared.gradient(shard, 0..v, &rows, gradients).map_err(message)
        })?;
        self.written();
        Ok(())
    }
}

/// The upstream gradients a backward hands over, as the dict `{"scale", "rows", "entropy",
/// "lse"}`: of the loss, `scale` and, at the address `rows` (0: none), one per row; at `entropy`
/// and `lse`, one per row of those outputs (f32 `[N]`; 0: none).
#[derive(Debug, Clone, Copy, FromPyObject)]
#[pyo3(from_item_all)]
pub(crate) struct Upstreams {
    pub scale: f32,
    pub rows: usize,
    pub entropy: usize,
    pub lse: usize,
}

impl Upstreams {
    /// The upstream of the loss alone: `scale`, and per row at `rows` when not 0.
    pub(crate) fn of_loss(scale: f32, rows: usize) -> Self {
        Self { scale, rows, entropy: 0, lse: 0 }
    }
}

#[pymethods]
impl DeferredGradient {
    /// Writes the gradient of the loss and its outputs times their upstream gradients
    /// ([`Upstreams`]) over the logits.
    fn write_logits(&self, py: Python<'_>, logits: usize, upstreams: Upstreams) -> PyResult<()> {
        // SAFETY: the module's contract, for the length of this call.
        py.detach(|| unsafe { self.logits_gradient(logits, 0, upstreams) }).map_err(error)
    }

    /// Writes the f32 gradients of a fused-linear loss and its outputs times their upstream
    /// gradients ([`Upstreams`]) into the buffers of `grads` (those not 0), reading `hidden`,
    /// `weight` and `bias` again.
    fn write_linear(
        &self,
        py: Python<'_>,
        hidden: usize,
        weight: usize,
        bias: usize,
        grads: GradientAddresses,
        upstreams: Upstreams,
    ) -> PyResult<()> {
        // SAFETY: the module's contract, for the length of this call.
        py.detach(|| unsafe { self.linear_gradients([hidden, weight, bias], grads, upstreams) }).map_err(error)
    }
}

fn error(text: String) -> PyErr {
    if text.contains("already written") {
        PyRuntimeError::new_err(format!("flashgrpo: {text}"))
    } else {
        PyValueError::new_err(text)
    }
}

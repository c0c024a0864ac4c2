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
    with_element, ChunkBudget, DType, GradientTarget, LinearGradients, LossInputs, LossOutput, LossSpec,
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

/// f32 values per row in [`DeferredGradient::row_values`].
pub const ROW_VALUES: usize = 5;

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
    /// from [`DeferredGradient::linear_from_rows`]: the rows are then scaled).
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

    /// A fused-linear loss's deferred gradient from row gradients a caller kept (a JAX forward's
    /// residual, [`Self::row_values`]), so that the backward streams the vocabulary once, not
    /// twice.
    pub(crate) fn linear_from_rows(
        spec: &LossSpec<'_>,
        budget: ChunkBudget,
        dtype: DType,
        hidden_size: usize,
        values: &[f32],
    ) -> Result<Self> {
        if values.len() != ROW_VALUES * spec.rows.len() {
            return Err(format!("{} row-gradient values for {} rows", values.len(), spec.rows.len()));
        }
        let rows =
            values.chunks_exact(ROW_VALUES).map(|v| RowGradient { lse: v[0], a: v[1], b: v[2], c: v[3], d: v[4] });
        let kept = Kept { rows: rows.collect(), stats: None };
        Ok(Self::new(spec, budget, dtype, Scores::Linear { hidden_size }, kept))
    }

    /// The kept row gradients as `ROW_VALUES` f32 each (`lse, a, b, c, d`).
    pub(crate) fn row_values(&self) -> Result<Vec<f32>> {
        let kept = self.kept.lock().map_err(|_| message("a previous backward panicked"))?;
        let kept = kept.as_ref().ok_or_else(|| message("the row gradients were already used"))?;
        Ok(kept.rows.iter().flat_map(|g| [g.lse, g.a, g.b, g.c, g.d]).collect())
    }

    fn rows(&self) -> usize {
        self.inputs.batch * self.inputs.seq_len
    }

    /// The row gradients times the upstream gradient: `up.scale`, and with `up.rows` (an f32
    /// buffer of `N`, the upstream of each row's loss) those of the loss with each row's weight
    /// times `rows[i]`, from the kept statistics (without them, each row's gradient times its
    /// upstream, which is the same for a row-local loss); plus, with `up.entropy` / `up.lse` (f32
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
            // From rows alone (JAX's residual): its per-token fused-linear outputs (cross-entropy,
            // log-probabilities) are row-local, where this is the same.
            (Some(upstream), None) => kept.rows.iter().zip(upstream).map(|(g, &k)| g.times(k)).collect(),
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

    /// Writes the gradient over the logits (the one use: Liger's `inplace`, whose logits keep their
    /// values until the backward).
    ///
    /// # Safety
    /// The module's contract.
    unsafe fn logits_gradient(&self, logits: usize, up: Upstreams) -> Result<()> {
        if !matches!(self.scores, Scores::Logits) {
            return Err(message("a fused-linear loss's gradient is written with `write_linear`"));
        }
        let rows = unsafe { self.scaled_rows(up)? };
        let logits = Address::new("logits", logits, self.rows() * self.vocab);
        let prepared = PreparedLoss::new(self.inputs.spec(self.vocab)).map_err(message)?;
        with_element!(self.dtype, T => {
            let logits = unsafe { logits.slice_mut::<T>()? }.ok_or_else(|| message("`logits` is required"))?;
            prepared.gradient(GradientTarget::InPlace(logits), 0..self.vocab, &rows).map_err(message)
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
        py.detach(|| unsafe { self.logits_gradient(logits, upstreams) }).map_err(error)
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

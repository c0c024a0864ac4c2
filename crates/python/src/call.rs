//! The two calls of the module: a loss over logits, and a fused-linear loss over hidden states
//! and an lm_head. Each parses the op, dtype and options, rebuilds the caller's buffers as
//! slices, and runs the kernels with the GIL released.

use flashgrpo_kernels::{
    forward, forward_backward, forward_backward_in_place, linear_forward, linear_forward_backward, with_element,
    Bf16Choice, ChunkBudget, CrossEntropyInputs, DType, Element, IsRatio, LinearGradients, LinearInputs, Loss,
    LossOptions, LossOutput, LossSpec, Op, PolicyInputs, Rows,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::buffers::{Address, Result};
use crate::deferred::{self, DeferredGradient, KeptRows, Scores};
use crate::result::LossResult;

fn message(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// The shapes and the per-row inputs of a call: a dict from the Python side, every key present,
/// each buffer an address (0: absent). Targets are i64, every other buffer f32.
#[derive(Debug, Clone, Copy, FromPyObject)]
#[pyo3(from_item_all)]
pub struct RowAddresses {
    pub batch: usize,
    pub seq_len: usize,
    pub vocab: usize,
    pub targets: usize,
    pub mask: usize,
    pub advantages: usize,
    pub old_logp: usize,
    pub ref_logp: usize,
    pub is_ratio: usize,
    pub is_ratio_per_sequence: bool,
    pub sampling_logp: usize,
    /// Cross-entropy's `[V]` class weights.
    pub class_weights: usize,
}

impl RowAddresses {
    fn rows(&self) -> usize {
        self.batch * self.seq_len
    }

    /// The kernels' description of the loss over these rows.
    ///
    /// # Safety
    /// The module's contract (see [`crate::buffers`]) for every address.
    unsafe fn spec<'a>(&self, op: Op, options: &'a LossOptions) -> Result<LossSpec<'a>> {
        let (n, b) = (self.rows(), self.batch);
        let per_row = |name, address| Address::new(name, address, n);
        let policy = if op == Op::Grpo {
            let is_ratio_len = if self.is_ratio_per_sequence { b } else { n };
            let is_ratio = unsafe { Address::new("is_ratio", self.is_ratio, is_ratio_len).slice::<f32>()? };
            Some(PolicyInputs {
                advantages: unsafe { Address::new("advantages", self.advantages, b).required()? },
                old_logp: unsafe { per_row("old_logp", self.old_logp).slice()? },
                ref_logp: unsafe { per_row("ref_logp", self.ref_logp).slice()? },
                is_ratio: is_ratio.map(|v| {
                    if self.is_ratio_per_sequence {
                        IsRatio::PerSequence(v)
                    } else {
                        IsRatio::PerToken(v)
                    }
                }),
                sampling_logp: unsafe { per_row("sampling_logp", self.sampling_logp).slice()? },
            })
        } else {
            None
        };
        if self.class_weights != 0 && op != Op::CrossEntropy {
            return Err(format!("`class_weights` weighs cross-entropy's classes; the `{}` op takes none", op.name()));
        }
        let loss = match op.loss(policy).map_err(message)? {
            Loss::CrossEntropy(_) => Loss::CrossEntropy(CrossEntropyInputs {
                class_weights: unsafe { Address::new("class_weights", self.class_weights, self.vocab).slice()? },
            }),
            loss => loss,
        };
        Ok(LossSpec {
            loss,
            rows: Rows {
                batch: self.batch,
                seq_len: self.seq_len,
                vocab: self.vocab,
                targets: unsafe { per_row("targets", self.targets).slice()? },
                mask: unsafe { per_row("mask", self.mask).slice()? },
            },
            options,
            batch_shard: None,
        })
    }

    /// [`DeferredGradient::from_rows`] for `op` over these rows: the shared part of both calls'
    /// `deferred_from_rows`.
    ///
    /// # Safety
    /// The module's contract for every address.
    unsafe fn deferred_from_rows(
        &self,
        (op, dtype, options): (&str, &str, &str),
        (budget, scores): (ChunkBudget, Scores),
        kept: (KeptRows, &[f32]),
        upstreams: &[&[f32]],
    ) -> Result<DeferredGradient> {
        let (op, dtype) = parse_op_and_dtype(op, dtype)?;
        let options = parse_options(options)?;
        let spec = unsafe { self.spec(op, &options)? };
        DeferredGradient::from_rows(&spec, budget, dtype, scores, kept, upstreams)
    }
}

/// LOSSES.md's options from a JSON object (the Python keyword arguments): an unknown key or a
/// value of the wrong type is an error that names it.
fn parse_options(json: &str) -> Result<LossOptions> {
    serde_json::from_str(json).map_err(|e| format!("{}: {e}", option_at_fault(json)))
}

/// The option a JSON object failed to deserialise on (serde's message names the value, not the
/// key): the first key that fails alone.
fn option_at_fault(json: &str) -> String {
    use serde_json::{Map, Value};
    let Ok(all) = serde_json::from_str::<Map<String, Value>>(json) else { return "loss options".into() };
    all.into_iter()
        .find(|(k, v)| serde_json::from_value::<LossOptions>(Map::from_iter([(k.clone(), v.clone())]).into()).is_err())
        .map_or("loss options".into(), |(k, _)| format!("loss option `{k}`"))
}

fn parse_op_and_dtype(op: &str, dtype: &str) -> Result<(Op, DType)> {
    Ok((op.parse().map_err(message)?, dtype.parse().map_err(message)?))
}

/// One loss over logits `[B, T, V]` of `dtype`, with the gradient written into `grad` (same dtype
/// and shape), or over the logits with `in_place`, or not computed (`grad` absent).
pub struct LogitsCall<'a> {
    pub op: &'a str,
    pub dtype: &'a str,
    pub options: &'a str,
    pub rows: RowAddresses,
    pub logits: usize,
    pub grad: usize,
    pub in_place: bool,
}

impl LogitsCall<'_> {
    /// Steps 1 and 2 only; the gradient (`grad` and `in_place` unused) left for the backward.
    ///
    /// # Safety
    /// The module's contract for every address.
    pub unsafe fn run_deferred(self) -> Result<(LossOutput, DeferredGradient)> {
        let (op, dtype) = parse_op_and_dtype(self.op, self.dtype)?;
        let options = parse_options(self.options)?;
        let spec = unsafe { self.rows.spec(op, &options)? };
        let logits = Address::new("logits", self.logits, self.rows.rows() * self.rows.vocab);
        unsafe { deferred::logits_forward(spec, dtype, logits) }
    }

    /// The deferred gradient of this call from the unit row gradients of the outputs `kept` that
    /// its forward kept, and their upstreams ([`DeferredGradient::from_rows`]); nothing is
    /// streamed.
    ///
    /// # Safety
    /// The module's contract for the per-row addresses (copied into the deferred gradient).
    pub unsafe fn deferred_from_rows(self, kept: (KeptRows, &[f32]), upstreams: &[&[f32]]) -> Result<DeferredGradient> {
        let budget = ChunkBudget::default();
        unsafe {
            self.rows.deferred_from_rows((self.op, self.dtype, self.options), (budget, Scores::Logits), kept, upstreams)
        }
    }

    /// # Safety
    /// The module's contract (see [`crate::buffers`]) for every address; `grad` does not overlap
    /// the logits.
    pub unsafe fn run(self) -> Result<LossOutput> {
        let (op, dtype) = parse_op_and_dtype(self.op, self.dtype)?;
        let options = parse_options(self.options)?;
        let len = self.rows.rows() * self.rows.vocab;
        let (logits, grad) = (Address::new("logits", self.logits, len), Address::new("grad", self.grad, len));
        let spec = unsafe { self.rows.spec(op, &options)? };
        with_element!(dtype, T => unsafe { logits_call::<T>(spec, logits, grad, self.in_place) })
    }
}

/// [`LogitsCall`] from Python, with the GIL released.
#[pyfunction]
#[pyo3(signature = (op, dtype, logits, rows, options, grad = 0, in_place = false))]
#[allow(clippy::too_many_arguments)]
pub fn loss(
    py: Python<'_>,
    op: &str,
    dtype: &str,
    logits: usize,
    rows: RowAddresses,
    options: &str,
    grad: usize,
    in_place: bool,
) -> PyResult<LossResult> {
    let call = LogitsCall { op, dtype, options, rows, logits, grad, in_place };
    // SAFETY: the module's contract, for the length of this call.
    let output = py.detach(|| unsafe { call.run() });
    output.map(LossResult::new).map_err(PyValueError::new_err)
}

/// Steps 1 and 2 of a loss over logits, the gradient left for [`DeferredGradient::write_logits`]
/// (from Python, with the GIL released).
#[pyfunction]
#[pyo3(signature = (op, dtype, logits, rows, options))]
pub fn loss_deferred(
    py: Python<'_>,
    op: &str,
    dtype: &str,
    logits: usize,
    rows: RowAddresses,
    options: &str,
) -> PyResult<(LossResult, DeferredGradient)> {
    let call = LogitsCall { op, dtype, options, rows, logits, grad: 0, in_place: false };
    // SAFETY: the module's contract, for the length of this call.
    let run = || unsafe { call.run_deferred() };
    let (output, gradient) = py.detach(run).map_err(PyValueError::new_err)?;
    Ok((LossResult::new(output), gradient))
}

/// # Safety
/// The module's contract; `grad` does not overlap `logits`.
unsafe fn logits_call<T: Element>(
    spec: LossSpec<'_>,
    logits: Address,
    grad: Address,
    in_place: bool,
) -> Result<LossOutput> {
    let output = if in_place {
        let logits = unsafe { logits.slice_mut::<T>()? }.ok_or_else(|| message("`logits` is required"))?;
        forward_backward_in_place(spec, logits)
    } else if let Some(grad) = unsafe { grad.slice_mut::<T>()? } {
        forward_backward(spec, unsafe { logits.required()? }, grad)
    } else {
        forward(spec, unsafe { logits.required::<T>()? })
    };
    output.map_err(message)
}

/// The f32 gradient buffers of a fused-linear call (0: not asked for).
#[derive(Debug, Clone, Copy, FromPyObject)]
#[pyo3(from_item_all)]
pub struct GradientAddresses {
    pub hidden: usize,
    pub weight: usize,
    pub bias: usize,
    pub accumulate: bool,
}

/// One loss over `hidden [B, T, H] @ weight[V, H]^T (+ bias [V])`, all of `dtype`, streamed over
/// the vocabulary in chunks of at most `chunk_memory_mb`; with `grads.hidden` set, the f32
/// gradients of those asked for.
pub struct LinearCall<'a> {
    pub op: &'a str,
    pub dtype: &'a str,
    pub options: &'a str,
    pub rows: RowAddresses,
    pub hidden: usize,
    pub weight: usize,
    pub bias: usize,
    pub hidden_size: usize,
    pub grads: GradientAddresses,
    pub budget: BudgetArgs<'a>,
}

/// How a fused-linear call runs, as a front end passes it: the streaming's memory in MiB and the
/// bf16 products' way (`auto`, `rounded`, or a way's name: [`Bf16Choice`]).
pub struct BudgetArgs<'a> {
    pub chunk_memory_mb: usize,
    pub bf16_products: &'a str,
}

impl BudgetArgs<'_> {
    fn budget(&self) -> Result<ChunkBudget> {
        let products = Bf16Choice::parse(self.bf16_products).map_err(message)?;
        Ok(ChunkBudget::from_mb(self.chunk_memory_mb).with_bf16_products(products))
    }
}

/// The buffers of a fused-linear loss (`names`: hidden states, weight, bias, or their gradients)
/// over `rows` rows, a vocabulary of `vocab` and hidden size `hidden_size`.
pub fn linear_addresses(
    names: [&'static str; 3],
    addresses: [usize; 3],
    rows: usize,
    vocab: usize,
    hidden_size: usize,
) -> [Address; 3] {
    let lens = [rows * hidden_size, vocab * hidden_size, vocab];
    std::array::from_fn(|i| Address::new(names[i], addresses[i], lens[i]))
}

/// A fused-linear loss's inputs as slices.
///
/// # Safety
/// The module's contract for every address.
pub unsafe fn linear_inputs<'a, T: Element>(
    [hidden, weight, bias]: [Address; 3],
    hidden_size: usize,
) -> Result<LinearInputs<'a, T>> {
    Ok(LinearInputs {
        hidden: unsafe { hidden.required()? },
        weight: unsafe { weight.required()? },
        bias: unsafe { bias.slice()? },
        hidden_size,
    })
}

/// The names of a fused-linear loss's inputs and of their gradients.
pub const LINEAR_INPUTS: [&str; 3] = ["hidden", "weight", "bias"];
pub const LINEAR_GRADIENTS: [&str; 3] = ["grad_hidden", "grad_weight", "grad_bias"];

impl LinearCall<'_> {
    fn inputs(&self) -> [Address; 3] {
        let addresses = [self.hidden, self.weight, self.bias];
        linear_addresses(LINEAR_INPUTS, addresses, self.rows.rows(), self.rows.vocab, self.hidden_size)
    }

    /// # Safety
    /// The module's contract for every address; no gradient buffer overlaps another buffer.
    pub unsafe fn run(self) -> Result<LossOutput> {
        let (op, dtype) = parse_op_and_dtype(self.op, self.dtype)?;
        let options = parse_options(self.options)?;
        let (h, g) = (self.hidden_size, self.grads);
        let gradients =
            linear_addresses(LINEAR_GRADIENTS, [g.hidden, g.weight, g.bias], self.rows.rows(), self.rows.vocab, h);
        let budget = self.budget.budget()?;
        let spec = unsafe { self.rows.spec(op, &options)? };
        with_element!(dtype, T => unsafe { linear_call::<T>(spec, self.inputs(), h, gradients, g.accumulate, budget) })
    }

    /// As [`LogitsCall::deferred_from_rows`].
    ///
    /// # Safety
    /// The module's contract for the per-row addresses (copied into the deferred gradient).
    pub unsafe fn deferred_from_rows(self, kept: (KeptRows, &[f32]), upstreams: &[&[f32]]) -> Result<DeferredGradient> {
        let scores = (self.budget.budget()?, Scores::Linear { hidden_size: self.hidden_size });
        unsafe { self.rows.deferred_from_rows((self.op, self.dtype, self.options), scores, kept, upstreams) }
    }

    /// Steps 1 and 2 only; the gradients (`grads` unused) left for the backward.
    ///
    /// # Safety
    /// The module's contract for every address.
    pub unsafe fn run_deferred(self) -> Result<(LossOutput, DeferredGradient)> {
        let (op, dtype) = parse_op_and_dtype(self.op, self.dtype)?;
        let options = parse_options(self.options)?;
        let spec = unsafe { self.rows.spec(op, &options)? };
        let budget = self.budget.budget()?;
        unsafe { deferred::linear_forward(spec, dtype, self.inputs(), self.hidden_size, budget) }
    }
}

/// The bf16 products' way a fused-linear call runs when the caller names none:
/// [`Bf16Choice::default_for`], `bf16_gradients` saying whether every gradient the call hands
/// back is bf16. The one rule of every front end; the Python side only says what it hands back.
#[pyfunction]
pub fn default_bf16_products(bf16_gradients: bool) -> &'static str {
    Bf16Choice::default_for(bf16_gradients).setting()
}

/// Whether `op` with `options` (JSON) has a gradient output ([`Op::has_gradient`]): the Python
/// side asks rather than repeating the rule.
#[pyfunction]
pub fn has_gradient(op: &str, options: &str) -> PyResult<bool> {
    let op: Op = op.parse().map_err(|e: flashgrpo_kernels::LossError| PyValueError::new_err(e.to_string()))?;
    Ok(op.has_gradient(&parse_options(options).map_err(PyValueError::new_err)?))
}

/// [`LinearCall`] from Python, with the GIL released.
#[pyfunction]
#[pyo3(signature = (op, dtype, hidden, weight, bias, hidden_size, rows, options, grads, chunk_memory_mb, bf16_products="auto"))]
#[allow(clippy::too_many_arguments)]
pub fn linear_loss(
    py: Python<'_>,
    op: &str,
    dtype: &str,
    hidden: usize,
    weight: usize,
    bias: usize,
    hidden_size: usize,
    rows: RowAddresses,
    options: &str,
    grads: GradientAddresses,
    chunk_memory_mb: usize,
    bf16_products: &str,
) -> PyResult<LossResult> {
    let budget = BudgetArgs { chunk_memory_mb, bf16_products };
    let call = LinearCall { op, dtype, options, rows, hidden, weight, bias, hidden_size, grads, budget };
    // SAFETY: the module's contract, for the length of this call.
    let output = py.detach(|| unsafe { call.run() });
    output.map(LossResult::new).map_err(PyValueError::new_err)
}

/// Steps 1 and 2 of a fused-linear loss, the gradients left for
/// [`DeferredGradient::write_linear`] (from Python, with the GIL released).
#[pyfunction]
#[pyo3(signature = (op, dtype, hidden, weight, bias, hidden_size, rows, options, chunk_memory_mb, bf16_products="auto"))]
#[allow(clippy::too_many_arguments)]
pub fn linear_loss_deferred(
    py: Python<'_>,
    op: &str,
    dtype: &str,
    hidden: usize,
    weight: usize,
    bias: usize,
    hidden_size: usize,
    rows: RowAddresses,
    options: &str,
    chunk_memory_mb: usize,
    bf16_products: &str,
) -> PyResult<(LossResult, DeferredGradient)> {
    let grads = GradientAddresses { hidden: 0, weight: 0, bias: 0, accumulate: false };
    let budget = BudgetArgs { chunk_memory_mb, bf16_products };
    let call = LinearCall { op, dtype, options, rows, hidden, weight, bias, hidden_size, grads, budget };
    // SAFETY: the module's contract, for the length of this call.
    let run = || unsafe { call.run_deferred() };
    let (output, gradient) = py.detach(run).map_err(PyValueError::new_err)?;
    Ok((LossResult::new(output), gradient))
}

/// # Safety
/// The module's contract; no gradient buffer overlaps another buffer.
unsafe fn linear_call<T: Element>(
    spec: LossSpec<'_>,
    inputs: [Address; 3],
    hidden_size: usize,
    [grad_hidden, grad_weight, grad_bias]: [Address; 3],
    accumulate: bool,
    budget: ChunkBudget,
) -> Result<LossOutput> {
    let inputs = unsafe { linear_inputs::<T>(inputs, hidden_size)? };
    let output = match unsafe { grad_hidden.slice_mut::<f32>()? } {
        None => linear_forward(spec, inputs, budget),
        Some(hidden) => {
            let grads = LinearGradients {
                hidden,
                weight: unsafe { grad_weight.slice_mut()? },
                bias: unsafe { grad_bias.slice_mut()? },
                accumulate,
            };
            linear_forward_backward(spec, inputs, grads, budget)
        }
    };
    output.map_err(message)
}

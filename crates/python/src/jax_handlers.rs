//! The losses as XLA FFI custom calls on the CPU, for `flashgrpo.jax`: JAX hands the handlers
//! its own buffers (read in place; the gradient is written into the result buffer XLA
//! allocated), under `jit`, `grad` and `vmap`. Each handler decodes the call frame into the same
//! [`LogitsCall`] / [`LinearCall`] that the Python functions run.
//!
//! Arguments, in order: the scores (`logits`; or `hidden`, `weight`, `bias`), then the eight
//! other inputs `targets` (int32 or int64), `mask`, `advantages`, `old_logp`, `ref_logp`,
//! `is_ratio`, `sampling_logp`, `class_weights` (float32), an empty array for each one not given. Attributes:
//! `op` and `options` (LOSSES.md's options as JSON), and for the fused-linear call
//! `chunk_memory_mb` and `bf16_products`, all strings. Results:
//! the loss (float32 scalar), the five per-token outputs (float32 `[B*T]`, zeros where the op
//! computes none), then, in the `_grad` variants, the gradient: of the logits (their dtype and
//! shape), or of hidden, weight and bias (float32). A logits gradient aliased to the logits
//! (`input_output_aliases`) is written over them.
//! Per-token outputs under `jax.grad` whose gradient waits for the backward (attribute `outputs`:
//! `loss`, a row-local per-token term of the loss: the entropy, log-probabilities, cross-entropy;
//! `token_stats`: `logp`, `entropy` and `lse`):
//! `flashgrpo_rows` / `flashgrpo_linear_rows` (the forwards) also return each row's `lse` and the
//! unit gradient scalars of every kept output (`[B*T * 5 * outputs]`), and `flashgrpo_rows_grad` /
//! `flashgrpo_linear_rows_grad` (the backwards) take them and one cotangent per kept output after
//! the per-row inputs and return only the gradients (of the logits; of hidden, weight and bias).

use std::ffi::c_void;

use flashgrpo_kernels::LossOutput;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict};

use crate::buffers::Result;
use crate::call::{BudgetArgs, GradientAddresses, LinearCall, LogitsCall, RowAddresses};
use crate::deferred::{DeferredGradient, KeptRows, Upstreams, ROW_VALUES};
use crate::xla_ffi::{self, Buffer, Call, CallFrame, Error};

fn dtype_name(buffer: &Buffer, what: &str) -> Result<&'static str> {
    match buffer.dtype {
        xla_ffi::DTYPE_F32 => Ok("f32"),
        xla_ffi::DTYPE_BF16 => Ok("bf16"),
        xla_ffi::DTYPE_F16 => Ok("f16"),
        other => Err(format!("`{what}` has XLA dtype {other}; expected float32, bfloat16 or float16")),
    }
}

fn grad_element_size(buffer: &Buffer) -> Result<usize> {
    Ok(if dtype_name(buffer, "grad")? == "f32" { 4 } else { 2 })
}

/// A buffer's address, 0 when it is empty (an input not given).
fn address(buffer: &Buffer) -> usize {
    if buffer.len() == 0 {
        0
    } else {
        buffer.data as usize
    }
}

/// The shape `[B, T, last]` of a rank-3 buffer, or `[1, N, last]` of a rank-2 one.
fn rows_of(buffer: &Buffer, what: &str) -> Result<(usize, usize, usize)> {
    match *buffer.dims() {
        [b, t, last] => Ok((b as usize, t as usize, last as usize)),
        [n, last] => Ok((1, n as usize, last as usize)),
        ref d => Err(format!("`{what}` must be [B, T, {what}_dim] or [N, {what}_dim], got shape {d:?}")),
    }
}

/// The per-row inputs from argument `first` on. Targets of int32 (JAX's default integer) are
/// widened into `widened`, which must outlive the call.
fn per_row_inputs(
    call: &Call<'_>,
    first: usize,
    (batch, seq_len, vocab): (usize, usize, usize),
    widened: &mut Vec<i64>,
) -> Result<RowAddresses> {
    let arg = |i: usize| call.arg(first + i);
    let targets = arg(0)?;
    let targets = match targets.dtype {
        _ if targets.len() == 0 => 0,
        xla_ffi::DTYPE_S64 => targets.data as usize,
        xla_ffi::DTYPE_S32 => {
            // SAFETY: XLA's int32 buffer of `len` elements.
            let narrow = unsafe { std::slice::from_raw_parts(targets.data as *const i32, targets.len()) };
            *widened = narrow.iter().map(|&t| i64::from(t)).collect();
            widened.as_ptr() as usize
        }
        other => return Err(format!("`targets` has XLA dtype {other}; expected int32 or int64")),
    };
    let names = ["mask", "advantages", "old_logp", "ref_logp", "is_ratio", "sampling_logp", "class_weights"];
    for (i, name) in names.iter().enumerate() {
        let b = arg(i + 1)?;
        if b.len() != 0 && b.dtype != xla_ffi::DTYPE_F32 {
            return Err(format!("`{name}` must be float32 (XLA dtype {})", b.dtype));
        }
    }
    let class_weights = arg(7)?;
    if class_weights.len() != 0 && class_weights.len() != vocab {
        return Err(format!(
            "`class_weights` has {} elements, expected one per class, [V] = [{vocab}]",
            class_weights.len()
        ));
    }
    let is_ratio = arg(5)?;
    Ok(RowAddresses {
        batch,
        seq_len,
        vocab,
        targets,
        mask: address(arg(1)?),
        advantages: address(arg(2)?),
        old_logp: address(arg(3)?),
        ref_logp: address(arg(4)?),
        is_ratio: address(is_ratio),
        is_ratio_per_sequence: is_ratio.len() == batch && seq_len != 1,
        sampling_logp: address(arg(6)?),
        class_weights: address(class_weights),
    })
}

/// Writes the loss and the per-token outputs into results 0..=5.
fn write_outputs(call: &Call<'_>, output: &LossOutput, rows: usize) -> Result<()> {
    let loss = call.ret(0)?;
    // SAFETY: XLA's float32 scalar result.
    unsafe { *(loss.data as *mut f32) = output.loss as f32 };
    let per_token = [
        Some(&output.per_token_loss),
        output.logp.as_ref(),
        Some(&output.entropy),
        output.kl.as_ref(),
        output.is_clipped.as_ref(),
    ];
    for (i, values) in per_token.into_iter().enumerate() {
        let ret = call.ret(1 + i)?;
        if ret.len() != rows {
            return Err(format!("result {} has {} elements, expected {rows}", 1 + i, ret.len()));
        }
        // SAFETY: XLA's float32 result of `rows` elements.
        let out = unsafe { std::slice::from_raw_parts_mut(ret.data as *mut f32, rows) };
        match values {
            Some(v) => out.copy_from_slice(v),
            None => out.fill(0.0),
        }
    }
    Ok(())
}

/// The loss over the logits (argument 0) and the per-row inputs after them, with no gradient
/// buffer (the caller sets one). `widened` holds int32 targets widened for the call.
fn logits_call<'c>(call: &'c Call<'_>, widened: &mut Vec<i64>) -> Result<LogitsCall<'c>> {
    let logits = call.arg(0)?;
    let shape = rows_of(logits, "logits")?;
    Ok(LogitsCall {
        op: call.string_attr("op")?,
        dtype: dtype_name(logits, "logits")?,
        options: call.string_attr("options")?,
        rows: per_row_inputs(call, 1, shape, widened)?,
        logits: address(logits),
        grad: 0,
        in_place: false,
    })
}

fn logits_loss(call: &Call<'_>, with_gradient: bool) -> Result<()> {
    let logits = call.arg(0)?;
    let grad = if with_gradient { Some(call.ret(1 + 5)?) } else { None };
    // The gradient result aliased to the logits (`in_place=True`): written over them.
    let in_place = grad.is_some_and(|g| g.data == logits.data);
    let grad = match grad {
        Some(g) if !in_place => {
            flashgrpo_kernels::huge_pages::advise(g.data as usize, g.len() * grad_element_size(g)?);
            address(g)
        }
        _ => 0,
    };
    let mut widened = Vec::new();
    let run = LogitsCall { grad, in_place, ..logits_call(call, &mut widened)? };
    let rows = run.rows.batch * run.rows.seq_len;
    // SAFETY: XLA's buffers, live for the call; the gradient is a result of its own.
    let output = unsafe { run.run() }?;
    write_outputs(call, &output, rows)
}

/// The fused-linear call of a frame whose first arguments are `hidden`, `weight`, `bias` and the
/// eight other inputs, with the f32 gradients written into results `first_grad..+3` (none:
/// no gradient). `widened` holds int32 targets widened for the call.
fn linear_call<'c>(call: &'c Call<'_>, first_grad: Option<usize>, widened: &mut Vec<i64>) -> Result<LinearCall<'c>> {
    let (hidden, weight, bias) = (call.arg(0)?, call.arg(1)?, call.arg(2)?);
    let (batch, seq_len, hidden_size) = rows_of(hidden, "hidden")?;
    let vocab = weight.dims().first().copied().unwrap_or(0) as usize;
    let rows = per_row_inputs(call, 3, (batch, seq_len, vocab), widened)?;
    let grads = match first_grad {
        Some(first) => {
            let grad = |i: usize| {
                call.ret(first + i).map(|b| {
                    flashgrpo_kernels::huge_pages::advise(b.data as usize, 4 * b.len());
                    address(b)
                })
            };
            GradientAddresses { hidden: grad(0)?, weight: grad(1)?, bias: grad(2)?, accumulate: false }
        }
        None => GradientAddresses { hidden: 0, weight: 0, bias: 0, accumulate: false },
    };
    let chunk_memory_mb = call.string_attr("chunk_memory_mb")?;
    Ok(LinearCall {
        op: call.string_attr("op")?,
        dtype: dtype_name(hidden, "hidden")?,
        options: call.string_attr("options")?,
        rows,
        hidden: address(hidden),
        weight: address(weight),
        bias: address(bias),
        hidden_size,
        grads,
        budget: BudgetArgs {
            chunk_memory_mb: chunk_memory_mb
                .parse()
                .map_err(|e| format!("chunk_memory_mb `{chunk_memory_mb}`: {e}"))?,
            bf16_products: call.string_attr("bf16_products")?,
        },
    })
}

fn linear_loss(call: &Call<'_>, with_gradient: bool) -> Result<()> {
    let mut widened = Vec::new();
    let run = linear_call(call, with_gradient.then_some(6), &mut widened)?;
    let rows = run.rows.batch * run.rows.seq_len;
    // SAFETY: XLA's buffers, live for the call; each gradient is a result of its own.
    let output = unsafe { run.run() }?;
    write_outputs(call, &output, rows)
}

/// An f32 buffer of `len` elements as a slice (`what` names it in the error).
fn f32_slice<'b>(buffer: &'b Buffer, what: &str, len: usize) -> Result<&'b [f32]> {
    if buffer.dtype != xla_ffi::DTYPE_F32 || buffer.len() != len {
        return Err(format!(
            "{what} must be float32 [{len}], got XLA dtype {} and {} elements",
            buffer.dtype,
            buffer.len()
        ));
    }
    // SAFETY: XLA's float32 buffer of `len` elements, live for the call.
    Ok(unsafe { std::slice::from_raw_parts(buffer.data as *const f32, len) })
}

/// Copies `values` into the float32 result `index`.
fn write_result(call: &Call<'_>, index: usize, values: &[f32]) -> Result<()> {
    let ret = call.ret(index)?;
    if ret.dtype != xla_ffi::DTYPE_F32 || ret.len() != values.len() {
        return Err(format!("result {index} must be float32 [{}], got {} elements", values.len(), ret.len()));
    }
    // SAFETY: XLA's float32 result of `values.len()` elements.
    unsafe { std::slice::from_raw_parts_mut(ret.data as *mut f32, values.len()) }.copy_from_slice(values);
    Ok(())
}

/// The per-token outputs whose gradients a rows call keeps (its `outputs` attribute).
fn kept_outputs(call: &Call<'_>) -> Result<KeptRows> {
    call.string_attr("outputs")?.parse()
}

/// The results of a rows forward (`flashgrpo_rows`, `flashgrpo_linear_rows`): the outputs
/// (0..=5), each row's `lse` (6) and the unit row gradients of the kept outputs (7, float32
/// `[B*T * 5 * outputs]`), the residual its backward folds the upstreams into.
fn write_kept_rows(call: &Call<'_>, output: &LossOutput, deferred: &DeferredGradient, rows: usize) -> Result<()> {
    write_outputs(call, output, rows)?;
    write_result(call, 6, &output.lse)?;
    write_result(call, 7, &deferred.unit_row_values(kept_outputs(call)?)?)
}

/// The kept outputs and their unit row gradients, and the upstreams of those outputs.
type KeptArgs<'c> = ((KeptRows, &'c [f32]), Vec<&'c [f32]>);

/// A rows backward's arguments from `first` on: the forward's unit row gradients, then the
/// upstream (the cotangent, float32 `[B*T]`) of each kept output.
fn kept_rows<'c>(call: &'c Call<'_>, first: usize, rows: usize) -> Result<KeptArgs<'c>> {
    let kept = kept_outputs(call)?;
    let outputs = kept.outputs();
    let values = f32_slice(call.arg(first)?, "the row gradients", ROW_VALUES * outputs.len() * rows)?;
    let upstream = |(i, name)| f32_slice(call.arg(first + 1 + i)?, &format!("the cotangent of `{name}`"), rows);
    Ok(((kept, values), outputs.iter().enumerate().map(upstream).collect::<Result<_>>()?))
}

/// The forward of per-token outputs of a loss over logits under `jax.grad` (`token_stats`):
/// results as [`write_kept_rows`].
fn logits_rows(call: &Call<'_>) -> Result<()> {
    let mut widened = Vec::new();
    let run = logits_call(call, &mut widened)?;
    let rows = run.rows.batch * run.rows.seq_len;
    // SAFETY: XLA's buffers, live for the call.
    let (output, deferred) = unsafe { run.run_deferred() }?;
    write_kept_rows(call, &output, &deferred, rows)
}

/// The gradient of `sum_k sum_i g_k[i] * out_k[i]` over the kept outputs `out_k` of
/// [`logits_rows`], into result 0 (the logits' dtype and shape): argument 9 holds the forward's
/// unit row gradients, arguments 10.. the cotangents `g_k`; one stream over the logits.
fn logits_rows_gradient(call: &Call<'_>) -> Result<()> {
    let (logits, grad) = (call.arg(0)?, call.ret(0)?);
    if grad.dims() != logits.dims() || grad.dtype != logits.dtype {
        return Err(format!(
            "result 0 must be the logits' dtype and shape (XLA dtype {}, {:?}), got XLA dtype {} and {:?}",
            logits.dtype,
            logits.dims(),
            grad.dtype,
            grad.dims()
        ));
    }
    flashgrpo_kernels::huge_pages::advise(grad.data as usize, grad.len() * grad_element_size(grad)?);
    let mut widened = Vec::new();
    let run = logits_call(call, &mut widened)?;
    let (kept, upstreams) = kept_rows(call, 9, run.rows.batch * run.rows.seq_len)?;
    // SAFETY: XLA's buffers, live for the call; the gradient is a result of its own.
    unsafe {
        let deferred = run.deferred_from_rows(kept, &upstreams)?;
        deferred.logits_gradient(address(logits), address(grad), Upstreams::of_loss(1.0, 0))
    }
}

/// The forward of per-token outputs of a fused-linear loss under `jax.grad` (a per-token loss,
/// log-probabilities, `token_stats`): results as [`write_kept_rows`].
fn linear_rows(call: &Call<'_>) -> Result<()> {
    let mut widened = Vec::new();
    let run = linear_call(call, None, &mut widened)?;
    let rows = run.rows.batch * run.rows.seq_len;
    // SAFETY: XLA's buffers, live for the call.
    let (output, deferred) = unsafe { run.run_deferred() }?;
    write_kept_rows(call, &output, &deferred, rows)
}

/// The gradients of `sum_k sum_i g_k[i] * out_k[i]` over the kept outputs `out_k` of
/// [`linear_rows`], into results 0..3: argument 11 holds the forward's unit row gradients,
/// arguments 12.. the cotangents `g_k`; folded into each row's scalars before the products
/// (`d hidden` and `d weight` mix the rows), one more stream over the vocabulary.
fn linear_rows_gradient(call: &Call<'_>) -> Result<()> {
    let mut widened = Vec::new();
    let run = linear_call(call, Some(0), &mut widened)?;
    let (kept, upstreams) = kept_rows(call, 11, run.rows.batch * run.rows.seq_len)?;
    let (inputs, grads) = ([run.hidden, run.weight, run.bias], run.grads);
    // SAFETY: XLA's buffers, live for the call; each gradient is a result of its own.
    unsafe {
        let deferred = run.deferred_from_rows(kept, &upstreams)?;
        deferred.linear_gradients(inputs, grads, Upstreams::of_loss(1.0, 0))
    }
}

unsafe extern "C" fn flashgrpo_loss(frame: *mut CallFrame) -> *mut Error {
    unsafe { xla_ffi::handle(frame, |call| logits_loss(call, false)) }
}

unsafe extern "C" fn flashgrpo_loss_grad(frame: *mut CallFrame) -> *mut Error {
    unsafe { xla_ffi::handle(frame, |call| logits_loss(call, true)) }
}

unsafe extern "C" fn flashgrpo_linear_loss(frame: *mut CallFrame) -> *mut Error {
    unsafe { xla_ffi::handle(frame, |call| linear_loss(call, false)) }
}

unsafe extern "C" fn flashgrpo_linear_loss_grad(frame: *mut CallFrame) -> *mut Error {
    unsafe { xla_ffi::handle(frame, |call| linear_loss(call, true)) }
}

unsafe extern "C" fn flashgrpo_rows(frame: *mut CallFrame) -> *mut Error {
    unsafe { xla_ffi::handle(frame, logits_rows) }
}

unsafe extern "C" fn flashgrpo_rows_grad(frame: *mut CallFrame) -> *mut Error {
    unsafe { xla_ffi::handle(frame, logits_rows_gradient) }
}

unsafe extern "C" fn flashgrpo_linear_rows(frame: *mut CallFrame) -> *mut Error {
    unsafe { xla_ffi::handle(frame, linear_rows) }
}

unsafe extern "C" fn flashgrpo_linear_rows_grad(frame: *mut CallFrame) -> *mut Error {
    unsafe { xla_ffi::handle(frame, linear_rows_gradient) }
}

type Handler = unsafe extern "C" fn(*mut CallFrame) -> *mut Error;

/// The handlers by target name, each as the PyCapsule of its address that
/// `jax.ffi.register_ffi_target` takes.
#[pyfunction]
pub fn ffi_handlers(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let handlers: [(&str, Handler); 8] = [
        ("flashgrpo_loss", flashgrpo_loss),
        ("flashgrpo_loss_grad", flashgrpo_loss_grad),
        ("flashgrpo_rows", flashgrpo_rows),
        ("flashgrpo_rows_grad", flashgrpo_rows_grad),
        ("flashgrpo_linear_loss", flashgrpo_linear_loss),
        ("flashgrpo_linear_loss_grad", flashgrpo_linear_loss_grad),
        ("flashgrpo_linear_rows", flashgrpo_linear_rows),
        ("flashgrpo_linear_rows_grad", flashgrpo_linear_rows_grad),
    ];
    let out = PyDict::new(py);
    for (name, handler) in handlers {
        // SAFETY: a capsule of a function address, with no name and no destructor, as JAX's
        // `jax.ffi.pycapsule` makes.
        let capsule = unsafe {
            let raw = pyo3::ffi::PyCapsule_New(handler as *mut c_void, std::ptr::null(), None);
            Bound::from_owned_ptr_or_err(py, raw)?.cast_into::<PyCapsule>()?
        };
        out.set_item(name, capsule)?;
    }
    Ok(out)
}

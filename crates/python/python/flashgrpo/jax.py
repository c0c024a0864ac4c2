"""flashgrpo's losses for JAX (CPU): ``jax.custom_vjp`` functions whose forward and backward are
XLA FFI custom calls into the Rust kernels, so they work under ``jax.jit``, ``jax.grad`` and
``jax.vmap``. JAX's buffers are read in place. For a loss the gradient is computed in the
forward's sweep (as the kernels always do) and kept as the residual, so the backward only scales
it; for per-token outputs with their own cotangents (``token_stats``, ``entropy``, the
fused-linear per-token outputs) the forward keeps each row's gradient scalars and the backward
writes the gradient, one more stream.

Functions (logits ``[B, T, V]``; cross-entropy, entropy and log-probabilities also ``[N, V]``):

- ``grpo_loss(logits, targets, advantages, mask=None, *, old_logp=None, ref_logp=None,
  is_ratio=None, sampling_logp=None, return_outputs=False, **options)``: the loss (float32
  scalar), or ``(loss, outputs)`` with the per-token outputs (no gradient through them);
- ``cross_entropy(logits, targets, *, reduction="mean", ignore_index=-100, ...)``;
- ``entropy(logits, mask=None, *, temperature=1.0)``: per token, differentiable;
- ``logprob(logits, targets, *, temperature=1.0)``: per token, differentiable;
- ``token_stats(logits, targets, mask=None, *, temperature=1.0, softcap=None)``: ``TokenStats``
  (``logp``, ``entropy``, ``lse`` per token), all three differentiable, one stream each way;
- ``fused_linear_grpo_loss``, ``fused_linear_cross_entropy``, ``fused_linear_logprob`` (from
  ``hidden``, ``weight [V, H]`` and ``bias``; gradients to all three; a per-token output's
  gradient is written in the backward, where each token's cotangent is known),
  ``fused_linear_token_stats`` and ``fused_linear_entropy``.

``vmap`` runs the custom call once per mapped element (each element its own loss).
Options are docs/LOSSES.md's, as keyword arguments.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import _native
from ._calls import PER_TOKEN, options_json

__all__ = [
    "grpo_loss",
    "cross_entropy",
    "entropy",
    "logprob",
    "TokenStats",
    "token_stats",
    "fused_linear_grpo_loss",
    "fused_linear_cross_entropy",
    "fused_linear_entropy",
    "fused_linear_logprob",
    "fused_linear_token_stats",
]

_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)

#: The per-token outputs of ``token_stats``, in order.
TOKEN_STATS = ("logp", "entropy", "lse")

# The inputs after the scores (targets, mask, advantages, old_logp, ref_logp, is_ratio,
# sampling_logp, class_weights): they get no cotangent.
_NO_COTANGENTS = (None,) * 8


def _options_json(options):
    """``options_json``, refusing what the JAX calls' fixed outputs cannot carry."""
    if options.get("predicted_tokens"):
        raise NotImplementedError("`predicted_tokens` is not returned by flashgrpo.jax; use flashgrpo.torch or "
                                  "flashgrpo.arrays")
    return options_json(options)


@functools.cache
def _register():
    for name, capsule in _native.ffi_handlers().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    return True


def _float_input(name, x):
    x = jnp.asarray(x)
    if x.dtype not in _FLOATS:
        raise TypeError(f"`{name}` has dtype {x.dtype}; expected float32, bfloat16 or float16")
    return x


def _rows(name, x, last):
    if x.ndim not in (2, 3):
        raise ValueError(f"`{name}` must be [B, T, {last}] or [N, {last}], got shape {list(x.shape)}")
    if x.shape[-1] == 0:
        raise ValueError(f"`{name}` has shape {list(x.shape)}: its last axis ({last}) is empty")
    return (1, x.shape[0]) if x.ndim == 2 else tuple(x.shape[:2])


def _empty_batch(value, shape, rows):
    """A call over no rows: loss 0 (as over rows that all take no part) and, through JAX's own
    differentiation of the zero, a zero gradient for the empty `rows` (logits or hidden states;
    the weight and bias, unused, get JAX's zeros); empty per-token outputs."""
    zero = jnp.sum(rows, dtype=jnp.float32) * 0.0
    empty = jnp.zeros(shape, jnp.float32)
    return (zero if value == "loss" else empty + zero), {k: empty for k in PER_TOKEN}


def _per_row(batch, seq_len, vocab, targets=None, mask=None, advantages=None, old_logp=None, ref_logp=None,
             is_ratio=None, sampling_logp=None, class_weights=None):
    """The eight inputs after the scores in the custom call's order (the seven per-row ones, then
    cross-entropy's class weights ``[V]``); an empty array for each one absent."""
    bt = [(batch, seq_len)] + ([(seq_len,)] if batch == 1 else [])

    def take(name, x, shapes, dtype):
        if x is None:
            return jnp.zeros((0,), dtype)
        x = jnp.asarray(x)
        if name == "targets" and not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"`targets` has dtype {x.dtype}; expected an integer dtype (token ids)")
        if tuple(x.shape) not in shapes:
            want = " or ".join(str(list(s)) for s in shapes)
            raise ValueError(f"`{name}` has shape {list(x.shape)}, expected {want}")
        if dtype == jnp.int32 and x.dtype in (jnp.int64, jnp.uint32, jnp.uint64):
            dtype = jnp.int64 if jax.config.jax_enable_x64 else jnp.int32
        return x.astype(dtype).reshape(-1)

    f32 = jnp.float32
    return (
        take("targets", targets, bt, jnp.int32),
        take("mask", mask, bt, f32),
        take("advantages", advantages, [(batch,), (batch, 1)], f32),
        take("old_logp", old_logp, bt, f32),
        take("ref_logp", ref_logp, bt, f32),
        take("is_ratio", is_ratio, bt + [(batch,), (batch, 1)], f32),
        take("sampling_logp", sampling_logp, bt, f32),
        take("class_weights", class_weights, [(vocab,)], f32),
    )


def _outputs_of(results):
    per_token = dict(zip(PER_TOKEN, results[1:6]))
    return results[0], per_token


# ---------------------------------------------------------------- logits-level


def _logits_call(op, opts, logits, side, with_grad, in_place=False):
    _register()
    rows = logits.size // logits.shape[-1]
    shapes = [jax.ShapeDtypeStruct((), jnp.float32)] + [jax.ShapeDtypeStruct((rows,), jnp.float32)] * 5
    if with_grad:
        shapes.append(jax.ShapeDtypeStruct(logits.shape, logits.dtype))
    target = "flashgrpo_loss_grad" if with_grad else "flashgrpo_loss"
    # In place: the gradient result shares the logits' buffer (XLA copies the logits first unless
    # they are donated or an intermediate no one reads afterwards).
    aliases = {0: 6} if with_grad and in_place else None
    return jax.ffi.ffi_call(target, shapes, vmap_method="sequential", input_output_aliases=aliases)(
        logits, *side, op=op, options=opts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _logits_loss(op, value, opts, in_place, logits, *side):
    """``(value, per_token)``: ``value`` is the loss, or the per-token output named ``value``."""
    loss, per_token = _outputs_of(_logits_call(op, opts, logits, side, False))
    return (loss if value == "loss" else per_token[value]), per_token


def _logits_loss_fwd(op, value, opts, in_place, logits, *side):
    results = _logits_call(op, opts, logits, side, True, in_place)
    loss, per_token = _outputs_of(results)
    return ((loss if value == "loss" else per_token[value]), per_token), results[6]


def _logits_loss_bwd(op, value, opts, in_place, grad, cotangents):
    g = cotangents[0].astype(jnp.float32)
    if value == "loss":
        scaled = grad.astype(jnp.float32) * g
    else:  # per token: the kernels' gradient is of the sum, row i scaled by g[i]
        scaled = grad.astype(jnp.float32) * g.reshape(grad.shape[:-1] + (1,))
    return (scaled.astype(grad.dtype),) + _NO_COTANGENTS


_logits_loss.defvjp(_logits_loss_fwd, _logits_loss_bwd)


# Per-token outputs each back-propagated with its own cotangent, whose gradient waits for the
# backward (``token_stats``, ``entropy``, a fused-linear loss's per-token term): the forward's custom call keeps
# each row's unit gradient scalars of every such output, the backward's folds the cotangents into
# them and streams the vocabulary once.


def _kept(values):
    """The custom calls' ``outputs`` attribute for the per-token ``values`` returned: the token
    statistics, or one per-token term of the loss."""
    return "token_stats" if values == TOKEN_STATS else "loss"


def _rows_results(scores, values):
    """The results of a rows forward over ``scores`` (logits or hidden states): the loss, the five
    per-token outputs, each row's ``lse``, and the unit row gradients (``ROW_VALUES`` a row and
    value)."""
    rows = scores.size // scores.shape[-1]
    f32 = jnp.float32
    return ([jax.ShapeDtypeStruct((), f32)] + [jax.ShapeDtypeStruct((rows,), f32)] * 6
            + [jax.ShapeDtypeStruct((rows * _native.ROW_VALUES * len(values),), f32)])


def _picked(results, values):
    """The per-token ``values`` of a rows forward's results, and its unit row gradients."""
    named = dict(zip(PER_TOKEN + ("lse",), results[1:7]))
    return tuple(named[v] for v in values), results[7]


def _flat(cotangents):
    return [c.astype(jnp.float32).reshape(-1) for c in cotangents]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _logits_rows(op, values, opts, logits, *side):
    """The per-token outputs ``values`` of a loss over logits, each differentiable with its own
    cotangent; the backward writes the logits' gradient (their dtype) in one stream."""
    return _logits_rows_fwd(op, values, opts, logits, *side)[0]


def _logits_rows_fwd(op, values, opts, logits, *side):
    _register()
    results = jax.ffi.ffi_call("flashgrpo_rows", _rows_results(logits, values), vmap_method="sequential")(
        logits, *side, op=op, options=opts, outputs=_kept(values))
    out, kept = _picked(results, values)
    return out, (logits, side, kept)


def _logits_rows_bwd(op, values, opts, residual, cotangents):
    logits, side, kept = residual
    grad = jax.ffi.ffi_call("flashgrpo_rows_grad", jax.ShapeDtypeStruct(logits.shape, logits.dtype),
                            vmap_method="sequential")(
        logits, *side, kept, *_flat(cotangents), op=op, options=opts, outputs=_kept(values))
    return (grad,) + _NO_COTANGENTS


_logits_rows.defvjp(_logits_rows_fwd, _logits_rows_bwd)


def _run_logits(op, value, logits, options, in_place=False, **row_inputs):
    logits = _float_input("logits", logits)
    batch, seq_len = _rows("logits", logits, "V")
    side = _per_row(batch, seq_len, logits.shape[-1], **row_inputs)
    if batch * seq_len == 0:
        _options_json(options)  # an unknown option is an error whatever the batch
        return _empty_batch(value, logits.shape[:-1], logits)
    out, per_token = _logits_loss(op, value, _options_json(options), bool(in_place), logits, *side)
    shape = logits.shape[:-1]
    per_token = {k: jax.lax.stop_gradient(v).reshape(shape) for k, v in per_token.items()}
    return out, per_token


def _with_outputs(loss, per_token, op, given, return_outputs):
    if not return_outputs:
        return loss
    present = {"per_token_loss": True, "logp": op != "entropy", "entropy": True,
               "kl": op == "grpo" and given.get("ref_logp") is not None, "is_clipped": op == "grpo"}
    return loss, {k: (v if present[k] else None) for k, v in per_token.items()}


def grpo_loss(logits, targets, advantages, mask=None, *, old_logp=None, ref_logp=None, is_ratio=None,
              sampling_logp=None, return_outputs=False, in_place=False, **options):
    """The GRPO loss (``loss_type`` and every LOSSES.md option) of logits ``[B, T, V]``. With
    ``in_place=True`` the gradient's buffer is the logits' (no second ``[B, T, V]`` buffer when
    the logits are donated to ``jit`` or are an intermediate of the same computation)."""
    if jnp.ndim(logits) != 3:
        raise ValueError(f"`logits` must be [B, T, V], got shape {list(jnp.shape(logits))}")
    given = dict(targets=targets, mask=mask, advantages=advantages, old_logp=old_logp, ref_logp=ref_logp,
                 is_ratio=is_ratio, sampling_logp=sampling_logp)
    loss, per_token = _run_logits("grpo", "loss", logits, options, in_place, **given)
    return _with_outputs(loss, per_token, "grpo", given, return_outputs)


def cross_entropy(logits, targets, *, reduction="mean", ignore_index=-100, label_smoothing=0.0, z_loss=0.0, mask=None,
                  in_place=False, class_weights=None, **options):
    """Cross-entropy of logits ``[N, V]`` or ``[B, T, V]``; ``reduction`` mean (default), sum or none;
    ``class_weights [V]``: per-class weights (LOSSES.md, "Class weights"; optax has none), no
    cotangent."""
    value = "per_token_loss" if reduction == "none" else "loss"
    options = dict(options, reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing,
                   z_loss=z_loss)
    out, _ = _run_logits("cross_entropy", value, logits, options, in_place, targets=targets, mask=mask,
                         class_weights=class_weights)
    return out.reshape(jnp.shape(targets)) if reduction == "none" else out


class TokenStats(NamedTuple):
    """Each token's ``log p(target)``, entropy and ``lse = logsumexp(logits / temperature)``
    (float32, the shape of ``targets``; 0 on masked rows), each differentiable."""

    logp: jax.Array
    entropy: jax.Array
    lse: jax.Array


def _empty_stats(shape, scores):
    """``TokenStats`` over no rows, with JAX's zero gradient for the empty ``scores``."""
    zero = jnp.zeros(shape, jnp.float32) + jnp.sum(scores, dtype=jnp.float32) * 0.0
    return TokenStats(zero, zero, zero)


def _entropy_options(temperature, softcap):
    """The entropy's options, with its gradient per token (each row's weight 1)."""
    return dict(temperature=temperature, softcap=softcap, entropy_gradient=True, reduction="none")


def entropy(logits, mask=None, *, temperature=1.0, softcap=None):
    """Per-token entropy of ``softmax(logits / temperature)`` (of ``c tanh(logits / c)`` with
    ``softcap=c``; 0 where ``mask`` is 0), differentiable per token (LOSSES.md's
    ``entropy_gradient``): the forward costs what the values cost, the gradient is written in the
    backward with each token's cotangent folded in."""
    logits = _float_input("logits", logits)
    batch, seq_len = _rows("logits", logits, "V")
    side = _per_row(batch, seq_len, logits.shape[-1], mask=mask)
    opts = _options_json(_entropy_options(temperature, softcap))
    if batch * seq_len == 0:
        return _empty_stats(logits.shape[:-1], logits).entropy
    (out,) = _logits_rows("entropy", ("entropy",), opts, logits, *side)
    return out.reshape(logits.shape[:-1])


def logprob(logits, targets, *, temperature=1.0, softcap=None, in_place=False):
    """Per-token ``log_softmax(logits / temperature)[target]``, differentiable."""
    out, _ = _run_logits("logprob", "logp", logits, dict(temperature=temperature, softcap=softcap), in_place,
                         targets=targets)
    return out.reshape(jnp.shape(targets))


def token_stats(logits, targets, mask=None, *, temperature=1.0, softcap=None):
    """Each token's ``log p(target)``, entropy and ``lse`` under ``softmax(logits / temperature)``
    (of ``c tanh(logits / c)`` with ``softcap=c``) as ``TokenStats``, all three differentiable
    (verl's actor back-propagates log-probabilities and an entropy bonus): the forward keeps each
    row's gradient scalars of the three, the backward folds the three cotangents into them and
    writes the logits' gradient (their dtype) in one stream."""
    logits = _float_input("logits", logits)
    batch, seq_len = _rows("logits", logits, "V")
    side = _per_row(batch, seq_len, logits.shape[-1], targets=targets, mask=mask)
    opts = _options_json(dict(temperature=temperature, softcap=softcap))
    shape = jnp.shape(targets)
    if batch * seq_len == 0:
        return _empty_stats(shape, logits)
    out = _logits_rows("logprob", TOKEN_STATS, opts, logits, *side)
    return TokenStats(*(x.reshape(shape) for x in out))


# ---------------------------------------------------------------- fused-linear


def _as_hidden_dtype(hidden, weight, bias):
    """The weight and bias in the hidden states' dtype, as the kernels take them (a copy where they
    differ, as Liger-Kernel and ``flashgrpo.torch`` cast the weight). Cast inside the custom VJPs,
    so that each f32 gradient is cast once, straight to its input's own dtype."""
    return weight.astype(hidden.dtype), bias.astype(hidden.dtype)


def _budget(chunk_memory_mb, bf16_products, hidden, weight, bias):
    """A fused-linear call's budget, hashable (a custom VJP's static argument): the memory in MiB
    and the bf16 products' way; unnamed, ``rounded`` where every gradient handed back (each in its
    input's dtype) is bf16, else ``auto`` (``Bf16Choice::default_for``, docs/PYTHON.md)."""
    if not bf16_products:
        given = [x for x in (hidden, weight, bias) if x.size]
        bf16_products = _native.default_bf16_products(all(x.dtype == jnp.bfloat16 for x in given))
    return (chunk_memory_mb or _native.DEFAULT_CHUNK_MEMORY_MB, bf16_products)


def _budget_attrs(chunk):
    """The budget as the custom calls' string attributes."""
    return dict(chunk_memory_mb=str(chunk[0]), bf16_products=chunk[1])


def _linear_call(op, opts, chunk, hidden, weight, bias, side, with_grad):
    _register()
    weight, bias = _as_hidden_dtype(hidden, weight, bias)
    rows = hidden.size // hidden.shape[-1]
    shapes = [jax.ShapeDtypeStruct((), jnp.float32)] + [jax.ShapeDtypeStruct((rows,), jnp.float32)] * 5
    if with_grad:
        shapes += [jax.ShapeDtypeStruct(hidden.shape, jnp.float32), jax.ShapeDtypeStruct(weight.shape, jnp.float32),
                   jax.ShapeDtypeStruct(bias.shape, jnp.float32)]
    target = "flashgrpo_linear_loss_grad" if with_grad else "flashgrpo_linear_loss"
    return jax.ffi.ffi_call(target, shapes, vmap_method="sequential")(
        hidden, weight, bias, *side, op=op, options=opts, **_budget_attrs(chunk))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _linear_loss(op, opts, chunk, hidden, weight, bias, *side):
    return _outputs_of(_linear_call(op, opts, chunk, hidden, weight, bias, side, False))


def _linear_loss_fwd(op, opts, chunk, hidden, weight, bias, *side):
    results = _linear_call(op, opts, chunk, hidden, weight, bias, side, True)
    # Empty arrays of the inputs' dtypes: the cotangents are cast back to them.
    dtypes = tuple(jnp.zeros((0,), x.dtype) for x in (hidden, weight, bias))
    return _outputs_of(results), (results[6:9], dtypes)


def _linear_loss_bwd(op, opts, chunk, residual, cotangents):
    grads, dtypes = residual
    g = cotangents[0].astype(jnp.float32)
    return tuple((grad * g).astype(like.dtype) for grad, like in zip(grads, dtypes)) + _NO_COTANGENTS


_linear_loss.defvjp(_linear_loss_fwd, _linear_loss_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _linear_rows(op, values, opts, chunk, hidden, weight, bias, *side):
    """The per-token outputs ``values`` of a fused-linear loss, each differentiable with its own
    cotangent: the forward keeps each row's unit gradient scalars, the backward's custom call folds
    the cotangents into them before the products that mix the rows (the logits recomputed there:
    four products in all, as on the PyTorch side)."""
    return _linear_rows_fwd(op, values, opts, chunk, hidden, weight, bias, *side)[0]


def _linear_rows_fwd(op, values, opts, chunk, hidden, weight, bias, *side):
    _register()
    results = jax.ffi.ffi_call("flashgrpo_linear_rows", _rows_results(hidden, values), vmap_method="sequential")(
        hidden, *_as_hidden_dtype(hidden, weight, bias), *side, op=op, options=opts, outputs=_kept(values),
        **_budget_attrs(chunk))
    out, kept = _picked(results, values)
    return out, (hidden, weight, bias, side, kept)


def _linear_rows_bwd(op, values, opts, chunk, residual, cotangents):
    hidden, weight, bias, side, kept = residual
    shapes = [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (hidden, weight, bias)]
    grads = jax.ffi.ffi_call("flashgrpo_linear_rows_grad", shapes, vmap_method="sequential")(
        hidden, *_as_hidden_dtype(hidden, weight, bias), *side, kept, *_flat(cotangents), op=op, options=opts,
        outputs=_kept(values), **_budget_attrs(chunk))
    return tuple(g.astype(x.dtype) for g, x in zip(grads, (hidden, weight, bias))) + _NO_COTANGENTS


_linear_rows.defvjp(_linear_rows_fwd, _linear_rows_bwd)


def _linear_inputs(hidden, weight, bias, row_inputs):
    """The fused-linear call's arguments, checked: hidden, weight, bias (empty when absent) and the
    eight other inputs. A weight or bias of another dtype than ``hidden`` is cast to it inside the
    custom calls' VJPs (``_as_hidden_dtype``)."""
    hidden, weight = _float_input("hidden", hidden), _float_input("weight", weight)
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"`hidden` {list(hidden.shape)} and `weight` {list(weight.shape)}: expected [.., H] and "
                         f"[V, H]")
    bias = jnp.zeros((0,), hidden.dtype) if bias is None else _float_input("bias", bias)
    batch, seq_len = _rows("hidden", hidden, "H")
    return hidden, weight, bias, _per_row(batch, seq_len, weight.shape[0], **row_inputs)


def _run_linear_rows(op, value, hidden, weight, bias, options, chunk_memory_mb, bf16_products=None, **row_inputs):
    hidden, weight, bias, side = _linear_inputs(hidden, weight, bias, row_inputs)
    if hidden.size == 0:
        _options_json(options)
        return _empty_batch(value, hidden.shape[:-1], hidden)[0]
    chunk = _budget(chunk_memory_mb, bf16_products, hidden, weight, bias)
    (out,) = _linear_rows(op, (value,), _options_json(options), chunk, hidden, weight, bias, *side)
    return out.reshape(hidden.shape[:-1])


def _run_linear(op, hidden, weight, bias, options, chunk_memory_mb, bf16_products=None, **row_inputs):
    hidden, weight, bias, side = _linear_inputs(hidden, weight, bias, row_inputs)
    if hidden.size == 0:
        _options_json(options)
        return _empty_batch("loss", hidden.shape[:-1], hidden)
    chunk = _budget(chunk_memory_mb, bf16_products, hidden, weight, bias)
    loss, per_token = _linear_loss(op, _options_json(options), chunk, hidden, weight, bias, *side)
    shape = hidden.shape[:-1]
    return loss, {k: jax.lax.stop_gradient(v).reshape(shape) for k, v in per_token.items()}


def fused_linear_grpo_loss(hidden, weight, targets, advantages, mask=None, *, bias=None, old_logp=None, ref_logp=None,
                           is_ratio=None, sampling_logp=None, chunk_memory_mb=None, bf16_products=None,
                           return_outputs=False, **options):
    """``grpo_loss`` of ``hidden [B, T, H] @ weight[V, H]^T (+ bias)``, streamed over the vocabulary;
    differentiable in ``hidden``, ``weight`` and ``bias``. ``bf16_products`` as in
    ``flashgrpo.torch.fused_linear_grpo_loss`` (``"auto"``, ``"rounded"`` or a way's name)."""
    given = dict(targets=targets, mask=mask, advantages=advantages, old_logp=old_logp, ref_logp=ref_logp,
                 is_ratio=is_ratio, sampling_logp=sampling_logp)
    loss, per_token = _run_linear("grpo", hidden, weight, bias, options, chunk_memory_mb, bf16_products, **given)
    return _with_outputs(loss, per_token, "grpo", given, return_outputs)


def fused_linear_cross_entropy(hidden, weight, targets, *, bias=None, reduction="mean", ignore_index=-100,
                               label_smoothing=0.0, z_loss=0.0, mask=None, chunk_memory_mb=None, bf16_products=None,
                               class_weights=None, **options):
    """``cross_entropy`` of ``hidden @ weight^T (+ bias)``; ``reduction`` mean (default), sum or none
    (per token, differentiable per token); ``class_weights`` as in ``cross_entropy``. Gradients to
    ``hidden``, ``weight`` and ``bias``."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"`reduction` must be 'mean', 'sum' or 'none', got {reduction!r}")
    options = dict(options, reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing,
                   z_loss=z_loss)
    if reduction == "none":
        out = _run_linear_rows("cross_entropy", "per_token_loss", hidden, weight, bias, options, chunk_memory_mb,
                               bf16_products, targets=targets, mask=mask, class_weights=class_weights)
        return out.reshape(jnp.shape(targets))
    loss, _ = _run_linear("cross_entropy", hidden, weight, bias, options, chunk_memory_mb, bf16_products,
                          targets=targets, mask=mask, class_weights=class_weights)
    return loss


def fused_linear_logprob(hidden, weight, targets, *, bias=None, temperature=1.0, softcap=None,
                         chunk_memory_mb=None, bf16_products=None):
    """Per-token log-probabilities of ``targets`` under ``hidden @ weight^T + bias``, differentiable
    per token in ``hidden``, ``weight`` and ``bias``."""
    out = _run_linear_rows("logprob", "logp", hidden, weight, bias, dict(temperature=temperature, softcap=softcap),
                           chunk_memory_mb, bf16_products, targets=targets)
    return out.reshape(jnp.shape(targets))


def fused_linear_entropy(hidden, weight, *, bias=None, mask=None, temperature=1.0, softcap=None,
                         chunk_memory_mb=None, bf16_products=None):
    """Per-token entropy under ``hidden @ weight^T + bias``, differentiable per token in ``hidden``,
    ``weight`` and ``bias`` (as ``entropy``)."""
    return _run_linear_rows("entropy", "entropy", hidden, weight, bias, _entropy_options(temperature, softcap),
                            chunk_memory_mb, bf16_products, mask=mask)


def fused_linear_token_stats(hidden, weight, targets, *, bias=None, mask=None, temperature=1.0, softcap=None,
                             chunk_memory_mb=None, bf16_products=None):
    """``token_stats`` of ``hidden @ weight^T + bias`` without materialising the logits: one stream
    of the vocabulary forward and one backward whichever of the three outputs are back-propagated;
    gradients to ``hidden``, ``weight`` and ``bias``."""
    hidden, weight, bias, side = _linear_inputs(hidden, weight, bias, dict(targets=targets, mask=mask))
    opts = _options_json(dict(temperature=temperature, softcap=softcap))
    shape = jnp.shape(targets)
    if hidden.size == 0:
        return _empty_stats(shape, hidden)
    chunk = _budget(chunk_memory_mb, bf16_products, hidden, weight, bias)
    out = _linear_rows("logprob", TOKEN_STATS, opts, chunk, hidden, weight, bias, *side)
    return TokenStats(*(x.reshape(shape) for x in out))

"""flashgrpo's losses as PyTorch autograd functions and Liger-Kernel drop-in modules (CPU).

Every function reads the logits (or the hidden states and the lm_head) in place, from the
tensor's own memory, and writes the gradient into a tensor PyTorch allocates (or over the logits,
with ``in_place=True``). The kernels compute the gradient during the forward, in the same sweep
over the vocabulary, so the backward only scales it by the upstream gradient; where a per-token
upstream must reach each row's gradient before it is written (fused-linear per-token outputs,
``token_stats``) the forward keeps four numbers per row and the backward streams the vocabulary
once more. No ``[N, V]`` temporary is built in either direction.

Options are docs/LOSSES.md's (``loss_type``, ``beta``, ``epsilon_low``, ``temperature``, ...),
given as keyword arguments; an unknown name is a ``TypeError`` that names it.

Functions (logits ``[B, T, V]``; cross-entropy, entropy and log-probabilities also take ``[N, V]``):

- ``grpo_loss(logits, targets, advantages, mask=None, *, old_logp=None, ref_logp=None,
  is_ratio=None, sampling_logp=None, in_place=False, **options) -> LossOutputs``
- ``cross_entropy(logits, targets, *, reduction="mean", ignore_index=-100, ...) -> Tensor``
- ``entropy(logits, mask=None, *, temperature=1.0) -> Tensor`` (per token, differentiable)
- ``logprob(logits, targets, *, temperature=1.0) -> Tensor`` (per token, differentiable)
- ``token_stats(logits, targets, mask=None, *, temperature=1.0, softcap=None) -> TokenStats`` (per-token
  ``logp``, ``entropy``, ``lse``, all three differentiable)
- ``fused_linear_grpo_loss``, ``fused_linear_cross_entropy``, ``fused_linear_entropy``,
  ``fused_linear_logprob``, ``fused_linear_token_stats``: the same from ``hidden [.., H]``,
  ``weight [V, H]`` and ``bias [V]``.

Modules: ``FusedLinearGRPOLoss``, ``GRPOLoss``, ``CrossEntropyLoss`` and
``FusedLinearCrossEntropyLoss`` take the constructor and forward arguments of Liger-Kernel's
``LigerFusedLinearGRPOLoss``, ``triton_grpo_loss``, ``LigerCrossEntropyLoss`` and
``LigerFusedLinearCrossEntropyLoss`` and return what they return. ``FusedLinearForPPO`` is verl's
module of that name, ``liger_fused_linear_scaled_cross_entropy`` Liger's
``LigerFusedLinearScaledCrossEntropyFunction.apply``.
"""

import dataclasses
import math
import os
from typing import NamedTuple, Optional

import torch

from . import _native
from ._calls import PER_TOKEN, options_json, rows

_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}

# An address for an empty buffer: non-null and aligned for every element type, never read.
_EMPTY = 64

__all__ = [
    "LossOutputs",
    "grpo_loss",
    "cross_entropy",
    "entropy",
    "logprob",
    "fused_linear_grpo_loss",
    "fused_linear_cross_entropy",
    "fused_linear_entropy",
    "fused_linear_logprob",
    "TokenStats",
    "token_stats",
    "fused_linear_token_stats",
    "FusedLinearForPPO",
    "liger_fused_linear_scaled_cross_entropy",
    "FusedLinearGRPOLoss",
    "GRPOLoss",
    "CrossEntropyLoss",
    "FusedLinearCrossEntropyLoss",
    "CrossEntropyOutput",
    "triton_grpo_loss",
    "liger_fused_linear_grpo",
    "liger_cross_entropy",
    "liger_fused_linear_cross_entropy",
    "release_cached_memory",
]

# Gradients at least this large come from the native module's reusable buffers (see
# `_gradient_tensor`); FLASHGRPO_GRADIENT_CACHE=0 turns that off.
_CACHED_MIN_BYTES = 1 << 20
_CACHE = os.environ.get("FLASHGRPO_GRADIENT_CACHE", "1") != "0"


class LossOutputs(NamedTuple):
    """A loss and its per-token outputs (float32, the shape of ``targets``; ``None`` where the
    op does not compute them). Only ``loss`` carries a gradient."""

    loss: torch.Tensor
    per_token_loss: torch.Tensor
    logp: Optional[torch.Tensor]
    entropy: torch.Tensor
    kl: Optional[torch.Tensor]
    is_clipped: Optional[torch.Tensor]


# ---------------------------------------------------------------- checking and addressing tensors


def release_cached_memory():
    """Frees the gradient buffers kept for reuse (at most four, each the size of a gradient
    this process asked for)."""
    _native.release_cached_buffers()


def _gradient_tensor(shape, dtype):
    """An uninitialised tensor for a gradient. A large one lives in a buffer of the native module
    that returns to a free list when PyTorch frees the tensor, so the next step's gradient of the
    same size reuses memory whose pages are already mapped: a fresh `[N, V]` buffer would cost
    its page faults on every step (more than the kernels' sweep at N=1024, V=151936)."""
    n = math.prod(shape)
    size = n * torch.tensor([], dtype=dtype).element_size()
    if not _CACHE or size < _CACHED_MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(_native.gradient_buffer(size), dtype=dtype, count=n).view(shape)


def _as_dtype(grad, dtype):
    """``grad`` (the kernels' f32 gradient) in ``dtype``, its input's: a large one cast into a
    pooled buffer, whose pages are already mapped (``Tensor.to`` maps a fresh one on every step:
    80 ms against 17 ms for a 151936 x 896 lm_head's gradient on 2 cores)."""
    if grad.dtype == dtype:
        return grad
    return _gradient_tensor(grad.shape, dtype).copy_(grad)


def _address(t):
    return 0 if t is None else (t.data_ptr() if t.numel() else _EMPTY)


def _float_input(name, x):
    """A float tensor the kernels read in place: on the CPU, contiguous (a non-contiguous view is
    copied once), of float32, bfloat16 or float16."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise ValueError(f"`{name}` is on {x.device}; flashgrpo's Python kernels take CPU tensors")
    if x.dtype not in _DTYPES:
        raise TypeError(f"`{name}` has dtype {x.dtype}; expected torch.float32, torch.bfloat16 or torch.float16")
    return x.detach().contiguous()


def _small_input(name, x, dtype, shapes):
    """A per-row or per-sequence input (small): converted to ``dtype`` if needed, shape checked
    against ``shapes`` (the first is the canonical one)."""
    if x is None:
        return None
    x = torch.as_tensor(x)
    if x.device.type != "cpu":
        raise ValueError(f"`{name}` is on {x.device}; flashgrpo's Python kernels take CPU tensors")
    if tuple(x.shape) not in shapes:
        want = " or ".join(str(list(s)) for s in shapes)
        raise ValueError(f"`{name}` has shape {list(x.shape)}, expected {want}")
    if dtype == torch.int64 and (x.is_floating_point() or x.is_complex()):
        raise TypeError(f"`{name}` has dtype {x.dtype}; expected an integer dtype (token ids)")
    return x.detach().to(dtype).contiguous()


class _Rows:
    """The row inputs of one call, converted and kept alive for its length."""

    def __init__(self, batch, seq_len, vocab, targets=None, mask=None, advantages=None, old_logp=None,
                 ref_logp=None, is_ratio=None, sampling_logp=None, class_weights=None):
        if vocab == 0:
            raise ValueError("the vocabulary (the logits' last axis, or the weight's rows) is empty")
        bt = [(batch, seq_len)]
        if seq_len == batch * seq_len:  # [N, V] inputs: per-row tensors may be [N] too
            bt.append((seq_len,))
        f32, i64 = torch.float32, torch.int64
        self.tensors = dict(
            targets=_small_input("targets", targets, i64, bt),
            mask=_small_input("mask", mask, f32, bt),
            advantages=_small_input("advantages", advantages, f32, [(batch,), (batch, 1)]),
            old_logp=_small_input("old_logp", old_logp, f32, bt),
            ref_logp=_small_input("ref_logp", ref_logp, f32, bt),
            is_ratio=_small_input("is_ratio", is_ratio, f32, bt + [(batch,), (batch, 1)]),
            sampling_logp=_small_input("sampling_logp", sampling_logp, f32, bt),
            class_weights=_small_input("class_weights", class_weights, f32, [(vocab,)]),
        )
        per_sequence = is_ratio is not None and self.tensors["is_ratio"].numel() == batch and seq_len != 1
        self.native = rows(batch, seq_len, vocab, is_ratio_per_sequence=per_sequence,
                           **{k: _address(t) for k, t in self.tensors.items()})


def _per_token(result, n, shape):
    out = {}
    for name in PER_TOKEN + ("lse",):
        if result.has(name):
            t = torch.empty(n, dtype=torch.float32)
            result.copy_into(name, _address(t), n)
            out[name] = t.reshape(shape)
        else:
            out[name] = None
    out["predicted_tokens"] = None
    if result.has("predicted_tokens"):
        t = torch.empty(n, dtype=torch.int64)
        result.copy_tokens_into(_address(t), n)
        out["predicted_tokens"] = t.reshape(shape)
    return out


# ---------------------------------------------------------------- autograd


class _KernelGradients(torch.autograd.Function):
    """``value``, whose backward hands out the gradients the kernels computed in the forward,
    scaled by the upstream gradient. ``per_row="rows"``: ``value`` is per token and the gradients
    are of its sum, so row ``i`` of the logits' gradient is scaled by ``upstream[i]`` (logits-level
    ops whose rows do not mix only: a fused-linear gradient mixes the rows, and a sequence-level
    loss a sequence's; those take ``_DeferredGradients`` instead)."""

    @staticmethod
    def forward(ctx, value, grads, per_row, *inputs):
        ctx.grads = grads
        ctx.per_row = per_row
        ctx.dtypes = [None if x is None else x.dtype for x in inputs]
        return value.clone()

    @staticmethod
    def backward(ctx, upstream):
        grads = _take_once(ctx, "grads")
        out = []
        for grad, dtype in zip(grads, ctx.dtypes):
            if grad is not None:
                grad = _as_dtype(_scaled(grad, upstream, ctx.per_row), dtype)
            out.append(grad)
        return (None, None, None, *out)


def _take_once(ctx, name):
    """What the forward left in ``ctx.<name>`` for the one backward (then forgotten, so that the
    gradient buffers are freed with the graph)."""
    value = getattr(ctx, name)
    if value is None:
        raise RuntimeError("flashgrpo: this loss's gradient was already used; backward through it twice "
                           "(retain_graph=True) is not supported")
    setattr(ctx, name, None)
    return value


def _scaled(grad, upstream, per_row):
    """``grad * upstream``, in place (the kernels' gradient buffer is ours to overwrite)."""
    if per_row == "rows":
        return grad.mul_(upstream.to(torch.float32).reshape(*grad.shape[:-1], 1))
    k = float(upstream)
    return grad if k == 1.0 else grad.mul_(k)


class _DeferredGradients(torch.autograd.Function):
    """``value``, whose gradient the kernels write in the backward (``pending``, a
    ``DeferredGradient`` of the native module): the upstream gradient is folded into each row's
    gradient scalars before the pass that writes it, so it may differ from token to token even
    for a fused-linear loss or a sequence-level one, and a logits-level gradient is written only
    then: over the logits with ``in_place`` (Liger's ``inplace``: the logits keep their values
    until the backward), else over a copy of them. ``scores`` are the contiguous tensors the
    kernels read (kept unchanged until then: the originals are saved for PyTorch's in-place
    modification check); ``per_row``: ``value`` is per token."""

    @staticmethod
    def forward(ctx, value, pending, scores, per_row, in_place, *inputs):
        _keep_for_backward(ctx, pending, scores, in_place, inputs)
        ctx.per_row = per_row
        return value.clone()

    @staticmethod
    def backward(ctx, upstream):
        scale, row_scale = 1.0, None
        if ctx.per_row:
            row_scale = upstream.detach().to(torch.float32).contiguous().reshape(-1)
        else:
            scale = float(upstream)
        return (None, None, None, None, None, *_write_deferred(ctx, scale, row_scale))


class TokenStats(NamedTuple):
    """Each token's ``log p(target)``, entropy and ``lse = logsumexp(logits / temperature)``
    (float32, the shape of ``targets``; 0 on masked rows), each differentiable."""

    logp: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor


class _DeferredTokenStats(torch.autograd.Function):
    """``logp``, ``entropy`` and ``lse`` per token, whose gradients the kernels write in the
    backward from the three upstreams at once, in one pass over the vocabulary (each row's
    gradient is ``a [j = y] + p_j (b + c log p_j)`` whichever of the three it comes from). The
    rest as ``_DeferredGradients``."""

    @staticmethod
    def forward(ctx, pending, scores, logp, entropy, lse, *inputs):
        ctx.set_materialize_grads(False)
        _keep_for_backward(ctx, pending, scores, False, inputs)
        return logp.clone(), entropy.clone(), lse.clone()

    @staticmethod
    def backward(ctx, d_logp, d_entropy, d_lse):
        def flat(g):
            return None if g is None else g.detach().to(torch.float32).contiguous().reshape(-1)

        if d_logp is None and d_entropy is None and d_lse is None:
            return (None,) * (5 + len(ctx.dtypes))
        # Without an upstream on `logp`, its gradient is scaled by 0 (not run again with zeros).
        scale = 1.0 if d_logp is not None else 0.0
        grads = _write_deferred(ctx, scale, flat(d_logp), flat(d_entropy), flat(d_lse))
        return (None, None, None, None, None, *grads)


def _keep_for_backward(ctx, pending, scores, in_place, inputs):
    """What a deferred function's backward needs: the pending gradient, the tensors the kernels
    read, each input's dtype and whether it wants a gradient; the inputs saved for PyTorch's
    in-place modification check."""
    ctx.pending, ctx.scores, ctx.in_place = pending, scores, in_place
    ctx.dtypes = [None if x is None else x.dtype for x in inputs]
    ctx.wants = [x is not None and x.requires_grad for x in inputs]
    ctx.save_for_backward(*[x for x in inputs if x is not None])


def _write_deferred(ctx, scale, row_scale, entropy_scale=None, lse_scale=None):
    """Writes the gradient a deferred function's forward left pending, with these upstreams (of
    the loss: ``scale`` and per row ``row_scale``; of the ``entropy`` and ``lse`` outputs per row);
    the gradients of the inputs, each in its own dtype (``None`` where not wanted)."""
    pending = _take_once(ctx, "pending")
    ctx.saved_tensors  # noqa: B018 -- raises if an input was modified in place since the forward
    scores = _take_once(ctx, "scores")
    upstreams = dict(scale=scale, rows=_address(row_scale), entropy=_address(entropy_scale), lse=_address(lse_scale))
    if len(scores) == 1:
        grad = scores[0] if ctx.in_place else scores[0].clone()
        pending.write_logits(_address(grad), upstreams)
        grads = [grad]
    else:
        grads = _write_linear_gradients(pending, scores, ctx.wants, upstreams)
    return [None if g is None or not want else _as_dtype(g, dtype)
            for g, want, dtype in zip(grads, ctx.wants, ctx.dtypes)]


def _write_linear_gradients(pending, scores, wants, upstreams):
    h, w, b = scores
    f32 = torch.float32
    grads = (_gradient_tensor(h.shape, f32), _gradient_tensor(w.shape, f32) if wants[1] else None,
             torch.empty(b.shape, dtype=f32) if b is not None and wants[2] else None)
    addresses = dict(hidden=_address(grads[0]), weight=_address(grads[1]), bias=_address(grads[2]), accumulate=False)
    pending.write_linear(_address(h), _address(w), _address(b), addresses, upstreams)
    return grads


def _wants_gradient(*inputs):
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)


def _has_gradient(op, options):
    """Whether ``op`` with ``options`` has a gradient output: the kernels' one rule (every op but
    entropy, which has one with ``entropy_gradient``)."""
    return _native.has_gradient(op, options_json(options))


def _entropy_options(temperature, softcap, *inputs):
    """The entropy's options: with its gradient, per token (each row's weight 1), where an input
    requires one."""
    options = dict(temperature=temperature, softcap=softcap)
    if _wants_gradient(*inputs):
        options.update(entropy_gradient=True, reduction="none")
    return options


# ---------------------------------------------------------------- the two calls


def _refuse_tokens(options, tokens):
    """``predicted_tokens`` only where the caller hands the tokens back (the cross-entropy modules):
    elsewhere it would be computed and dropped."""
    if options.get("predicted_tokens") and not tokens:
        raise ValueError("`predicted_tokens` has no output here: use CrossEntropyLoss or FusedLinearCrossEntropyLoss "
                         "with return_predicted_tokens=True / return_token_accuracy=True, or flashgrpo.arrays")


def _logits_call(op, logits, options, in_place=False, per_row=None, out_shape=None, defer=False, tokens=False,
                 token_stats=False, **row_inputs):
    """Runs ``op`` over logits ``[B, T, V]`` (or ``[N, V]``); returns the loss value (with the
    kernels' gradient attached when the logits require one) and the per-token outputs. ``defer``:
    the gradient is written in the backward, over the logits with ``in_place`` (Liger's
    ``inplace``), else over a copy of them (see ``_DeferredGradients``): what a per-token loss whose
    rows mix within a sequence (sequence-level importance sampling) needs for a per-token upstream.
    ``token_stats``: the value is ``TokenStats``, each differentiable (with ``defer``)."""
    _refuse_tokens(options, tokens)
    x = _float_input("logits", logits)
    if x.dim() not in (2, 3):
        raise ValueError(f"`logits` must be [B, T, V] or [N, V], got shape {list(x.shape)}")
    if x.dim() == 2:
        (n, vocab), batch = x.shape, 1
        seq_len = n
    else:
        batch, seq_len, vocab = x.shape
    out_shape = out_shape or x.shape[:-1]
    request = _Rows(batch, seq_len, vocab, **row_inputs)
    wants_grad = _has_gradient(op, options) and _wants_gradient(logits)
    if wants_grad and in_place and x.data_ptr() != logits.data_ptr():
        raise ValueError("`in_place=True` needs contiguous logits (the gradient is written over them)")
    native = (op, _DTYPES[x.dtype], _address(x), request.native, options_json(options))
    deferred = wants_grad and defer
    grad = _gradient_tensor(x.shape, x.dtype) if wants_grad and not in_place and not deferred else None
    if deferred:
        result, pending = _native.loss_deferred(*native)
    else:
        result = _native.loss(*native, grad=_address(grad), in_place=wants_grad and in_place)
    per_token = _per_token(result, batch * seq_len, out_shape)
    if token_stats:
        return _token_stats(per_token, pending if deferred else None, (x,), logits), per_token
    value = per_token[per_row] if per_row else torch.tensor(result.loss, dtype=torch.float32)
    if deferred:
        value = _DeferredGradients.apply(value, pending, (x,), per_row is not None, in_place, logits)
    elif wants_grad:
        rows = "rows" if per_row else None
        value = _KernelGradients.apply(value, (x if in_place else grad,), rows, logits)
    return value, per_token


def _default_products(*inputs):
    """The bf16 products' way when the caller names none: ``rounded`` where every gradient handed
    back is bf16 (each comes back in its input's dtype), else ``auto`` (f32-grade), as
    ``Bf16Choice::default_for`` decides for every front end (docs/PYTHON.md)."""
    handed_back = [x for x in inputs if x is not None and x.requires_grad]
    return _native.default_bf16_products(bool(handed_back) and all(x.dtype == torch.bfloat16 for x in handed_back))


def _linear_call(op, hidden, weight, bias, options, per_row=None, out_shape=None, chunk_memory_mb=None,
                 bf16_products=None, tokens=False, token_stats=False, **row_inputs):
    """Runs ``op`` over ``hidden [B, T, H] (or [N, H]) @ weight[V, H]^T + bias``. A weight or bias
    of another dtype than ``hidden`` is cast to it (a copy, as Liger-Kernel casts the weight); the
    gradients come back in each input's own dtype. A per-token ``value`` (``per_row``) gets its
    gradients in the backward, where the upstream gradient of each token is known;
    ``token_stats``: the value is ``TokenStats``, each differentiable (with ``per_row``)."""
    _refuse_tokens(options, tokens)
    h = _float_input("hidden", hidden)
    w = _float_input("weight", weight)
    b = None if bias is None else _float_input("bias", bias)
    if h.dim() not in (2, 3) or w.dim() != 2 or h.shape[-1] != w.shape[1]:
        raise ValueError(f"`hidden` {list(h.shape)} and `weight` {list(w.shape)}: expected [B, T, H] or [N, H] "
                         f"and [V, H] with the same H")
    w = w if w.dtype == h.dtype else w.to(h.dtype)
    b = b if b is None or b.dtype == h.dtype else b.to(h.dtype)
    vocab, hidden_size = w.shape
    if b is not None and tuple(b.shape) != (vocab,):
        raise ValueError(f"`bias` has shape {list(b.shape)}, expected [{vocab}]")
    batch, seq_len = (1, h.shape[0]) if h.dim() == 2 else h.shape[:2]
    out_shape = out_shape or h.shape[:-1]
    request = _Rows(batch, seq_len, vocab, **row_inputs)
    wants_grad = _has_gradient(op, options) and _wants_gradient(hidden, weight, bias)
    chunk = chunk_memory_mb or _native.DEFAULT_CHUNK_MEMORY_MB
    products = bf16_products or _default_products(hidden, weight, bias)
    native = (op, _DTYPES[h.dtype], _address(h), _address(w), _address(b), hidden_size, request.native,
              options_json(options))
    # A per-token value's gradients wait for the backward, where each token's upstream is known.
    deferred = wants_grad and per_row is not None
    eager = wants_grad and not deferred
    f32 = torch.float32
    grads = (
        _gradient_tensor(h.shape, f32) if eager else None,
        _gradient_tensor(w.shape, f32) if eager and weight.requires_grad else None,
        torch.empty(vocab, dtype=f32) if eager and bias is not None and bias.requires_grad else None,
    )
    if deferred:
        result, pending = _native.linear_loss_deferred(*native, chunk, products)
    else:
        addresses = dict(hidden=_address(grads[0]), weight=_address(grads[1]), bias=_address(grads[2]),
                         accumulate=False)
        result = _native.linear_loss(*native, addresses, chunk, products)
    per_token = _per_token(result, batch * seq_len, out_shape)
    if token_stats:
        return _token_stats(per_token, pending if deferred else None, (h, w, b), hidden, weight, bias), per_token
    value = per_token[per_row] if per_row else torch.tensor(result.loss, dtype=f32)
    if deferred:
        value = _DeferredGradients.apply(value, pending, (h, w, b), True, False, hidden, weight, bias)
    elif eager:
        kept = (grads[0] if hidden.requires_grad else None, grads[1], grads[2])
        value = _KernelGradients.apply(value, kept, None, hidden, weight, bias)
    return value, per_token


def _token_stats(per_token, pending, scores, *inputs):
    """``TokenStats`` of the per-token outputs, differentiable when the gradient is ``pending``."""
    stats = (per_token["logp"], per_token["entropy"], per_token["lse"])
    return TokenStats(*(stats if pending is None else _DeferredTokenStats.apply(pending, scores, *stats, *inputs)))


def _outputs(value, per_token):
    return LossOutputs(value, per_token["per_token_loss"], per_token["logp"], per_token["entropy"],
                       per_token["kl"], per_token["is_clipped"])


# ---------------------------------------------------------------- functions


def grpo_loss(logits, targets, advantages, mask=None, *, old_logp=None, ref_logp=None, is_ratio=None,
              sampling_logp=None, in_place=False, **options):
    """The GRPO loss (and its PPO-family variants, ``loss_type``) of logits ``[B, T, V]``.

    ``targets [B, T]`` are the completion's tokens, ``advantages [B]``, ``mask [B, T]`` the
    completion mask; ``old_logp`` / ``ref_logp`` / ``sampling_logp [B, T]`` and ``is_ratio``
    (``[B, T]`` per token or ``[B]`` per sequence) as in LOSSES.md. With ``in_place=True`` and
    logits that require a gradient, the gradient is written over the logits (their values are
    lost; no second ``[B, T, V]`` buffer). Returns ``LossOutputs``."""
    if logits.dim() != 3:
        raise ValueError(f"`logits` must be [B, T, V], got shape {list(logits.shape)}")
    value, per_token = _logits_call("grpo", logits, options, in_place, targets=targets, mask=mask,
                                    advantages=advantages, old_logp=old_logp, ref_logp=ref_logp,
                                    is_ratio=is_ratio, sampling_logp=sampling_logp)
    return _outputs(value, per_token)


def cross_entropy(logits, targets, *, reduction="mean", ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                  mask=None, in_place=False, class_weights=None, weight=None, **options):
    """Cross-entropy of logits ``[N, V]`` or ``[B, T, V]`` (the class dimension last, as Liger's)
    against ``targets``: ``reduction`` ``mean`` (over rows not ignored), ``sum`` or ``none``
    (per token, differentiable per token). ``class_weights [V]`` (or ``weight``, its name in
    ``F.cross_entropy``): per-class weights (``mean`` then divides by the rows' summed target
    weights). Unlike ``F.cross_entropy``, ``mean`` over no rows (or rows whose targets weigh 0 in
    all) is 0."""
    if weight is not None:
        if class_weights is not None:
            raise ValueError("`weight` and `class_weights` both give the class weights; pass one")
        class_weights = weight
    per_row = "per_token_loss" if reduction == "none" else None
    value, _ = _logits_call("cross_entropy", logits, dict(options, reduction=reduction, ignore_index=ignore_index,
                                                          label_smoothing=label_smoothing, z_loss=z_loss),
                            in_place, per_row=per_row, out_shape=targets.shape, targets=targets, mask=mask,
                            class_weights=_class_weights("class_weights", class_weights))
    return value


def entropy(logits, mask=None, *, temperature=1.0, softcap=None):
    """Per-token entropy of ``softmax(logits / temperature)``, the shape of ``logits[..., 0]`` (0
    where ``mask`` is 0), differentiable per token when ``logits`` requires a gradient (the kernels'
    ``entropy_gradient``: ``dH/du_j = -p_j (log p_j + H)``, written in the backward with each
    token's upstream folded in, over a copy of the logits). ``softcap=c``: of ``c tanh(logits / c)``."""
    options = _entropy_options(temperature, softcap, logits)
    per_row = "entropy" if options.get("entropy_gradient") else None
    # Deferred: the forward costs what the no-grad entropy costs (a caller logging the entropy of
    # logits that require a gradient pays nothing more), the gradient written only in a backward.
    value, per_token = _logits_call("entropy", logits, options, per_row=per_row, mask=mask, defer=True)
    return value if per_row else per_token["entropy"]


def logprob(logits, targets, *, temperature=1.0, softcap=None, in_place=False):
    """Per-token ``log_softmax(logits / temperature)[target]``, the shape of ``targets``,
    differentiable (TRL's ``selective_log_softmax``). ``softcap=c``: of ``c tanh(logits / c)``."""
    value, _ = _logits_call("logprob", logits, dict(temperature=temperature, softcap=softcap), in_place,
                            per_row="logp", out_shape=targets.shape, targets=targets)
    return value


def fused_linear_grpo_loss(hidden, weight, targets, advantages, mask=None, *, bias=None, old_logp=None,
                           ref_logp=None, is_ratio=None, sampling_logp=None, chunk_memory_mb=None,
                           bf16_products=None, **options):
    """``grpo_loss`` of ``hidden [B, T, H] @ weight[V, H]^T (+ bias [V])``, streamed over the
    vocabulary in chunks of at most ``chunk_memory_mb`` (the ``[B, T, V]`` logits are never built).
    Gradients flow to ``hidden``, ``weight`` and ``bias``, those that require one. With bf16
    inputs, ``bf16_products`` picks the products' way: ``"auto"`` (f32-grade gradients),
    ``"rounded"`` (the logits' gradient rounded to bf16 as PyTorch takes it: faster, bf16-grade
    ``hidden`` / ``weight`` gradients), or a way's name (``"widened"``, ``"amx"``, ...); ``None``
    (default): ``"rounded"`` where every gradient handed back is bf16 (they carry bf16's rounding
    anyway; docs/PYTHON.md), else ``"auto"``."""
    if hidden.dim() != 3:
        raise ValueError(f"`hidden` must be [B, T, H], got shape {list(hidden.shape)}")
    value, per_token = _linear_call("grpo", hidden, weight, bias, options, chunk_memory_mb=chunk_memory_mb,
                                    bf16_products=bf16_products, targets=targets, mask=mask, advantages=advantages,
                                    old_logp=old_logp, ref_logp=ref_logp, is_ratio=is_ratio,
                                    sampling_logp=sampling_logp)
    return _outputs(value, per_token)


def fused_linear_cross_entropy(hidden, weight, targets, *, bias=None, reduction="mean", ignore_index=-100,
                               label_smoothing=0.0, z_loss=0.0, mask=None, chunk_memory_mb=None,
                               bf16_products=None, class_weights=None, **options):
    """``cross_entropy`` of ``hidden @ weight^T (+ bias)``, streamed over the vocabulary
    (``bf16_products`` as in ``fused_linear_grpo_loss``, ``class_weights`` as in ``cross_entropy``)."""
    per_row = "per_token_loss" if reduction == "none" else None
    value, _ = _linear_call("cross_entropy", hidden, weight, bias,
                            dict(options, reduction=reduction, ignore_index=ignore_index,
                                 label_smoothing=label_smoothing, z_loss=z_loss),
                            per_row=per_row, out_shape=targets.shape, chunk_memory_mb=chunk_memory_mb,
                            bf16_products=bf16_products, targets=targets, mask=mask,
                            class_weights=_class_weights("class_weights", class_weights))
    return value


def fused_linear_entropy(hidden, weight, *, bias=None, mask=None, temperature=1.0, softcap=None,
                         chunk_memory_mb=None, bf16_products=None):
    """Per-token entropy of ``softmax((hidden @ weight^T + bias) / temperature)``, differentiable
    per token when an input requires a gradient (as ``entropy``; the gradients are written in the
    backward, where each token's upstream is known)."""
    options = _entropy_options(temperature, softcap, hidden, weight, bias)
    per_row = "entropy" if options.get("entropy_gradient") else None
    value, per_token = _linear_call("entropy", hidden, weight, bias, options, per_row=per_row,
                                    chunk_memory_mb=chunk_memory_mb, bf16_products=bf16_products, mask=mask)
    return value if per_row else per_token["entropy"]


def fused_linear_logprob(hidden, weight, targets, *, bias=None, temperature=1.0, softcap=None,
                         chunk_memory_mb=None, bf16_products=None):
    """Per-token log-probabilities of ``targets`` under ``hidden @ weight^T + bias``, differentiable
    per token (the gradients are written in the backward, where each token's upstream is known)."""
    value, _ = _linear_call("logprob", hidden, weight, bias, dict(temperature=temperature, softcap=softcap),
                            per_row="logp", out_shape=targets.shape, chunk_memory_mb=chunk_memory_mb,
                            bf16_products=bf16_products, targets=targets)
    return value


def token_stats(logits, targets, mask=None, *, temperature=1.0, softcap=None):
    """Each token's ``log p(target)``, entropy and ``lse`` under ``softmax(logits / temperature)``
    (``TokenStats``), all three differentiable: what verl's actor takes from the logits
    (log-probabilities and an entropy bonus, both back-propagated). The gradients of the three
    are written in one pass over the logits in the backward, from the three upstreams at once."""
    value, _ = _logits_call("logprob", logits, dict(temperature=temperature, softcap=softcap), defer=True,
                            out_shape=targets.shape, token_stats=True, targets=targets, mask=mask)
    return value


def fused_linear_token_stats(hidden, weight, targets, *, bias=None, mask=None, temperature=1.0, softcap=None,
                             chunk_memory_mb=None, bf16_products=None):
    """``token_stats`` of ``hidden @ weight^T + bias`` without materialising the logits: one
    stream of the vocabulary forward and one backward whichever of the three outputs are
    back-propagated (verl's ``FusedLinearForPPO`` and Liger's fused-linear scaled cross-entropy
    are built on it)."""
    value, _ = _linear_call("logprob", hidden, weight, bias, dict(temperature=temperature, softcap=softcap),
                            per_row="logp", out_shape=targets.shape, chunk_memory_mb=chunk_memory_mb,
                            bf16_products=bf16_products, token_stats=True, targets=targets, mask=mask)
    return value


# ---------------------------------------------------------------- Liger-Kernel drop-in modules


def _liger_metrics(per_token, mask, beta, loss_type):
    """Liger's metrics: the masked mean of the KL (when ``beta != 0``) and of the clipped tokens
    (0 for sapo and vespo, which Liger does not count as clipped)."""
    m = torch.ones_like(per_token["entropy"]) if mask is None else mask.to(torch.float32).reshape(
        per_token["entropy"].shape)
    count = m.sum().clamp(min=1.0)
    metrics = []
    if beta != 0.0:  # no KL computed: the reference is the policy itself, as in Liger without one
        metrics.append(torch.zeros(()) if per_token["kl"] is None else (per_token["kl"] * m).sum() / count)
    if loss_type in ("sapo", "vespo") or per_token["is_clipped"] is None:
        metrics.append(torch.zeros(()))
    else:
        metrics.append((per_token["is_clipped"] * m).sum() / count)
    return metrics


def _num_items(num_items_in_batch):
    if num_items_in_batch is None:
        return None
    return float(num_items_in_batch.item() if isinstance(num_items_in_batch, torch.Tensor) else num_items_in_batch)


# The loss types whose normaliser is `num_items` (LOSSES.md; Liger's `_compute_dapo_normalizer`).
_NUM_ITEMS_LOSS_TYPES = ("dapo", "cispo", "vespo")


def _liger_num_items(num_items_in_batch, mask, loss_type):
    """The dapo / cispo / vespo normaliser of the Liger drop-ins, as Liger-Kernel takes it
    (`_compute_dapo_normalizer`, both its chunked and its Triton loss): under `torch.distributed`,
    `num_items_in_batch / world_size` (TRL's `num_items_in_batch / num_processes`), or without it
    the mask's sum over every rank (an all-reduce) / world_size; in one process, the count as
    given or the local mask's sum (the kernels' own default). `flashgrpo.torch`'s own functions
    take `num_items` as LOSSES.md does, as given."""
    if loss_type not in _NUM_ITEMS_LOSS_TYPES:
        return _num_items(num_items_in_batch)
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if num_items_in_batch is not None:
        return _num_items(num_items_in_batch) / world
    if world == 1:
        return None
    total = mask.detach().to(torch.float32).sum().reshape(1)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return float(total.item()) / world


class FusedLinearGRPOLoss(torch.nn.Module):
    """Drop-in for ``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss``: the same constructor
    (``compiled`` and ``chunk_size`` accepted and ignored: the kernels choose their chunks from
    ``chunk_memory_mb``), the same forward, and the same result ``(loss, [kl_mean,] clip_ratio)``.
    Extra LOSSES.md options may be given as keyword arguments to the constructor."""

    def __init__(self, beta=0.04, compiled=True, use_ref_model=True, chunk_size=1, epsilon_low=0.2,
                 epsilon_high=0.2, loss_type="dapo", max_completion_length=None, importance_sampling_level="token",
                 sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, temperature=1.0, delta=None,
                 use_bias_correction_kl=False, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                 vespo_lambda_neg=2.0, chunk_memory_mb=None, bf16_products=None, **options):
        super().__init__()
        del compiled, chunk_size
        _check_liger_options(sapo_temperature_pos, sapo_temperature_neg, delta)
        self.use_ref_model = use_ref_model
        self.chunk_memory_mb = chunk_memory_mb
        self.bf16_products = bf16_products
        self.options = dict(options, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                            loss_type=loss_type, max_completion_length=max_completion_length,
                            importance_sampling_level=importance_sampling_level,
                            sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                            temperature=temperature, delta=delta, use_bias_correction_kl=use_bias_correction_kl,
                            vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                            vespo_lambda_neg=vespo_lambda_neg)
        options_json(self.options)  # an unknown option fails here, not at the first step

    def forward(self, _input, lin_weight, selected_token_ids, attention_mask, advantages, bias=None,
                ref_per_token_logps=None, old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None,
                vllm_is_ratio=None, num_items_in_batch=None):
        _check_liger_sequence_level(self.options["loss_type"], self.options["importance_sampling_level"])
        if self.options["loss_type"] == "dr_grpo" and self.options["max_completion_length"] is None:
            raise ValueError("max_completion_length must be provided for loss_type 'dr_grpo'")
        if not self.use_ref_model:
            ref_per_token_logps = None  # Liger ignores a reference it was told not to use
        elif ref_per_token_logps is None and ref_input is None:
            raise ValueError("FusedLinearGRPOLoss(use_ref_model=True) needs `ref_per_token_logps` or `ref_input` "
                             "(as Liger's); without a reference model pass use_ref_model=False")
        elif ref_per_token_logps is None:
            with torch.no_grad():
                ref_per_token_logps = fused_linear_logprob(
                    ref_input, lin_weight if ref_weight is None else ref_weight, selected_token_ids,
                    bias=ref_bias, temperature=self.options["temperature"], softcap=self.options.get("softcap"),
                    chunk_memory_mb=self.chunk_memory_mb, bf16_products=self.bf16_products)
        counted = torch.ones(selected_token_ids.shape) if attention_mask is None else attention_mask
        num_items = _liger_num_items(num_items_in_batch, counted, self.options["loss_type"])
        options = dict(self.options, num_items=num_items)
        if ref_per_token_logps is None:
            # Liger's reference is then the policy itself (detached): the KL term and its gradient
            # are 0, which is the loss without it; the KL metric is still reported, as 0.
            options["beta"] = 0.0
        out = fused_linear_grpo_loss(
            _input, lin_weight, selected_token_ids, advantages, attention_mask, bias=bias,
            old_logp=old_per_token_logps, ref_logp=ref_per_token_logps, is_ratio=vllm_is_ratio,
            chunk_memory_mb=self.chunk_memory_mb, bf16_products=self.bf16_products, **options)
        per_token = out._asdict()
        return out.loss, tuple(_liger_metrics(per_token, attention_mask, self.options["beta"],
                                              self.options["loss_type"]))


def liger_fused_linear_grpo(_input, weight, selected_token_ids, attention_mask, advantages, bias=None,
                            ref_per_token_logps=None, old_per_token_logps=None, ref_input=None, ref_weight=None,
                            ref_bias=None, beta=0.04, epsilon_low=0.2, epsilon_high=0.2, loss_type="dapo",
                            max_completion_length=None, importance_sampling_level="token", sapo_temperature_pos=1.0,
                            sapo_temperature_neg=1.05, temperature=1.0, compiled=True, use_ref_model=True,
                            chunk_size=1, vllm_is_ratio=None, delta=None, use_bias_correction_kl=False,
                            vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
                            num_items_in_batch=None):
    """Drop-in for ``liger_kernel.chunked_loss.functional.liger_fused_linear_grpo``
    (``LigerFusedLinearGRPOFunction.apply``): the same arguments in the same order, the same
    ``(loss, metrics)``."""
    module = FusedLinearGRPOLoss(
        beta=beta, compiled=compiled, use_ref_model=use_ref_model, chunk_size=chunk_size, epsilon_low=epsilon_low,
        epsilon_high=epsilon_high, loss_type=loss_type, max_completion_length=max_completion_length,
        importance_sampling_level=importance_sampling_level, sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg, temperature=temperature, delta=delta,
        use_bias_correction_kl=use_bias_correction_kl, vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg)
    return module(_input, weight, selected_token_ids, attention_mask, advantages, bias, ref_per_token_logps,
                  old_per_token_logps, ref_input, ref_weight, ref_bias, vllm_is_ratio, num_items_in_batch)


def _check_liger_sequence_level(loss_type, importance_sampling_level):
    """The loss types both of Liger-Kernel's GRPO losses refuse at sequence level (ours would run
    them, LOSSES.md; the drop-ins refuse as Liger does, with its messages)."""
    if importance_sampling_level != "sequence":
        return
    if loss_type == "vespo":
        raise ValueError("loss_type='vespo' requires importance_sampling_level='token'.")
    if loss_type in ("cispo", "sapo"):
        raise ValueError(f"Sequence-level importance sampling is not supported for loss_type='{loss_type}'. "
                         f"Use importance_sampling_level='token' instead.")


def _check_liger_options(sapo_temperature_pos, sapo_temperature_neg, delta):
    """The option values Liger-Kernel refuses when a loss is built."""
    for name, value in (("sapo_temperature_pos", sapo_temperature_pos), ("sapo_temperature_neg",
                                                                         sapo_temperature_neg)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if delta is not None and delta <= 0:
        raise ValueError(f"delta must be positive, got {delta}")


# Loss types whose tokens' losses mix within a sequence: no per-token loss with a gradient of its
# own token's row (the kernels' options check refuses `token-sum` with them too; this says it in
# Liger's terms).
_TOKEN_MIXING_LOSS_TYPES = ("geo_mean", "kl_cov", "clip_cov")


def triton_grpo_loss(logits, old_logp, ref_logp, completion_ids, advantages, completion_mask=None, temperature=0.9,
                     beta=0.04, eps_low=0.2, eps_high=0.4, inplace=True, loss_type="dapo", max_completion_length=None,
                     importance_sampling_level="token", reduce=False, sapo_temperature_pos=1.0,
                     sapo_temperature_neg=1.05, vllm_is_ratio=None, delta=None, use_bias_correction_kl=False,
                     num_items_in_batch=None, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                     vespo_lambda_neg=2.0):
    """Drop-in for ``liger_kernel.transformers.grpo_loss.triton_grpo_loss``: logits ``[B, L+1, V]``
    (the last position is not scored, as there) or ``[B, L, V]``. ``reduce=True`` returns
    ``(loss, [kl_mean,] clip_ratio)``; ``reduce=False`` ``(per_token_loss, per_token_kl, is_clipped)``
    ``[B, L]``, the per-token loss differentiable per token (with sequence-level importance
    sampling the gradient is written in the backward, so that the upstream of each token reaches
    its sequence's shared weight, as Liger's). ``inplace=True``: as in Liger, the gradient is written over the logits in the
    backward; the logits keep their values until then."""
    # As Liger's Triton loss: `delta = 0` is off, `delta` with cispo / sapo / vespo an error, and
    # the sapo temperatures read (and checked) for sapo alone; checked in Liger's order.
    if loss_type == "vespo":
        _check_liger_sequence_level(loss_type, importance_sampling_level)
    if delta is not None and loss_type in ("cispo", "sapo", "vespo"):
        raise ValueError(f"delta (two-sided clipping) is not supported for loss_type='{loss_type}'")
    if delta == 0.0:
        delta = None
    _check_liger_sequence_level(loss_type, importance_sampling_level)
    if loss_type != "sapo":
        sapo_temperature_pos, sapo_temperature_neg = 1.0, 1.05
    _check_liger_options(sapo_temperature_pos, sapo_temperature_neg, delta)
    batch, length = completion_ids.shape
    if logits.dim() != 3 or logits.shape[0] != batch or logits.shape[1] not in (length, length + 1):
        raise ValueError(f"`logits` has shape {list(logits.shape)}; expected [B, L+1, V] or [B, L, V] with "
                         f"[B, L] = {[batch, length]} (the shape of `completion_ids`)")
    extra = logits.shape[1] - length
    mask = torch.ones(batch, length) if completion_mask is None else completion_mask.to(torch.float32)

    def widen(x, fill=0.0):  # one masked position at the end, so the logits are used as they lie
        if x is None or not extra:
            return x
        x = torch.as_tensor(x)
        return torch.cat([x, torch.full((batch, 1), fill, dtype=x.dtype)], dim=1)

    isr = vllm_is_ratio
    if isr is not None and isr.dim() == 2 and isr.shape[1] == 1:
        isr = isr.reshape(batch)
    options = dict(temperature=temperature, beta=beta, epsilon_low=eps_low, epsilon_high=eps_high,
                   loss_type=loss_type, max_completion_length=max_completion_length or length,
                   importance_sampling_level=importance_sampling_level, sapo_temperature_pos=sapo_temperature_pos,
                   sapo_temperature_neg=sapo_temperature_neg, delta=delta,
                   use_bias_correction_kl=use_bias_correction_kl,
                   num_items=_liger_num_items(num_items_in_batch, mask, loss_type),
                   vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                   vespo_lambda_neg=vespo_lambda_neg)
    per_row = None
    if not reduce and loss_type in _TOKEN_MIXING_LOSS_TYPES:
        raise ValueError(f"triton_grpo_loss(reduce=False) returns per-token losses; `{loss_type}` mixes the "
                         f"tokens of a sequence (use reduce=True)")
    if not reduce:  # each token's own loss, its gradient scaled in the backward by that token's upstream
        options["loss_agg_mode"] = "token-sum"
        per_row = "per_token_loss"
    # A sequence-level per-token loss mixes a sequence's rows: its gradient waits for the upstream.
    defer = inplace or (per_row is not None and importance_sampling_level == "sequence")
    value, per_token = _logits_call(
        "grpo", logits, options, in_place=inplace, per_row=per_row, defer=defer,
        targets=widen(completion_ids), mask=widen(mask), advantages=advantages, old_logp=widen(old_logp),
        ref_logp=widen(ref_logp), is_ratio=isr if isr is None or isr.dim() == 1 else widen(isr, 1.0),
        sampling_logp=None)
    per_token = {k: (None if v is None else v[:, :length]) for k, v in per_token.items()}
    if not reduce:
        kl = per_token["kl"] if beta != 0.0 else None
        clipped = per_token["is_clipped"]
        if loss_type in ("sapo", "vespo") and clipped is not None:
            clipped = torch.zeros_like(clipped)  # Liger counts no token of these as clipped
        return value[:, :length], kl, clipped
    return value, _liger_metrics(per_token, mask, beta, loss_type)


class GRPOLoss(torch.nn.Module):
    """The logits-level GRPO loss as a module: the constructor takes ``triton_grpo_loss``'s options
    (Liger-Kernel's logits-level GRPO), the forward its tensors, and it returns
    ``(loss, [kl_mean,] clip_ratio)`` as ``triton_grpo_loss(..., reduce=True)`` does."""

    def __init__(self, temperature=0.9, beta=0.04, eps_low=0.2, eps_high=0.4, inplace=True, loss_type="dapo",
                 max_completion_length=None, importance_sampling_level="token", sapo_temperature_pos=1.0,
                 sapo_temperature_neg=1.05, delta=None, use_bias_correction_kl=False, vespo_k_pos=2.0,
                 vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0):
        super().__init__()
        self.options = dict(temperature=temperature, beta=beta, eps_low=eps_low, eps_high=eps_high, inplace=inplace,
                            loss_type=loss_type, max_completion_length=max_completion_length,
                            importance_sampling_level=importance_sampling_level,
                            sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                            delta=delta, use_bias_correction_kl=use_bias_correction_kl, vespo_k_pos=vespo_k_pos,
                            vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                            vespo_lambda_neg=vespo_lambda_neg)

    def forward(self, logits, old_logp, ref_logp, completion_ids, advantages, completion_mask=None,
                vllm_is_ratio=None, num_items_in_batch=None):
        return triton_grpo_loss(logits, old_logp, ref_logp, completion_ids, advantages, completion_mask,
                                reduce=True, vllm_is_ratio=vllm_is_ratio, num_items_in_batch=num_items_in_batch,
                                **self.options)


@dataclasses.dataclass
class CrossEntropyOutput:
    """What Liger's cross-entropy modules return when asked for more than the loss (the fields of
    ``liger_kernel.transformers.functional.CrossEntropyOutput``)."""
    loss: torch.Tensor
    z_loss: Optional[torch.Tensor] = None
    token_accuracy: Optional[torch.Tensor] = None
    predicted_tokens: Optional[torch.Tensor] = None


def _z_loss(per_token, target, options):
    """Liger's z-loss output: ``z * lse^2`` on the rows not ignored (``lse`` is 0 on the others),
    times ``p_y`` with token scaling, reduced as the loss; no gradient (Liger's backward takes none
    through it)."""
    per = options["z_loss"] * per_token["lse"].double() ** 2
    if options["token_scaling"]:
        per = per * per_token["logp"].double().exp()
    if options["reduction"] == "none":
        return per.float()
    total = per.sum()
    if options["reduction"] == "mean":
        total = total / (target != options["ignore_index"]).sum().clamp(min=1)
    return total.float()


def _token_accuracy(per_token, target, options):
    """Liger's ``token_accuracy``: 1 where the predicted token is the target, over the rows not
    ignored; per token (0 on ignored rows) with ``reduction="none"``, else their mean (as Liger
    divides the sum by the count for ``"sum"`` too; NaN over no rows, as Liger's 0 / 0)."""
    taking_part = target != options["ignore_index"]
    correct = ((per_token["predicted_tokens"] == target) & taking_part).to(torch.float32)
    if options["reduction"] == "none":
        return correct
    return correct.sum() / taking_part.sum()


def _cross_entropy_result(module, loss, per_token, target, options, dtype):
    """The loss alone, or Liger's ``CrossEntropyOutput`` with the extras the module asks for
    (``return_z_loss``, ``return_token_accuracy``, ``return_predicted_tokens``)."""
    z_loss, accuracy, predicted = module.return_z_loss, module.return_token_accuracy, module.return_predicted_tokens
    if not (z_loss or accuracy or predicted):
        return loss
    return CrossEntropyOutput(
        loss=loss,
        z_loss=_z_loss(per_token, target, options).to(dtype) if z_loss else None,
        token_accuracy=_token_accuracy(per_token, target, options) if accuracy else None,
        predicted_tokens=per_token["predicted_tokens"] if predicted else None)


def _class_weights(name, weight):
    """Per-class weights as the kernels read them (a float tensor, as Liger and PyTorch require;
    ``_Rows`` checks its shape ``[V]`` and makes it float32). No gradient flows to them (none does in
    PyTorch's or Liger's cross-entropy either)."""
    if weight is None:
        return None
    if not isinstance(weight, torch.Tensor) or not torch.is_floating_point(weight):
        raise TypeError(f"`{name}` must be a floating-point torch.Tensor of one weight per class, got "
                        f"{getattr(weight, 'dtype', type(weight).__name__)}")
    return weight


def _check_cross_entropy(*, weight_name, weight, label_smoothing, reduction, softcap):
    """Liger's cross-entropy modules' checks (as errors, not asserts)."""
    _class_weights(weight_name, weight)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"`reduction` must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"`label_smoothing` must be between 0.0 and 1.0, got {label_smoothing}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"`softcap` must be > 0 or None, got {softcap}")


def _cross_entropy_options(module):
    """LOSSES.md's options from a cross-entropy module's attributes, Liger's names, read at each
    call (as Liger's forward reads them: a caller may change them between calls)."""
    return dict(ignore_index=module.ignore_index, z_loss=module.lse_square_scale,
                label_smoothing=module.label_smoothing, reduction=module.reduction, softcap=module.softcap,
                token_scaling=bool(getattr(module, "use_token_scaling", False)),
                predicted_tokens=bool(module.return_token_accuracy or module.return_predicted_tokens))


class _LigerCrossEntropyModule(torch.nn.Module):
    """What Liger's two cross-entropy modules share: their checks, and the constructor arguments
    kept as attributes of the same names (``_cross_entropy_options`` reads them at each call)."""

    def __init__(self, *, weight_name, weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
                 return_z_loss, return_token_accuracy, return_predicted_tokens):
        super().__init__()
        _check_cross_entropy(weight_name=weight_name, weight=weight, label_smoothing=label_smoothing,
                             reduction=reduction, softcap=softcap)
        setattr(self, weight_name, weight)
        self.ignore_index = ignore_index
        self.lse_square_scale = lse_square_scale
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.softcap = softcap
        self.return_z_loss = return_z_loss
        self.return_token_accuracy = return_token_accuracy
        self.return_predicted_tokens = return_predicted_tokens
        self._weight_name = weight_name

    def _class_weights(self, vocab):
        """The per-class weights, read at each call (an attribute a caller may change), one per
        class of the ``vocab`` classes."""
        weight = _class_weights(self._weight_name, getattr(self, self._weight_name))
        if weight is not None and tuple(weight.shape) != (vocab,):
            raise ValueError(f"`{self._weight_name}` has shape {list(weight.shape)}, expected one weight per class, "
                             f"[{vocab}]")
        return weight


class CrossEntropyLoss(_LigerCrossEntropyModule):
    """Drop-in for ``liger_kernel.transformers.LigerCrossEntropyLoss``: the same constructor,
    attributes and ``forward(_input, target)`` on logits ``[BT, V]`` (or ``[B, T, V]``); the loss in
    the logits' dtype, as Liger's. ``lse_square_scale`` is LOSSES.md's ``z_loss``. With
    ``return_z_loss``, ``return_token_accuracy`` or ``return_predicted_tokens`` the forward returns
    Liger's ``CrossEntropyOutput``: ``z_loss`` as in ``FusedLinearCrossEntropyLoss``;
    ``token_accuracy`` (float32) 1 where the first argmax of the (soft-capped) logits is the target,
    over the rows not ignored, per token with ``reduction="none"``, else their mean;
    ``predicted_tokens`` (int64, the target's shape) that argmax, -1 on ignored rows. Per-class
    ``weight`` ``[V]`` as Liger's and ``F.cross_entropy``'s (LOSSES.md, "Class weights"), except that
    a ``mean`` over targets whose weights sum to 0 is 0 here, NaN there."""

    def __init__(self, weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0, reduction="mean",
                 softcap=None, return_z_loss=False, return_token_accuracy=False, return_predicted_tokens=False):
        super().__init__(weight_name="weight", weight=weight, ignore_index=ignore_index,
                         lse_square_scale=lse_square_scale, label_smoothing=label_smoothing, reduction=reduction,
                         softcap=softcap, return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy,
                         return_predicted_tokens=return_predicted_tokens)

    def forward(self, _input, target):
        o = _cross_entropy_options(self)
        per_row = "per_token_loss" if o["reduction"] == "none" else None
        loss, per_token = _logits_call("cross_entropy", _input, o, per_row=per_row, out_shape=target.shape,
                                       tokens=True, targets=target, class_weights=self._class_weights(_input.shape[-1]))
        return _cross_entropy_result(self, loss.to(_input.dtype), per_token, target, o, _input.dtype)


class FusedLinearCrossEntropyLoss(_LigerCrossEntropyModule):
    """Drop-in for ``liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss``: the same
    constructor, attributes and ``forward(lin_weight, _input, target, bias=None)``; the loss in
    float32, as Liger's; ``accum_dtype`` is accepted and ignored (the kernels accumulate in f32).
    ``lse_square_scale`` is LOSSES.md's ``z_loss``, ``softcap`` LOSSES.md's ``softcap``. With
    ``return_z_loss=True`` the forward returns Liger's ``CrossEntropyOutput(loss, z_loss)``:
    ``z_loss`` is ``lse_square_scale * lse^2`` over the rows not ignored, reduced as the loss (mean
    over those rows, sum, or per token), without a gradient, in the input's dtype.
    ``use_token_scaling`` is LOSSES.md's ``token_scaling`` (each row's loss, gradient and z-loss
    times its detached ``p_y``). ``return_token_accuracy`` and ``return_predicted_tokens`` as in
    ``CrossEntropyLoss``, of the logits ``_input @ lin_weight^T (+ bias)`` computed in f32 (Liger
    computes them in the input's dtype: with bf16 inputs, two near-equal logits it rounds to one
    value go to the lower column there, to the larger f32 one here). Per-class ``ce_weight`` as
    ``CrossEntropyLoss``'s ``weight``."""

    def __init__(self, ce_weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
                 reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None, use_token_scaling=False,
                 return_token_accuracy=False, return_predicted_tokens=False, chunk_memory_mb=None):
        super().__init__(weight_name="ce_weight", weight=ce_weight, ignore_index=ignore_index,
                         lse_square_scale=lse_square_scale, label_smoothing=label_smoothing, reduction=reduction,
                         softcap=softcap, return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy,
                         return_predicted_tokens=return_predicted_tokens)
        self.accum_dtype = accum_dtype
        self.use_token_scaling = use_token_scaling
        self.chunk_memory_mb = chunk_memory_mb

    def forward(self, lin_weight, _input, target, bias=None):
        o = _cross_entropy_options(self)
        per_row = "per_token_loss" if o["reduction"] == "none" else None
        loss, per_token = _linear_call("cross_entropy", _input, lin_weight, bias, o, per_row=per_row,
                                       out_shape=target.shape, chunk_memory_mb=self.chunk_memory_mb, tokens=True,
                                       targets=target, class_weights=self._class_weights(lin_weight.shape[0]))
        return _cross_entropy_result(self, loss, per_token, target, o, _input.dtype)


def liger_cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                        reduction="mean", label_smoothing=0.0, lse_square_scale=0.0, softcap=None,
                        return_z_loss=False, return_token_accuracy=False, return_predicted_tokens=False):
    """Drop-in for ``liger_kernel.transformers.functional.liger_cross_entropy``: ``CrossEntropyLoss``
    called once. ``size_average`` and ``reduce`` are placeholders there (ignored), and here."""
    del size_average, reduce
    return CrossEntropyLoss(weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
                            return_z_loss, return_token_accuracy, return_predicted_tokens)(input, target)


def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None, ignore_index=-100,
                                     lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None,
                                     return_z_loss=False, accum_dtype=None, use_token_scaling=False,
                                     return_token_accuracy=False, return_predicted_tokens=False, chunk_mem_const=1):
    """Drop-in for ``liger_kernel.transformers.functional.liger_fused_linear_cross_entropy``:
    ``FusedLinearCrossEntropyLoss`` called once. ``chunk_mem_const`` (Liger's chunk sizing) is
    accepted and ignored: the chunks here are sized by ``chunk_memory_mb``."""
    del chunk_mem_const
    module = FusedLinearCrossEntropyLoss(ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
                                         return_z_loss, accum_dtype, use_token_scaling, return_token_accuracy,
                                         return_predicted_tokens)
    return module(weight, input, target, bias)


# ---------------------------------------------------------------- verl and Liger: log-probabilities and entropy


class FusedLinearForPPO(torch.nn.Module):
    """Drop-in for verl's ``verl.utils.experimental.torch_functional.FusedLinearForPPO``:
    ``forward(hidden_states, vocab_weights, input_ids, temperature=1.0)`` returns each token's
    log-probability (float32) and entropy (in ``hidden_states``' dtype) under
    ``softmax(hidden_states @ vocab_weights^T / temperature)``, both differentiable, the shape of
    ``input_ids`` (``[T]`` from ``[T, D]``, ``[B, T]`` from ``[B, T, D]``). ``temperature``: a
    number (or a one-element tensor), or one per token (``[T]``, or the shape of ``input_ids``),
    which, as verl does, divides ``hidden_states`` (in float32, rounded back to their dtype so that
    a bf16 ``vocab_weights`` is not copied to float32) before the kernel. ``chunk_size``
    (verl's tokens per chunk) is accepted and ignored: the chunks here are sized by memory."""

    def __init__(self, chunk_size=512):
        super().__init__()
        self.chunk_size = chunk_size

    def forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
        hidden, scalar = _per_token_temperature(hidden_states, input_ids, temperature)
        stats = fused_linear_token_stats(hidden, vocab_weights, input_ids.to(torch.int64), temperature=scalar)
        return stats.logp, stats.entropy.to(hidden_states.dtype)


def _per_token_temperature(hidden, input_ids, temperature):
    """``(hidden, scalar temperature)``: a per-token temperature divides ``hidden`` (in float32,
    differentiably, back in ``hidden``'s dtype) and leaves 1 for the kernel, as verl's
    ``FusedLinearForPPO`` does."""
    if not isinstance(temperature, torch.Tensor) or temperature.numel() == 1:
        return hidden, float(temperature)
    if temperature.numel() != input_ids.numel():
        raise ValueError(f"`temperature` has {temperature.numel()} values; expected one, or one per token "
                         f"({input_ids.numel()}, the shape of `input_ids` {list(input_ids.shape)})")
    per_token = temperature.to(torch.float32).reshape(*input_ids.shape, 1)
    return (hidden.to(torch.float32) / per_token).to(hidden.dtype), 1.0


def _check_scaled_ce_arguments(hidden, weight, target, temperature, m_tiles_per_cluster, return_entropy,
                               selected_token_ids):
    """Liger's checks of ``LigerFusedLinearScaledCrossEntropyFunction.apply``, in its order and with
    its exception types (``TypeError`` for a wrong type, ``ValueError`` for a wrong value); a
    target outside the vocabulary is the kernels' ``ValueError``, which names its row."""
    if not isinstance(m_tiles_per_cluster, int) or isinstance(m_tiles_per_cluster, bool):
        raise TypeError(f"`m_tiles_per_cluster` must be an int, got {type(m_tiles_per_cluster).__name__}")
    if m_tiles_per_cluster < 1:
        raise ValueError(f"`m_tiles_per_cluster` must be >= 1, got {m_tiles_per_cluster}")
    if not isinstance(return_entropy, bool):
        raise TypeError(f"`return_entropy` must be a bool, got {type(return_entropy).__name__}")
    tensors = (hidden, weight, target)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or (hidden.dim(), weight.dim(), target.dim()) != (2, 2, 1):
        raise ValueError("expected `_input` [M, H], `weight` [V, H] and `target` [M] tensors")
    if hidden.shape[0] != target.shape[0] or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"`_input` {list(hidden.shape)}, `weight` {list(weight.shape)} and `target` "
                         f"{list(target.shape)} have incompatible shapes")
    if 0 in (hidden.shape[0], hidden.shape[1], weight.shape[0]):
        raise ValueError(f"`_input` {list(hidden.shape)} and `weight` {list(weight.shape)}: the token, hidden and "
                         f"vocabulary sizes must be non-empty")
    if hidden.dtype != weight.dtype or not hidden.is_floating_point():
        raise TypeError(f"`_input` ({hidden.dtype}) and `weight` ({weight.dtype}) must have the same floating-point "
                        f"dtype")
    if target.dtype != torch.int64:
        raise TypeError(f"`target` must be an int64 tensor, got {target.dtype}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"`temperature` must be a real number, got {type(temperature).__name__}")
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"`temperature` must be finite and > 0, got {temperature}")
    if selected_token_ids is None:
        return
    ids = selected_token_ids
    if not isinstance(ids, torch.Tensor):
        raise TypeError("`selected_token_ids` must be an int64 tensor")
    if ids.dim() != 1:
        raise ValueError(f"`selected_token_ids` must have shape [K], got {list(ids.shape)}")
    if ids.dtype != torch.int64:
        raise TypeError(f"`selected_token_ids` must be an int64 tensor, got {ids.dtype}")
    outside = (ids < 0) | (ids >= weight.shape[0])
    if bool(outside.any()):
        k = int(outside.nonzero()[0, 0])
        raise ValueError(f"`selected_token_ids[{k}]` = {int(ids[k])} is outside the vocabulary [0, {weight.shape[0]})")


def liger_fused_linear_scaled_cross_entropy(_input, weight, target, temperature=1.0, ignore_index=-100,
                                            m_tiles_per_cluster=1, return_entropy=False, selected_token_ids=None):
    """Drop-in for Liger-Kernel's ``LigerFusedLinearScaledCrossEntropyFunction.apply``
    (``liger_kernel.ops``): each token's NLL ``-log p(target)`` (float32 ``[M]``) under
    ``softmax(_input @ weight^T / temperature)``, with ``return_entropy`` its entropy (in
    ``_input``'s dtype), with ``selected_token_ids [K]`` the log-probabilities of those tokens
    (float32 ``[M, K]``, in their order, duplicates kept); rows whose target is ``ignore_index``
    output 0 and get no gradient. Every output is differentiable: the NLL's and the entropy's
    gradients (and the selected tokens' normaliser's) are written in one backward stream of the
    vocabulary; the selected tokens' own logits, ``K`` columns, are a small product PyTorch
    differentiates. ``m_tiles_per_cluster`` (a GPU tiling) is checked and ignored. float64 inputs,
    which Liger's CPU fallback takes, are refused (``TypeError``): the kernels take f32, bf16, f16."""
    _check_scaled_ce_arguments(_input, weight, target, temperature, m_tiles_per_cluster, return_entropy,
                               selected_token_ids)
    valid = target != ignore_index
    stats = fused_linear_token_stats(_input, weight, target.masked_fill(~valid, 0), mask=valid,
                                     temperature=float(temperature))
    outputs = (torch.where(valid, -stats.logp, 0.0),)  # +0.0 on ignored rows, as Liger's
    if return_entropy:
        outputs += (stats.entropy.to(_input.dtype),)
    if selected_token_ids is not None:
        # The K columns in f32 from the inputs' values, as the kernels' `lse` is accumulated (a bf16
        # `_input`'s f32 copy, [M, H], is kept by autograd until the backward).
        f32 = torch.float32
        selected_logits = _input.to(f32) @ weight.index_select(0, selected_token_ids).to(f32).t() / temperature
        outputs += (torch.where(valid[:, None], selected_logits - stats.lse[:, None], 0.0),)
    return outputs[0] if len(outputs) == 1 else outputs

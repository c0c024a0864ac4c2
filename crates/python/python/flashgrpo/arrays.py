"""flashgrpo's losses on NumPy arrays and JAX CPU arrays, read in place (no copy of C-contiguous
logits, hidden states or lm_head; another layout is copied first); results as NumPy arrays.

``loss(op, logits, ...)`` and ``linear_loss(op, hidden, weight, ...)`` take the op's inputs as
``flashgrpo.torch`` does, and return a dict: ``loss`` (a float), the per-token outputs that the op
computes (``per_token_loss``, ``logp``, ``entropy``, ``kl``, ``is_clipped``; float32, ``[B, T]``)
and, with ``grad=True``, the gradient: ``grad`` (the logits' dtype) or ``grad_hidden``,
``grad_weight``, ``grad_bias`` (float32). A NumPy gradient buffer of the caller's may be passed
as ``out=`` (or ``in_place=True``: the gradient is written over a NumPy logits array).
bfloat16 NumPy arrays are ``ml_dtypes.bfloat16`` (what JAX uses).
"""

import numpy as np

from . import _native
from ._calls import PER_TOKEN, options_json, rows

_FLOAT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
_EMPTY = 64

__all__ = ["loss", "linear_loss"]


def _is_jax(x):
    return hasattr(x, "unsafe_buffer_pointer") and hasattr(x, "devices")


class _Float:
    """A float array read in place: its address, dtype name and shape (kept alive by ``self``)."""

    def __init__(self, name, x, writable=False):
        if _is_jax(x):
            platforms = {d.platform for d in x.devices()}
            if platforms != {"cpu"}:
                raise ValueError(f"`{name}` lives on {sorted(platforms)}; flashgrpo's Python kernels take CPU arrays")
            if writable:
                raise ValueError(f"`{name}` is a JAX array, which cannot be written in place; pass a NumPy array")
            x.block_until_ready()
            self.address = x.unsafe_buffer_pointer() if x.size else _EMPTY
        else:
            if not isinstance(x, np.ndarray):
                raise TypeError(f"`{name}` must be a NumPy or JAX array, got {type(x).__name__}")
            if not x.flags.c_contiguous:
                if writable:
                    raise ValueError(f"`{name}` must be C-contiguous to be written in place")
                x = np.ascontiguousarray(x)
            if writable and not x.flags.writeable:
                raise ValueError(f"`{name}` is read-only")
            self.address = x.ctypes.data if x.size else _EMPTY
        if str(x.dtype) not in _FLOAT:
            raise TypeError(f"`{name}` has dtype {x.dtype}; expected float32, bfloat16 or float16")
        self.array, self.dtype, self.shape = x, _FLOAT[str(x.dtype)], tuple(x.shape)


def _small(name, x, dtype, shapes):
    if x is None:
        return None
    x = np.asarray(x)
    if dtype == np.int64 and not np.issubdtype(x.dtype, np.integer):
        raise TypeError(f"`{name}` has dtype {x.dtype}; expected an integer dtype (token ids)")
    x = np.ascontiguousarray(x, dtype=dtype)
    if tuple(x.shape) not in shapes:
        raise ValueError(f"`{name}` has shape {list(x.shape)}, expected {' or '.join(str(list(s)) for s in shapes)}")
    return x


def _rows(batch, seq_len, vocab, targets=None, mask=None, advantages=None, old_logp=None, ref_logp=None,
          is_ratio=None, sampling_logp=None, class_weights=None):
    bt = [(batch, seq_len)] + ([(seq_len,)] if batch == 1 else [])
    kept = dict(
        targets=_small("targets", targets, np.int64, bt),
        mask=_small("mask", mask, np.float32, bt),
        advantages=_small("advantages", advantages, np.float32, [(batch,), (batch, 1)]),
        old_logp=_small("old_logp", old_logp, np.float32, bt),
        ref_logp=_small("ref_logp", ref_logp, np.float32, bt),
        is_ratio=_small("is_ratio", is_ratio, np.float32, bt + [(batch,), (batch, 1)]),
        sampling_logp=_small("sampling_logp", sampling_logp, np.float32, bt),
        class_weights=_small("class_weights", class_weights, np.float32, [(vocab,)]),
    )
    per_sequence = kept["is_ratio"] is not None and kept["is_ratio"].size == batch and seq_len != 1
    addresses = {k: (0 if v is None else (v.ctypes.data if v.size else _EMPTY)) for k, v in kept.items()}
    return kept, rows(batch, seq_len, vocab, is_ratio_per_sequence=per_sequence, **addresses)


def _outputs(result, n, shape):
    out = {"loss": result.loss}
    for name in PER_TOKEN:
        if result.has(name):
            values = np.empty(n, dtype=np.float32)
            result.copy_into(name, values.ctypes.data if n else _EMPTY, n)
            out[name] = values.reshape(shape)
    if result.has("predicted_tokens"):  # `predicted_tokens=True`: int64, -1 where a row takes no part
        tokens = np.empty(n, dtype=np.int64)
        result.copy_tokens_into(tokens.ctypes.data if n else _EMPTY, n)
        out["predicted_tokens"] = tokens.reshape(shape)
    return out


def _shape(name, shape, last):
    if len(shape) not in (2, 3):
        raise ValueError(f"`{name}` must be [B, T, {last}] or [N, {last}], got shape {list(shape)}")
    return (1, shape[0]) if len(shape) == 2 else shape[:2]


def loss(op, logits, targets=None, advantages=None, mask=None, *, old_logp=None, ref_logp=None, is_ratio=None,
         sampling_logp=None, class_weights=None, grad=False, out=None, in_place=False, **options):
    """``op`` (grpo, cross_entropy, entropy, logprob) over logits ``[B, T, V]`` or ``[N, V]``;
    ``class_weights [V]``: cross-entropy's per-class weights (LOSSES.md, "Class weights")."""
    x = _Float("logits", logits, writable=in_place)
    batch, seq_len = _shape("logits", x.shape, "V")
    kept, native_rows = _rows(batch, seq_len, x.shape[-1], targets, mask, advantages, old_logp, ref_logp, is_ratio,
                              sampling_logp, class_weights)
    if out is not None and in_place:
        raise ValueError("`out` and `in_place=True` both name where the gradient goes; pass one")
    if out is not None:
        grad = True
        if not isinstance(out, np.ndarray) or out.shape != x.shape or str(out.dtype) != str(x.array.dtype) \
                or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"`out` must be a writable C-contiguous NumPy array of shape {list(x.shape)} and dtype "
                             f"{x.array.dtype}")
    elif grad and not in_place:
        out = np.empty(x.shape, dtype=x.array.dtype)
    result = _native.loss(op, x.dtype, x.address, native_rows, options_json(options),
                          grad=0 if out is None or in_place or not out.size else out.ctypes.data,
                          in_place=in_place)
    del kept
    outputs = _outputs(result, batch * seq_len, x.shape[:-1])
    if in_place:
        outputs["grad"] = x.array
    elif grad:
        outputs["grad"] = out
    return outputs


def linear_loss(op, hidden, weight, targets=None, advantages=None, mask=None, *, bias=None, old_logp=None,
                ref_logp=None, is_ratio=None, sampling_logp=None, class_weights=None, grad=False, chunk_memory_mb=None,
                **options):
    """``op`` over ``hidden [B, T, H] (or [N, H]) @ weight[V, H]^T (+ bias [V])``, streamed over the
    vocabulary; with ``grad=True`` the float32 gradients of hidden, weight and bias."""
    h, w = _Float("hidden", hidden), _Float("weight", weight)
    b = None if bias is None else _Float("bias", bias)
    if len(w.shape) != 2 or w.shape[1] != h.shape[-1] or w.dtype != h.dtype or (b is not None and b.dtype != h.dtype):
        raise ValueError(f"`hidden` {list(h.shape)} {h.dtype} and `weight` {list(w.shape)} {w.dtype}: expected "
                         f"[.., H] and [V, H] of one dtype")
    batch, seq_len = _shape("hidden", h.shape, "H")
    vocab = w.shape[0]
    kept, native_rows = _rows(batch, seq_len, vocab, targets, mask, advantages, old_logp, ref_logp, is_ratio,
                              sampling_logp, class_weights)
    grads = {}
    if grad:
        grads = dict(grad_hidden=np.empty(h.shape, np.float32), grad_weight=np.empty(w.shape, np.float32))
        if b is not None:
            grads["grad_bias"] = np.empty(vocab, np.float32)
    address = {k: (v.ctypes.data if v.size else _EMPTY) for k, v in grads.items()}
    result = _native.linear_loss(
        op, h.dtype, h.address, w.address, 0 if b is None else b.address, w.shape[1], native_rows,
        options_json(options), dict(hidden=address.get("grad_hidden", 0), weight=address.get("grad_weight", 0),
                                    bias=address.get("grad_bias", 0), accumulate=False),
        chunk_memory_mb or _native.DEFAULT_CHUNK_MEMORY_MB)
    del kept
    return {**_outputs(result, batch * seq_len, h.shape[:-1]), **grads}

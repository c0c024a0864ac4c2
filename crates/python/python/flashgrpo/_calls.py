"""What every front end shares: the options as JSON (with a helpful error for an unknown name),
and the dict of row inputs the native module reads (addresses of caller-owned buffers)."""

import difflib
import json

from ._native import OPTION_NAMES

#: Per-token outputs the kernels can return, each ``[B, T]`` float32.
PER_TOKEN = ("per_token_loss", "logp", "entropy", "kl", "is_clipped")


def _plain(name, value):
    """An option's value as JSON takes it: a NumPy, JAX or PyTorch scalar as the Python number it
    holds. Options are static (a JAX custom call's attributes, one compilation per value): a value
    traced under ``jax.jit`` cannot be one."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    item = getattr(value, "item", None)
    count = value.numel() if hasattr(value, "numel") else getattr(value, "size", 1)  # PyTorch / NumPy, JAX
    if item is None or count != 1:
        raise TypeError(f"loss option `{name}` must be a number or a string, got {type(value).__name__}")
    try:
        return item()
    except Exception as e:  # a JAX tracer: jax.errors.ConcretizationTypeError
        hint = " (or leave it out: the mask's own sum)" if name == "num_items" else ""
        raise TypeError(f"loss option `{name}` is a traced value; options are static: pass a Python number, "
                        f"computed outside `jax.jit`{hint}") from e


def options_json(options):
    """LOSSES.md's options (None values left out: the kernels' defaults apply) as JSON."""
    for name in options:
        if name not in OPTION_NAMES:
            close = difflib.get_close_matches(name, OPTION_NAMES, n=1)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            raise TypeError(f"unknown loss option `{name}`{hint} (options: {', '.join(OPTION_NAMES)})")
    return json.dumps({k: _plain(k, v) for k, v in options.items() if v is not None})


def rows(batch, seq_len, vocab, **addresses):
    """The row inputs of one call: shapes, and the address (0: absent) of every per-row buffer."""
    out = dict(batch=batch, seq_len=seq_len, vocab=vocab, targets=0, mask=0, advantages=0, old_logp=0,
               ref_logp=0, is_ratio=0, is_ratio_per_sequence=False, sampling_logp=0, class_weights=0)
    for k, v in addresses.items():
        if k not in out:
            raise AssertionError(f"not a row input: {k}")
        out[k] = v
    return out

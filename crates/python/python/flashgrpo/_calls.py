"""What every front end shares: the options as JSON (with a helpful error for an unknown name),
and the dict of row inputs the native module reads (addresses of caller-owned buffers)."""

import difflib
import json

from ._native import OPTION_NAMES

#: Per-token outputs the kernels can return, each ``[B, T]`` float32.
PER_TOKEN = ("per_token_loss", "logp", "entropy", "kl", "is_clipped")


def options_json(options):
    """LOSSES.md's options (None values left out: the kernels' defaults apply) as JSON."""
    for name in options:
        if name not in OPTION_NAMES:
            close = difflib.get_close_matches(name, OPTION_NAMES, n=1)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            raise TypeError(f"unknown loss option `{name}`{hint} (options: {', '.join(OPTION_NAMES)})")
    return json.dumps({k: v for k, v in options.items() if v is not None})


def rows(batch, seq_len, vocab, **addresses):
    """The row inputs of one call: shapes, and the address (0: absent) of every per-row buffer."""
    out = dict(batch=batch, seq_len=seq_len, vocab=vocab, targets=0, mask=0, advantages=0, old_logp=0,
               ref_logp=0, is_ratio=0, is_ratio_per_sequence=False, sampling_logp=0)
    for k, v in addresses.items():
        if k not in out:
            raise AssertionError(f"not a row input: {k}")
        out[k] = v
    return out

"""flashgrpo: fused, streaming GRPO / cross-entropy / entropy / log-probability losses over a large
vocabulary, forward and backward, on CPU, without an ``[N, V]`` temporary.

Front ends (each imported on demand, so that the package needs neither framework):

- ``flashgrpo.torch``: ``torch.autograd`` functions (``grpo_loss``, ``cross_entropy``, ``entropy``,
  ``logprob`` and their ``fused_linear_*`` forms) and drop-in modules for Liger-Kernel's
  (``FusedLinearGRPOLoss``, ``GRPOLoss``, ``CrossEntropyLoss``, ``FusedLinearCrossEntropyLoss``);
- ``flashgrpo.arrays``: the same losses on NumPy or JAX arrays (read in place), returning NumPy.

All math is in the Rust kernels (``flashgrpo._native``); the options are those of the project's
docs/LOSSES.md, passed as keyword arguments.
"""

from ._native import DEFAULT_CHUNK_MEMORY_MB, OPTION_NAMES

__all__ = ["DEFAULT_CHUNK_MEMORY_MB", "OPTION_NAMES", "OPS"]

#: The ops of docs/LOSSES.md.
OPS = ("grpo", "cross_entropy", "entropy", "logprob")

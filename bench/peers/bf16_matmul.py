"""The best bf16 matrix-product rate a library reaches on this machine, for the fused-linear
loss's logits product: PyTorch's `[rows, H] @ [H, V]` in bf16 (oneDNN: AMX where the CPU has it,
AVX512-BF16 elsewhere) and, for reference, in f32. Best of `--repeats` timings; prints JSON.

Usage: bf16_matmul.py [--rows 256] [--hidden 896] [--vocab 151936] [--repeats 5]
"""

import argparse
import json
import time

import torch


def rate(rows: int, hidden: int, vocab: int, dtype: torch.dtype, repeats: int) -> float:
    """GFLOP/s of `hidden_states @ weight.T` (the logits), the best of `repeats` runs."""
    generator = torch.Generator().manual_seed(0)
    hidden_states = torch.randn(rows, hidden, generator=generator).to(dtype)
    weight = (torch.randn(vocab, hidden, generator=generator) * 0.05).to(dtype)
    torch.matmul(hidden_states, weight.T)  # warm-up: oneDNN picks and JITs its kernel
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(hidden_states, weight.T)
        best = min(best, time.perf_counter() - start)
    return 2.0 * rows * hidden * vocab / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    shape = (args.rows, args.hidden, args.vocab)
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "shape": {"rows": args.rows, "hidden": args.hidden, "vocab": args.vocab},
                "bf16_gflops": rate(*shape, torch.bfloat16, args.repeats),
                "f32_gflops": rate(*shape, torch.float32, args.repeats),
            }
        )
    )


if __name__ == "__main__":
    main()

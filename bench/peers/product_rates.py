"""PyTorch's f32 rates for the three products of a training update at Qwen2.5-0.5B's shapes, the
peer of `cargo run --release -p flashgrpo-kernels --example update_product_rates`: the forward
`y = x @ w.T`, the input gradient `dx = dy @ w` and the weight gradient `dw = dy.T @ x`, each the
median of `--repeats` timings after a warm-up, in GFLOP/s.

Usage: product_rates.py [--repeats 5] [--rows 1024] [--shape ROWS OUT IN]
"""

import argparse
import statistics
import time

import torch


def rate(product, flops: float, repeats: int) -> float:
    product()  # warm-up: the BLAS picks its kernel and touches the output
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        product()
        times.append(time.perf_counter() - start)
    return flops / statistics.median(times) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--shape", type=int, nargs=3, metavar=("ROWS", "OUT", "IN"))
    args = p.parse_args()
    if args.shape:
        shapes = [tuple(args.shape)]
    else:
        shapes = [(args.rows, n, k) for n, k in [(128, 896), (896, 896), (4864, 896), (896, 4864)]]
        shapes.append((256, 151936, 896))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'rows':>5} {'out':>7} {'in':>5} {'fwd':>10} {'dx (nn)':>10} {'dw (tn)':>10}   GFLOP/s")
    generator = torch.Generator().manual_seed(0)
    for m, n, k in shapes:
        x = torch.randn(m, k, generator=generator)
        w = torch.randn(n, k, generator=generator) * 0.05
        dy = torch.randn(m, n, generator=generator) * 0.01
        y, dx, dw = torch.empty(m, n), torch.empty(m, k), torch.empty(n, k)
        flops = 2.0 * m * n * k
        rates = [
            rate(lambda: torch.matmul(x, w.T, out=y), flops, args.repeats),
            rate(lambda: torch.matmul(dy, w, out=dx), flops, args.repeats),
            rate(lambda: torch.matmul(dy.T, x, out=dw), flops, args.repeats),
        ]
        print(f"{m:>5} {n:>7} {k:>5} " + " ".join(f"{r:>10.1f}" for r in rates))


if __name__ == "__main__":
    main()

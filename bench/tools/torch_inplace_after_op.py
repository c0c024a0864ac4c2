"""`flashgrpo.torch.grpo_loss(in_place=True)` + `backward()` timed in one process in three
situations, interleaved: right after a PyTorch operation (`x.copy_(pristine)`, as
`bench/peers/peer_loss.py` restores the logits), after the same copy and 0.3 s of sleep, and with
no copy at all. GRPO dapo, beta 0.04, eps 0.2 / 0.28, N=1024 rows, V=151936, f32 logits. Prints
the median of each over ROUNDS rounds (the first dropped).

What it isolates (docs/BENCHMARKS.md, "Again on cpu-2c (2026-11-27)"): PyTorch's OpenMP workers
keep spinning for a few milliseconds after a parallel operation, on the cores the kernels then
use, so `after_copy` exceeds `after_sleep`. Run it with `OMP_WAIT_POLICY=passive` or
`GOMP_SPINCOUNT=10000` to see the difference go, and with `THP_MEM_ALLOC_ENABLE=1` to put
PyTorch's large tensors (the logits) on huge pages. From the repository root:

    .venv-peers/bin/python bench/tools/torch_inplace_after_op.py [ROUNDS]
"""

import statistics
import sys
import time

import torch

import flashgrpo.torch as ft

N, V = 1024, 151936


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    torch.manual_seed(0)
    pristine = torch.randn(N, V) * 2
    ids = torch.randint(0, V, (N,))
    mask = (torch.rand(N) > 0.1).float()
    old, ref = torch.randn(N) * 0.3 - 12, torch.randn(N) * 0.3 - 12
    adv = torch.randn(N, 1)
    x = pristine.clone().requires_grad_(True)

    def step():
        out = ft.grpo_loss(x.view(N, 1, V), ids.view(N, 1), adv, mask.view(N, 1), old_logp=old.view(N, 1),
                           ref_logp=ref.view(N, 1), in_place=True, beta=0.04, epsilon_low=0.2,
                           epsilon_high=0.28, loss_type="dapo")
        out.loss.backward()

    times = {"after_copy": [], "after_sleep": [], "no_copy": []}
    for _ in range(rounds):
        for situation, kept in times.items():
            if situation != "no_copy":
                with torch.no_grad():
                    x.copy_(pristine)
            if situation == "after_sleep":
                time.sleep(0.3)
            x.grad = None
            start = time.perf_counter()
            step()
            kept.append(time.perf_counter() - start)
    for situation, kept in times.items():
        print(f"{situation} {statistics.median(kept[1:]):.4f}")


if __name__ == "__main__":
    main()

"""`flashgrpo.torch.FusedLinearGRPOLoss` in bf16 with its default bf16 products (``rounded``,
its gradients coming back in bf16) against ``bf16_products="auto"`` (f32-grade products) and
Liger-Kernel's ``LigerFusedLinearGRPOLoss``, in one process, the arms alternated over the rounds:
forward + backward at N=1024 (B=4, T=256, 10% of the rows masked), H=896, V=151936, dapo,
beta 0. Prints each arm's times and median. Usage, from the repository root:

    .venv-peers/bin/python bench/tools/torch_bf16_default.py [ROUNDS]
"""

import statistics
import sys
import time

import torch

import flashgrpo.torch as ft
from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

B, T, H, V = 4, 256, 896, 151936


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    torch.manual_seed(0)
    torch.set_num_threads(2)
    hidden = torch.randn(B, T, H).bfloat16()
    weight = (torch.randn(V, H) / H**0.5).bfloat16()
    ids = torch.randint(0, V, (B, T))
    mask = (torch.rand(B, T) > 0.1).float()
    adv = torch.randn(B)
    old = -torch.rand(B, T) * 5
    options = dict(beta=0.0, epsilon_high=0.28, loss_type="dapo", use_ref_model=False)
    arms = {
        "flashgrpo.torch default": ft.FusedLinearGRPOLoss(**options),
        'flashgrpo.torch bf16_products="auto"': ft.FusedLinearGRPOLoss(**options, bf16_products="auto"),
        "Liger": LigerFusedLinearGRPOLoss(**options, compiled=False),
    }

    def step(module):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        start = time.perf_counter()
        loss, _ = module(h, w, ids, mask, adv, old_per_token_logps=old)
        loss.backward()
        return time.perf_counter() - start

    for module in arms.values():
        step(module)  # warm-up
    times = {name: [] for name in arms}
    for _ in range(rounds):
        for name, module in arms.items():
            times[name].append(step(module))
    for name, t in times.items():
        print(f"{name}: {' '.join(f'{x:.3f}' for x in t)} s, median {statistics.median(t):.3f} s")


if __name__ == "__main__":
    main()

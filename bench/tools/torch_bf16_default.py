"""`flashgrpo.torch.FusedLinearGRPOLoss` in bf16 with its default bf16 products (``rounded``,
its gradients coming back in bf16) against ``bf16_products="auto"`` (f32-grade products) and
Liger-Kernel's ``LigerFusedLinearGRPOLoss``, and the default with its gradients cast back to bf16
by ``Tensor.to`` instead of into pooled buffers (``flashgrpo.torch._as_dtype``, as before
9a19b0f), in one process, the arms alternated over the rounds:
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
        "flashgrpo.torch default, cast by Tensor.to": ft.FusedLinearGRPOLoss(**options),
    }
    pooled_cast = ft._as_dtype

    def tensor_to(grad, dtype):
        return grad if grad.dtype == dtype else grad.to(dtype)

    def step(name, module):
        ft._as_dtype = tensor_to if name.endswith("Tensor.to") else pooled_cast
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        start = time.perf_counter()
        loss, _ = module(h, w, ids, mask, adv, old_per_token_logps=old)
        loss.backward()
        elapsed = time.perf_counter() - start
        ft._as_dtype = pooled_cast
        return elapsed

    for name, module in arms.items():
        step(name, module)  # warm-up
    times = {name: [] for name in arms}
    for _ in range(rounds):
        for name, module in arms.items():
            times[name].append(step(name, module))
    for name, t in times.items():
        print(f"{name}: {' '.join(f'{x:.3f}' for x in t)} s, median {statistics.median(t):.3f} s")


if __name__ == "__main__":
    main()

"""How far each bf16 way's fused-linear gradients are from float64, as `flashgrpo loss` hands
them back (rounded to bf16, as PyTorch's bf16 autograd and the Python bindings return them).

For each shape: the relative norm error of the exact (float64 autograd) `grad_hidden` and
`grad_weight` rounded to bf16 and nothing else, then that of each way (`auto`: f32-grade
products; `rounded`: the logits' gradient rounded to bf16 first, as PyTorch and Liger take it;
`widened`: the f32 products), the front ends' default (no `bf16_products`), and the peers' on
the same bf16 inputs: Liger-Kernel's `LigerFusedLinearGRPOLoss` and PyTorch eager (bf16 logits
`hidden @ weight.T`, TRL's loss in f32 on them, as bench/peers/peer_loss.py's). Usage, from the
repository root, with the peers' venv:

    .venv-peers/bin/python bench/tools/bf16_ways_error.py [--bin target/release/flashgrpo]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "peers"))
from crosscheck import grpo_options, materialised, trl_grpo  # noqa: E402
from loss_cli import run_loss  # noqa: E402


def rel(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


def liger_grads(hidden, weight, targets, mask, adv, old, o):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    mod = LigerFusedLinearGRPOLoss(beta=o["beta"], compiled=False, use_ref_model=False, epsilon_low=o["epsilon_low"],
                                   epsilon_high=o["epsilon_high"], loss_type=o["loss_type"])
    out = mod(h, w, targets, mask, adv, old_per_token_logps=old)
    (out[0] if isinstance(out, tuple) else out).backward()
    return h.grad, w.grad


def eager_grads(hidden, weight, targets, mask, adv, old, o):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp = torch.gather((h @ w.T).float().log_softmax(-1), -1, targets[..., None]).squeeze(-1)
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    per = -torch.min(ratio * a, torch.clamp(ratio, 1 - o["epsilon_low"], 1 + o["epsilon_high"]) * a)
    ((per * mask).sum() / mask.sum()).backward()
    return h.grad, w.grad


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", default="target/release/flashgrpo")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    print("| B T H V, hidden std | bf16 rounding alone: dh / dw | auto | rounded | widened | default | Liger | PyTorch eager |")
    print("|---|---|---|---|---|---|---|---|")
    for B, T, H, V, std in [(2, 32, 896, 32768, 1.0), (4, 16, 256, 151936, 1.0), (2, 32, 896, 32768, 3.0)]:
        hidden = (torch.randn(B, T, H) * std).bfloat16()
        weight = (torch.randn(V, H) / H**0.5).bfloat16()
        targets = torch.randint(0, V, (B, T))
        mask = torch.ones(B, T)
        adv = torch.randn(B)
        o = grpo_options(beta=0.0)
        h, w, _, logits = materialised(hidden, weight, None)
        with torch.no_grad():
            true_logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
        old = (true_logp + 0.2 * torch.randn(B, T)).float()
        want = trl_grpo(logits.detach(), targets, mask, adv, old, None, None, o)
        logits.backward(want["grad"])
        cells = [f"{rel(h.grad.bfloat16(), h.grad):.2e} / {rel(w.grad.bfloat16(), w.grad):.2e}"]
        for way in ["auto", "rounded", "widened", None]:
            sets = {k: v for k, v in o.items() if v is not None} | ({"bf16_products": way} if way else {})
            inputs = {"hidden": hidden, "weight": weight, "targets": targets, "mask": mask, "advantages": adv, "old_logp": old}
            out = run_loss(args.bin, "grpo", inputs, sets)
            cells.append(f"{rel(out['grad_hidden'], h.grad):.2e} / {rel(out['grad_weight'], w.grad):.2e}")
        for peer in (liger_grads, eager_grads):
            gh, gw = peer(hidden, weight, targets, mask, adv, old, o)
            cells.append(f"{rel(gh, h.grad):.2e} / {rel(gw, w.grad):.2e}")
        print(f"| {B} {T} {H} {V}, {std} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

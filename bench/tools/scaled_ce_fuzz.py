"""`flashgrpo.torch.liger_fused_linear_scaled_cross_entropy` (and so `fused_linear_token_stats`, which
`FusedLinearForPPO` is built on too) on random
shapes (ragged M, H, V), dtypes, temperatures, ignored rows, entropy on or off and selected
tokens (duplicates, repeated ids), against Liger-Kernel's `LigerFusedLinearScaledCrossEntropyFunction`
(on the CPU its PyTorch fallback, verl's formulas) given the same values in float64: every output
and the gradients of `hidden` and `weight` of a random upstream on every output. Gates, the
fused-linear ones of LOSSES.md (the logits are an f32-accumulated product): outputs 1e-4 x
max(1, |ref|) (1e-2 for an output in bf16: the entropy of bf16 inputs, in their dtype as Liger
returns it), gradient norms 1e-4 for f32 inputs; bf16 inputs hand back bf16 gradients, 1e-2.

Usage, from the repository root, with the peers' venv and the wheel installed:

    .venv-peers/bin/python bench/tools/scaled_ce_fuzz.py --seed 1 --cases 100

Prints each case over its gate, then `fails N worst ...`; exits 1 if any case failed.
"""

import argparse
import random
import sys

import torch
from liger_kernel.ops.fused_linear_scaled_cross_entropy import LigerFusedLinearScaledCrossEntropyFunction

import flashgrpo.torch as ft


def run(fn, h, w, target, ups, kw):
    h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = fn(h, w, target, **kw)
    out = out if isinstance(out, tuple) else (out,)
    sum(((o.double() * u).sum() for o, u in zip(out, ups)), torch.zeros((), dtype=torch.float64)).backward()
    return [o.detach() for o in out], [h.grad.double(), w.grad.double()]


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def worst_elementwise(a, b):
    return ((a - b).abs() / b.abs().clamp(min=1.0)).max().item() if a.numel() else 0.0


def case(rng, k):
    m, h, v = rng.randint(1, 80), rng.randint(1, 70), rng.randint(2, 5000)
    dtype = rng.choice([torch.float32, torch.bfloat16])
    temp = rng.choice([1.0, 0.5, 0.9, 1.7])
    hidden = torch.randn(m, h) * rng.choice([0.5, 1.0, 3.0])
    weight = torch.randn(v, h) * (2.0 / h**0.5)
    target = torch.randint(0, v, (m,))
    target[torch.rand(m) < rng.choice([0.0, 0.2, 0.9])] = -100
    entropy = rng.random() < 0.7
    selected = None
    if rng.random() < 0.5:
        selected = torch.randint(0, v, (rng.randint(1, 6),))
        selected = torch.cat([selected, selected[:1]])  # a duplicate
    kw = dict(temperature=temp, return_entropy=entropy, selected_token_ids=selected)
    shapes = [(m,)] + ([(m,)] if entropy else []) + ([(m, selected.numel())] if selected is not None else [])
    ups = [torch.randn(s, dtype=torch.float64) for s in shapes]
    name = f"case {k}: M={m} H={h} V={v} {dtype} T={temp} entropy={entropy} " \
           f"selected={None if selected is None else selected.tolist()} ignored={int((target == -100).sum())}"
    return name, hidden.to(dtype), weight.to(dtype), target, ups, kw


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cases", type=int, default=100)
    a = p.parse_args()
    rng = random.Random(a.seed)
    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    fails, worst = 0, 0.0
    for k in range(a.cases):
        name, h, w, target, ups, kw = case(rng, k)
        got_out, got_grads = run(ft.liger_fused_linear_scaled_cross_entropy, h, w, target, ups, kw)
        want_out, want_grads = run(LigerFusedLinearScaledCrossEntropyFunction.apply, h.double(), w.double(), target,
                                   ups, kw)
        # An output in bf16 (the entropy of bf16 inputs, as Liger returns it) carries its rounding.
        out_gates = [1e-4 if o.dtype == torch.float32 else 1e-2 for o in got_out]
        grad_gate = 1e-4 if h.dtype == torch.float32 else 1e-2
        errs = [worst_elementwise(g.double(), w_.double()) for g, w_ in zip(got_out, want_out)]
        gerrs = [rel(g, w_) for g, w_ in zip(got_grads, want_grads)]
        score = max([e / g for e, g in zip(errs, out_gates)] + [e / grad_gate for e in gerrs])
        worst = max(worst, score)
        if score > 1.0:
            fails += 1
            print(f"FAIL {name}: outputs {['%.2e' % e for e in errs]}, grads {['%.2e' % e for e in gerrs]}")
    print(f"fails {fails} worst {worst:.3f} of the gate over {a.cases} cases (seed {a.seed})")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()

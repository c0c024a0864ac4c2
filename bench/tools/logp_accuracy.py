"""How close `log p(target)` comes to float64, ours against PyTorch's float32 `log_softmax`, on
rows of LLM-sized logits at temperatures whose inverse float32 cannot hold exactly.

For each temperature, logit dtype and logit offset (logits ~ N(offset, 2), offset 0 or 20: where
half an ulp of `u = x / T` is ~1e-7 or ~1e-6), `rows` rows of `V` logits and random targets:
`flashgrpo.torch.logprob` and `torch.log_softmax(logits.float() / T).gather(...)` against
`log_softmax` in float64 of the same values. Prints the mean (bias), rms and largest error of each,
and of ours as it was before 2026-11-29's change (the target's `u` rounded to f32, no move from the
f32 inverse temperature to `1 / T`), reconstructed from ours: `+ (fl32(x inv_t) - x inv_t)
- drift (u_y - E_p[u])`, exactly what the change took out of `log p` (LOSSES.md, "Row statistics").

Usage: .venv-peers/bin/python bench/tools/logp_accuracy.py [--rows 64] [--vocab 151936] [--seed 0]
"""

import argparse

import torch

import flashgrpo.torch as ft


def errors(got, want):
    d = got.double() - want
    return d.mean().item(), d.pow(2).mean().sqrt().item(), d.abs().max().item()


def taken_out(logits, targets, temperature):
    """What the change took out of `log p`: the f32 rounding of the target's `u` and the first-order
    move from the f32 inverse temperature to `1 / T` (`E_p[u]` in float64)."""
    inv_t = torch.tensor(1.0 / temperature, dtype=torch.float32)
    x = logits.float().gather(-1, targets[:, None])[:, 0]
    exact_u = x.double() * inv_t.double()
    rounding = (x * inv_t).double() - exact_u
    drift = (1.0 / temperature - inv_t.double()) / inv_t.double()
    u = logits.double() * inv_t.double()
    mean_u = (torch.softmax(u, -1) * u).sum(-1)
    return rounding - drift * (exact_u - mean_u)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    g = torch.Generator().manual_seed(a.seed)
    print(f"{'dtype':8} {'offset':>6} {'T':>5}   {'ours: mean':>11} {'rms':>8} {'max':>8}   "
          f"{'before: mean':>12} {'rms':>8} {'max':>8}   {'torch f32: mean':>15} {'rms':>8} {'max':>8}")
    for dtype in (torch.float32, torch.bfloat16):
        for offset in (0.0, 20.0):
            logits = (torch.randn(a.rows, a.vocab, generator=g) * 2 + offset).to(dtype)
            targets = torch.randint(0, a.vocab, (a.rows,), generator=g)
            for temperature in (0.66, 0.7, 0.9, 1.3):
                exact = torch.log_softmax(logits.double() / temperature, -1).gather(-1, targets[:, None])[:, 0]
                ours = ft.logprob(logits, targets, temperature=temperature)
                f32 = torch.log_softmax(logits.float() / temperature, -1).gather(-1, targets[:, None])[:, 0]
                before = ours.double() + taken_out(logits, targets, temperature)
                o, b, t = errors(ours, exact), errors(before, exact), errors(f32, exact)
                print(f"{str(dtype)[6:]:8} {offset:6.0f} {temperature:5.2f}   {o[0]:+11.1e} {o[1]:8.1e} {o[2]:8.1e}   "
                      f"{b[0]:+12.1e} {b[1]:8.1e} {b[2]:8.1e}   {t[0]:+15.1e} {t[1]:8.1e} {t[2]:8.1e}")


if __name__ == "__main__":
    main()

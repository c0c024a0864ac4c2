"""Per-token NLL and entropy from hidden states and lm_head, both back-propagated (what verl's
`FusedLinearForPPO` and Liger-Kernel's `LigerFusedLinearScaledCrossEntropyFunction` compute), one
forward and backward per step, the arms alternated in every round (A B C, then C B A):

- `flashgrpo`: `flashgrpo.torch.liger_fused_linear_scaled_cross_entropy(return_entropy=True)`,
  one stream of the vocabulary forward and one backward (`fused_linear_token_stats`);
- `flashgrpo-two-calls`: `fused_linear_logprob` + `fused_linear_entropy`, each differentiable,
  two streams each way (what composing the earlier ops costs);
- `liger`: Liger's function itself (on the CPU its PyTorch fallback, verl's formulas: 512-token
  chunks, the logits materialised per chunk, recomputed in the backward).

Prints one JSON line per arm: step times per round and their median (s). With `--only ARM`, that
arm alone, and its peak memory above the inputs and their gradients (`VmHWM` after the steps minus
the resident size once the inputs exist, the peak reset there, less a step's copy of the inputs and
their gradients in the inputs' dtype, MiB): run each arm in a process of its own for that.
With `--split`, instead: `fused_linear_token_stats`'s forward and backward timed apart (NLL and
entropy back-propagated), beside `fused_linear_grpo_loss`'s eager step (three products) in the
same process, per round after a first one discarded: what the step costs against its products.
Usage: python bench/peers/scaled_ce.py [--n 1024] [--hidden 896] [--vocab 151936] [--dtype f32|bf16]
[--rounds 3] [--only flashgrpo|flashgrpo-two-calls|liger] [--split]"""

import json
import time

import torch

import flashgrpo.torch as ft
from arms import alternated, parser, print_arms, reset_peak, resident_mib

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def step(arm, hidden, weight, target, d_nll, d_ent):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    if arm == "flashgrpo":
        nll, ent = ft.liger_fused_linear_scaled_cross_entropy(h, w, target, return_entropy=True)
    elif arm == "flashgrpo-two-calls":
        nll = -ft.fused_linear_logprob(h, w, target)
        ent = ft.fused_linear_entropy(h, w)
    else:
        from liger_kernel.ops.fused_linear_scaled_cross_entropy import LigerFusedLinearScaledCrossEntropyFunction

        nll, ent = LigerFusedLinearScaledCrossEntropyFunction.apply(h, w, target, return_entropy=True)
    ((nll * d_nll).sum() + (ent.float() * d_ent).sum()).backward()
    return h.grad, w.grad


def split(hidden, weight, target, d_nll, d_ent, rounds):
    """Per round: the token statistics' forward and backward (s), and the GRPO step's."""
    n, h = hidden.shape
    out = dict(forward_s=[], backward_s=[], grpo_step_s=[])
    for r in range(rounds + 1):
        hh, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        t0 = time.perf_counter()
        stats = ft.fused_linear_token_stats(hh, w, target)
        t1 = time.perf_counter()
        ((-stats.logp * d_nll).sum() + (stats.entropy * d_ent).sum()).backward()
        t2 = time.perf_counter()
        hh, w = hidden.clone().reshape(1, n, h).requires_grad_(True), weight.clone().requires_grad_(True)
        t3 = time.perf_counter()
        ft.fused_linear_grpo_loss(hh, w, target.reshape(1, n), torch.randn(1), beta=0.0).loss.backward()
        t4 = time.perf_counter()
        if r:  # the first round maps pages and pools buffers
            for k, t in zip(out, (t1 - t0, t2 - t1, t4 - t3)):
                out[k].append(round(t, 4))
    return out


def main():
    p = parser(["flashgrpo", "flashgrpo-two-calls", "liger"])
    p.add_argument("--split", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    dtype = DTYPES[a.dtype]
    hidden = torch.randn(a.n, a.hidden).to(dtype)
    weight = (torch.randn(a.vocab, a.hidden) * (2.0 / a.hidden**0.5)).to(dtype)
    target = torch.randint(0, a.vocab, (a.n,))
    d_nll, d_ent = torch.randn(a.n), torch.randn(a.n)
    if a.split:
        print(json.dumps(dict(n=a.n, hidden=a.hidden, vocab=a.vocab, dtype=a.dtype,
                              **split(hidden, weight, target, d_nll, d_ent, a.rounds))))
        return
    if a.only == "liger":  # its import's own memory is not the step's
        import liger_kernel.ops.fused_linear_scaled_cross_entropy  # noqa: F401
    reset_peak()
    base = resident_mib("VmRSS")
    arms = [a.only] if a.only else ["flashgrpo", "flashgrpo-two-calls", "liger"]
    for arm in arms:  # warm-up: pages, thread pools, pooled gradient buffers
        step(arm, hidden, weight, target, d_nll, d_ent)
    times = alternated(arms, a.rounds, lambda arm: step(arm, hidden, weight, target, d_nll, d_ent))
    leaves = 2 * (hidden.nbytes + weight.nbytes) / 2**20  # a step's clones and their gradients
    peak = resident_mib("VmHWM") - base - leaves if a.only else None
    print_arms(times, dict(n=a.n, hidden=a.hidden, vocab=a.vocab, dtype=a.dtype), peak)


if __name__ == "__main__":
    main()

"""Fused-linear GRPO on random shapes and options against Liger-Kernel's `LigerFusedLinearGRPOLoss`
given the same input values in float64: the relative error of the loss, the metrics and every
gradient (norm), and the worst over the cases. Liger 0.8.5 computes the log-probabilities and
gradients in float32 whatever its inputs' dtype, so a case over its gate is judged against TRL
1.16's `_compute_loss` in float64 (tests/peers/trl_losses.py, on the float64 logits `x W^T + b`,
its logits gradient carried through the product): not a failure when ours is within the gate of
that and closer to it than Liger (reported as Liger's float32 rounding).

Two front ends:
- `torch`: `flashgrpo.torch.FusedLinearGRPOLoss` (the drop-in) on f32 or bf16 inputs, six loss
  types, token or sequence level; its bf16 gradients are bf16 (the gate: 1e-2, LOSSES.md's bf16
  gradient tolerance), its f32 ones f32 (1e-4, the fused-linear f32 tolerance).
- `arrays`: `flashgrpo.arrays.linear_loss` on bf16 or f16 inputs with f32 gradients, the library's
  default way (on a CPU with AMX or AVX512-BF16 the split-gradient bf16 products): gated at 1e-4.

Usage, from the repository root, with the peers' venv (`bench/peers/setup.sh`) and the wheel
(`crates/python/install.sh .venv-peers/bin/python`):

    .venv-peers/bin/python bench/tools/fused_linear_fuzz.py --front torch --seed 7 --cases 150
    .venv-peers/bin/python bench/tools/fused_linear_fuzz.py --front arrays --dtype bf16 --seed 3 --cases 60

Prints each case over its gate, then `fails N worst ...`; exits 1 if any case failed.
"""

import argparse
import os
import random
import sys
import warnings

warnings.filterwarnings("ignore")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss  # noqa: E402

import flashgrpo.arrays as fa  # noqa: E402
import flashgrpo.torch as ft  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "peers"))
from trl_losses import options as trl_options, trl_loss  # noqa: E402

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def rel(ours, ref):
    ours, ref = torch.as_tensor(np.asarray(ours, np.float64)), ref.double()
    return ((ours - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def liger(kw, x, w, b, ids, mask, adv, ref, old):
    """Liger's loss and gradients in float64 on the values of x, w, b."""
    xx, ww = x.double().requires_grad_(), w.double().requires_grad_()
    bb = None if b is None else b.double().requires_grad_()
    loss, metrics = LigerFusedLinearGRPOLoss(**kw)(xx, ww, ids, mask, adv, bias=bb, ref_per_token_logps=ref,
                                                   old_per_token_logps=old)
    loss.backward()
    return loss.detach(), [m.detach() for m in metrics], [xx.grad, ww.grad] + ([] if bb is None else [bb.grad])


def trl_exact(kw, x, w, b, ids, mask, adv, ref, old):
    """TRL's loss and gradients in float64: `_compute_loss` on the float64 logits, its gradient
    with respect to them carried through `x W^T + b` (no metrics)."""
    xx, ww = x.double(), w.double()
    logits = xx @ ww.T + (0 if b is None else b.double())
    o = trl_options(loss_type=kw["loss_type"], importance_sampling_level=kw["importance_sampling_level"],
                    epsilon_low=kw["epsilon_low"], epsilon_high=kw["epsilon_high"], beta=kw["beta"],
                    temperature=kw["temperature"])
    loss, g = trl_loss(o, logits, ids, mask, adv, old, ref, None)
    grads = [g @ ww, g.reshape(-1, g.shape[-1]).T @ xx.reshape(-1, xx.shape[-1])]
    return loss, None, grads + ([] if b is None else [g.reshape(-1, g.shape[-1]).sum(0)])


def drop_in(kw, x, w, b, ids, mask, adv, ref, old):
    """`FusedLinearGRPOLoss`' loss, metrics and gradients (in the inputs' dtype)."""
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    bb = None if b is None else b.clone().requires_grad_()
    loss, metrics = ft.FusedLinearGRPOLoss(**kw)(xx, ww, ids, mask, adv, bias=bb, ref_per_token_logps=ref,
                                                 old_per_token_logps=old)
    loss.backward()
    return loss.detach(), [m.detach() for m in metrics], [xx.grad, ww.grad] + ([] if bb is None else [bb.grad])


def numpy_of(t):
    """A NumPy array of `t`'s values in its dtype (bf16 through ml_dtypes)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def arrays(kw, x, w, b, ids, mask, adv, ref, old):
    """`flashgrpo.arrays.linear_loss`' loss and f32 gradients (no metrics)."""
    options = {k: v for k, v in kw.items() if v is not None}
    out = fa.linear_loss("grpo", numpy_of(x), numpy_of(w), targets=ids.numpy().astype(np.int64),
                         advantages=adv.numpy(), mask=mask.numpy(), bias=None if b is None else numpy_of(b),
                         old_logp=None if old is None else old.numpy(), ref_logp=ref.numpy(), grad=True,
                         **options)
    grads = [out["grad_hidden"], out["grad_weight"]] + ([] if b is None else [out["grad_bias"]])
    return torch.tensor(float(out["loss"])), None, grads


def case(front, dtype):
    """Random shapes, options and inputs of one case."""
    B, T = random.choice([1, 2, 3]), random.choice([1, 5, 17] + ([40] if front == "arrays" else []))
    H = random.choice([7, 33, 64, 96] if front == "torch" else [7, 31, 33, 64, 130])
    V = random.choice([2, 3, 31, 257, 1000, 2049] if front == "torch" else [2, 31, 257, 1000, 2049, 5000])
    dt = DTYPES[dtype] if dtype else random.choice([torch.float32, torch.bfloat16])
    types = ["grpo", "bnpo", "dr_grpo", "dapo"] + (["cispo", "sapo"] if front == "torch" else [])
    loss_type = random.choice(types)
    level = random.choice(["token", "sequence"]) if front == "torch" and loss_type not in ("cispo", "sapo") else "token"
    kw = dict(beta=random.choice([0.0, 0.04]), epsilon_low=0.2, epsilon_high=random.choice([0.2, 0.28]),
              loss_type=loss_type, temperature=random.choice([1.0, 0.7]), importance_sampling_level=level,
              max_completion_length=T if loss_type == "dr_grpo" else None)
    x = torch.randn(B, T, H).to(dt)
    w = (torch.randn(V, H) * random.choice([0.05, 0.3])).to(dt)
    b = (torch.randn(V) * 0.1).to(dt) if random.random() < 0.5 else None
    ids = torch.randint(0, V, (B, T))
    mask = (torch.rand(B, T) > 0.2).float()
    if B > 1 and random.random() < 0.3:
        mask[0] = 0  # a whole sequence masked
    mask[-1, -1] = 1
    adv = torch.randn(B)
    ref = torch.randn(B, T) * 0.5 - 3
    old = torch.randn(B, T) * 0.5 - 3 if front == "arrays" or random.random() < 0.5 else None
    return kw, (x, w, b, ids, mask, adv, ref, old), dt


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--front", choices=["torch", "arrays"], default="torch")
    p.add_argument("--dtype", choices=list(DTYPES), help="inputs' dtype (default: torch f32 or bf16 at random, "
                   "arrays bf16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", type=int, default=40)
    a = p.parse_args()
    if a.front == "arrays":
        if a.dtype == "f32":
            p.error("--front arrays checks the bf16 and f16 paths: --dtype bf16 or f16")
        a.dtype = a.dtype or "bf16"
    random.seed(a.seed)
    torch.manual_seed(a.seed)
    ours_of = drop_in if a.front == "torch" else arrays
    fails, worst, judged = 0, {}, 0
    for _ in range(a.cases):
        kw, inputs, dt = case(a.front, a.dtype)
        ours, ref = ours_of(kw, *inputs), liger(kw, *inputs)
        errors = [rel(ours[0], ref[0])]
        if ours[1] is not None:
            errors += [rel(m, r) for m, r in zip(ours[1], ref[1])]
        errors += [rel(g.float() if torch.is_tensor(g) else g, r) for g, r in zip(ours[2], ref[2])]
        gate = 1e-2 if a.front == "torch" and dt != torch.float32 else 1e-4
        name = str(dt).removeprefix("torch.")
        if max(errors) <= gate:
            worst[name] = max(worst.get(name, 0.0), max(errors))
        else:
            exact = trl_exact(kw, *inputs)
            ours_exact = [rel(ours[0], exact[0])] + [rel(g.float() if torch.is_tensor(g) else g, r)
                                                     for g, r in zip(ours[2], exact[2])]
            liger_exact = [rel(ref[0], exact[0])] + [rel(g, r) for g, r in zip(ref[2], exact[2])]
            if max(ours_exact) <= gate and max(ours_exact) < max(liger_exact):
                judged += 1
                print(f"LIGER'S ROUNDING {list(inputs[0].shape)} V={inputs[1].shape[0]} {kw}: from TRL in float64 ours "
                      + " ".join(f"{e:.2e}" for e in ours_exact) + ", Liger " + " ".join(f"{e:.2e}" for e in liger_exact))
                continue
            worst[name] = max(worst.get(name, 0.0), max(errors))
            fails += 1
            x, w = inputs[0], inputs[1]
            print(f"FAIL {list(x.shape)} V={w.shape[0]} {name} bias={inputs[2] is not None} "
                  f"old={inputs[7] is not None} {kw}: " + " ".join(f"{e:.2e}" for e in errors))
    print(f"fails {fails} ({judged} more over the gate against Liger, ours within it of TRL in float64) worst "
          + " ".join(f"{k} {v:.2e}" for k, v in sorted(worst.items())))
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()

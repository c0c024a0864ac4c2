"""Our Liger drop-ins against Liger-Kernel's own Triton kernels, run on the CPU by Triton's
interpreter (`TRITON_INTERPRET=1`): the peers' real code, not a re-derivation of it.

- `flashgrpo.torch.triton_grpo_loss` against `liger_kernel.transformers.grpo_loss.triton_grpo_loss`:
  every loss type, token / sequence importance sampling, beta 0 or not, with or without old
  log-probabilities, temperatures, eps, two-sided clipping (`delta`), the bias-corrected KL, vLLM
  ratios per token / per sequence, `num_items_in_batch`, `max_completion_length`, masks, reduce
  True (loss and metrics) or False (per-token loss, KL, clipped flags, a random upstream per
  token, at sequence level too), logits f32 or bf16, ours in place or not. V from 1 past Liger's 4096-wide block.
- `flashgrpo.torch.cross_entropy` against `liger_kernel.transformers.LigerCrossEntropyLoss`
  (ignore_index, label smoothing, `lse_square_scale` = our `z_loss`, mean / sum / none, `softcap`
  since 2026-11-30); with `return_z_loss`, `return_token_accuracy` or `return_predicted_tokens`
  drawn, the drop-in `flashgrpo.torch.CrossEntropyLoss` (since 2026-11-30, second session).
- `flashgrpo.torch.FusedLinearCrossEntropyLoss` against `LigerFusedLinearCrossEntropyLoss`
  (the Triton one, with bias or not; `softcap`, `return_z_loss` and `use_token_scaling` since
  2026-11-30, `return_token_accuracy` and `return_predicted_tokens` since its second session).
  Predicted tokens must be Liger's but where a row's two largest logits (float64, capped) are
  within the logits' own rounding (f32: 1e-5; Liger's bf16 logits: 1e-2), where either may come
  out; the token accuracy may differ by those rows alone.
- With `--class-weights` (not in the default mix either): every cross-entropy case (both kinds)
  with per-class weights in [0.25, 1.75), Liger's `weight` / `ce_weight` against ours (since
  2026-11-30, third session); the float64 reference is `F.cross_entropy(weight=)` with Liger's
  unweighted z-loss.
- With `--only logprob` (not in the default mix, which stays as recorded in docs/BENCHMARKS.md):
  `flashgrpo.torch.logprob` against Liger's `fused_selective_log_softmax`, logits around 0 or 20.

Both sides compute in f32; values and gradients must agree within `--tol` (default 2e-5) of the
largest magnitude of Liger's (bf16 gradients: within 1e-2, their rounding). Where Liger refuses
an option (ValueError / AssertionError) ours must refuse it too. An entry over its gate is judged
against float64 (PyTorch's cross-entropy and log-softmax; TRL 1.16's `_compute_loss`, or its
per-token formula for unreduced losses; the KL): not a failure where ours is within
the gate of float64 and as close as Liger, or where float32 itself cannot do better (see
`compare`).

Usage: python liger_triton_fuzz.py [--seed 1] [--cases 200] [--only grpo|ce|flce|logprob] [--class-weights]
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402
from liger_kernel.transformers import LigerCrossEntropyLoss, LigerFusedLinearCrossEntropyLoss  # noqa: E402
from liger_kernel.ops.grpo_loss import fused_selective_log_softmax  # noqa: E402
from liger_kernel.transformers.grpo_loss import triton_grpo_loss as liger_grpo  # noqa: E402
import numpy as np  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402
import liger_kernel.ops.cross_entropy as liger_cross_entropy_module  # noqa: E402

# Triton's interpreter hands a Python float argument to the kernel as a Python float, where the
# compiled kernel gets an f32 scalar: Liger's cross-entropy kernel calls `softcap.to(tl.float32)`
# and fails in the interpreter alone. Floats become f32 scalars here, as compiled. (Both shims are
# for `softcap`: Liger's other options do not reach them.)
_plain_cvt = interpreter._implicit_cvt


def _implicit_cvt(arg):
    if isinstance(arg, float):
        return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
    return _plain_cvt(arg)


interpreter._implicit_cvt = _implicit_cvt


def _interpreted_tanh(x):
    """libdevice's `tanh`, which the interpreter lacks (it returns None): NumPy's, in x's dtype."""
    return tl.tensor(interpreter.TensorHandle(np.tanh(x.handle.data), x.handle.dtype), x.type)


liger_cross_entropy_module.tanh = _interpreted_tanh

import flashgrpo.torch as ft  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "peers"))
from trl_losses import options as trl_options, trl_loss  # noqa: E402
from crosscheck import trl_grpo  # noqa: E402

# Not `luspo`: Liger's Triton loss reduces it as `(per_token_loss * n_b).mean()` over B*L, TRL 1.16
# (and ours, docs/PYTHON.md) as `(per_token_loss * mask).sum(-1).mean()`; and its backward reads
# a [B, 1] upstream with [B, L] strides (liger-kernel 0.8.5), so its gradient is not comparable.
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo"]
VOCABS = [1, 2, 7, 31, 64, 127, 300, 1000, 4097, 5000]


def rel(a, b, floor=1e-6):
    """The largest difference over the largest magnitude of `b` (or `floor`, if larger)."""
    a, b = a.double(), b.double()
    scale = b.abs().max().item() if b.numel() else 0.0
    return (a - b).abs().max().item() / max(scale, floor) if b.numel() else 0.0


def both(run_ours, run_liger):
    """(ours, liger) results, or the exception each raised (refusals are compared, not hidden)."""
    out = []
    for fn in (run_ours, run_liger):
        try:
            out.append(fn())
        except (ValueError, AssertionError, NotImplementedError, RuntimeError) as e:
            out.append(e)
    return out


def draw_grpo(rng, g):
    B, L, V = rng.randint(1, 4), rng.randint(1, 12), rng.choice(VOCABS)
    dtype = torch.bfloat16 if rng.random() < 0.25 else torch.float32
    loss_type = rng.choice(LOSS_TYPES)
    level = "sequence" if rng.random() < 0.3 else "token"
    beta = rng.choice([0.0, 0.0, 0.04, 0.3])
    spread = rng.choice([0.5, 2.0, 5.0])
    logits = (spread * torch.randn(B, L + 1, V, generator=g)).to(dtype)
    ids = torch.randint(0, V, (B, L), generator=g)
    base = torch.log_softmax(logits.float()[:, :L] / 1.0, -1).gather(-1, ids[..., None])[..., 0]
    old = None if rng.random() < 0.25 else (base + 0.3 * torch.randn(B, L, generator=g)).contiguous()
    ref = (base + 0.3 * torch.randn(B, L, generator=g)).contiguous() if beta != 0.0 else None
    mask = None
    if rng.random() < 0.7:
        mask = (torch.rand(B, L, generator=g) < rng.choice([0.5, 0.9])).float()
        if rng.random() < 0.3:
            mask[0] = 0.0
    adv = torch.randn(B, generator=g)
    if rng.random() < 0.2:
        adv[0] = 0.0
    isr = None
    r = rng.random() if loss_type != "vespo" or mask is None else 1.0  # vespo: documented below
    if r < 0.15:
        isr = torch.rand(B, L, generator=g) * 1.5 + 0.2
    # vespo with a ratio: documented differences (docs/PYTHON.md): Liger's weight sums the log-ratio
    # over masked positions too, and takes a per-sequence ratio once per position.
    elif r < 0.25 and loss_type != "vespo":
        isr = torch.rand(B, 1, generator=g) * 1.5 + 0.2
    opts = dict(temperature=rng.choice([1.0, 0.9, 0.7, 1.3]), beta=beta, eps_low=rng.choice([0.2, 0.1, 0.3]),
                eps_high=rng.choice([0.2, 0.28, 0.4]), loss_type=loss_type,
                max_completion_length=rng.choice([None, L + 3]), importance_sampling_level=level,
                reduce=rng.random() < 0.5, vllm_is_ratio=isr,
                delta=rng.choice([None, None, 1.5, 4.0]) if loss_type not in ("cispo", "sapo", "vespo") else None,
                use_bias_correction_kl=beta != 0.0 and rng.random() < 0.3,
                num_items_in_batch=rng.choice([None, None, max(1, B * L // 2)]))
    if loss_type == "sapo":
        opts.update(sapo_temperature_pos=rng.choice([1.0, 0.5]), sapo_temperature_neg=rng.choice([1.05, 2.0]))
    if loss_type == "vespo":
        opts.update(vespo_k_pos=rng.choice([2.0, 1.0]), vespo_lambda_neg=rng.choice([2.0, 0.5]))
    desc = (f"grpo B={B} L={L} V={V} {str(dtype)[6:]} spread={spread} old={old is not None} "
            f"mask={mask is not None} " + " ".join(f"{k}={v if not torch.is_tensor(v) else tuple(v.shape)}"
                                                   for k, v in opts.items()))
    return desc, (logits, old, ref, ids, adv, mask), opts, rng.random() < 0.5


def grpo_case(rng, g, tol):
    desc, (logits, old, ref, ids, adv, mask), opts, inplace = draw_grpo(rng, g)
    B, L = ids.shape
    upstream = torch.randn(B, L, generator=g)

    def run(fn, in_place, inputs=logits):
        x = inputs.clone().requires_grad_()
        out = fn(x, old, ref, ids, adv, mask, inplace=in_place, **opts)
        if opts["reduce"]:
            loss, metrics = out
            loss.backward()
            values = [("loss", loss.detach())] + [(f"metric{i}", m.detach()) for i, m in enumerate(metrics)]
        else:
            loss, kl, clipped = out
            (loss * upstream).sum().backward()
            values = [("per_token_loss", loss.detach()), ("is_clipped", clipped.detach().float())]
            if kl is not None:
                values.append(("kl", kl.detach()))
        return values + [("grad", x.grad[:, :L].float())]

    ours, theirs = both(lambda: run(ft.triton_grpo_loss, inplace), lambda: run(liger_grpo, False))
    floors = {}
    if opts["reduce"] and not isinstance(theirs, Exception):
        # A reduced loss may cancel to far below its terms: its error is judged against the mean
        # magnitude of the unmasked per-token losses (Liger's) as well as against itself.
        with torch.no_grad():
            per_token = liger_grpo(logits.clone(), old, ref, ids, adv, mask, inplace=False, **dict(opts, reduce=False))[0]
        m = torch.ones(B, L) if mask is None else mask
        floors["loss"] = ((per_token.abs() * m).sum() / m.sum().clamp(min=1)).item()
    exact = {}
    if opts["beta"] != 0.0:  # the KL, per token or its mean, in float64
        logp = torch.log_softmax(logits.double()[:, :L] / opts["temperature"], -1).gather(-1, ids[..., None])[..., 0]
        d = ref.double() - logp
        m = torch.ones(B, L, dtype=torch.float64) if mask is None else mask.double()
        kl = d.exp() - d - 1
        if opts["use_bias_correction_kl"]:  # times the importance ratio, the token's or its sequence's
            log_ratio = torch.zeros_like(logp) if old is None else logp - old.double()
            if opts["importance_sampling_level"] == "sequence":
                log_ratio = ((log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)).expand(B, L)
            kl = kl * log_ratio.exp()
        if opts["reduce"]:
            exact["metric0"] = (kl * m).sum() / m.sum().clamp(min=1)
        else:
            exact["kl"] = kl * m
    # Liger's own results with each f32 logit moved by one ulp, up or down at random: how much an
    # f32 implementation's outputs can move for the rounding of its inputs alone.
    if trl_comparable(opts, L):
        exact.update(trl_reference(opts, logits[:, :L], ids, mask, adv, old, ref, torch.float64))
        trl32 = trl_reference(opts, logits[:, :L], ids, mask, adv, old, ref, torch.float32)
    elif per_token_comparable(opts):
        args = (opts, logits[:, :L], ids, mask, adv, old, ref, upstream)
        exact.update(per_token_reference(*args, torch.float64))
        trl32 = per_token_reference(*args, torch.float32)
    else:
        trl32 = None
    signs = torch.randint(0, 2, logits.shape, generator=g).bool()
    moved = torch.nextafter(logits, torch.where(signs, float("inf"), float("-inf")).to(logits.dtype))
    perturbed = None if logits.dtype != torch.float32 else (lambda: run(liger_grpo, False, moved))
    return desc + f" ours_inplace={inplace}", compare(ours, theirs, tol, logits.dtype, f32_loss=True, exact=exact,
                                                     floors=floors, perturbed=perturbed, torch32=trl32)


def trl_comparable(opts, L):
    """Whether TRL 1.16's `_compute_loss` computes what Liger's Triton loss does with `opts`
    (tests/peers/trl_losses.py's stand-in: one process, `num_items_in_batch` the mask's sum,
    `max_completion_length = L`, the default sapo temperatures, no rollout ratio)."""
    lt = opts["loss_type"]
    return (opts["reduce"] and opts["vllm_is_ratio"] is None
            and (opts["num_items_in_batch"] is None or lt not in ("dapo", "cispo", "vespo"))
            and (opts["max_completion_length"] in (None, L) or lt != "dr_grpo")
            and opts.get("sapo_temperature_pos", 1.0) == 1.0
            and opts.get("sapo_temperature_neg", 1.05) == 1.05)


def per_token_comparable(opts):
    """Whether `per_token_reference` computes Liger's per-token losses for `opts`."""
    return not opts["reduce"] and opts["loss_type"] != "vespo"


def per_token_reference(opts, logits, ids, mask, adv, old, ref, upstream, dtype):
    """TRL 1.16's per-token loss (its `_compute_loss` up to the reduction, tests/peers/crosscheck.py's
    `trl_grpo`: the PPO surrogate with `delta`, cispo, sapo, the importance weight the token's or
    its sequence's masked mean; times the vLLM ratio; plus beta times the k3 KL, bias-corrected or
    not), masked, and the logits' gradient of `sum(upstream * mask * loss)`, in `dtype`."""
    o = dict(temperature=opts["temperature"], epsilon_low=opts["eps_low"], epsilon_high=opts["eps_high"],
             delta=opts["delta"], beta=opts["beta"], loss_type=opts["loss_type"],
             importance_sampling_level=opts["importance_sampling_level"], entropy_coef=0.0,
             use_bias_correction_kl=opts["use_bias_correction_kl"], max_completion_length=None, num_items=None,
             sapo_temperature_pos=opts.get("sapo_temperature_pos", 1.0),
             sapo_temperature_neg=opts.get("sapo_temperature_neg", 1.05))
    m = torch.ones(ids.shape) if mask is None else mask
    r = trl_grpo(logits, ids, m, adv, old, ref, opts["vllm_is_ratio"], o, upstream=upstream, dtype=dtype)
    out = {"per_token_loss": r["per_token_loss"] * m.to(dtype), "grad": r["grad"]}
    return out if opts["beta"] == 0.0 else dict(out, kl=r["kl"] * m.to(dtype))


def trl_reference(opts, logits, ids, mask, adv, old, ref, dtype):
    """TRL's loss and gradient in `dtype` (float64: the exact values that judge an entry over its
    gate; float32: TRL's own rounding, a measure of how ill-conditioned the case is)."""
    o = trl_options(loss_type=opts["loss_type"], importance_sampling_level=opts["importance_sampling_level"],
                    epsilon_low=opts["eps_low"], epsilon_high=opts["eps_high"], delta=opts["delta"],
                    beta=opts["beta"], use_bias_correction_kl=opts["use_bias_correction_kl"],
                    temperature=opts["temperature"], **{k: v for k, v in opts.items() if k.startswith("vespo_")})
    m = torch.ones(ids.shape) if mask is None else mask
    loss, grad = trl_loss(o, logits.float(), ids, m, adv, old, ref, None, dtype)
    return {"loss": loss, "grad": grad}


def logprob_case(rng, g, tol):
    """`flashgrpo.torch.logprob` against Liger's `fused_selective_log_softmax` (its Triton kernel
    that scores the log-probabilities of `[B, L+1, V]` logits' first L positions), unmasked
    positions only (Liger writes 0 on masked ones; ours takes no mask)."""
    B, L, V = rng.randint(1, 4), rng.randint(1, 12), rng.choice(VOCABS)
    dtype = torch.bfloat16 if rng.random() < 0.25 else torch.float32
    logits = (rng.choice([0.5, 2.0, 5.0]) * torch.randn(B, L + 1, V, generator=g) + rng.choice([0.0, 20.0])).to(dtype)
    ids = torch.randint(0, V, (B, L), generator=g)
    mask = None if rng.random() < 0.5 else (torch.rand(B, L, generator=g) < 0.8).float()
    temperature = rng.choice([1.0, 0.9, 0.7, 1.3])
    keep = torch.ones(B, L, dtype=torch.bool) if mask is None else mask.bool()
    desc = f"logprob B={B} L={L} V={V} {str(dtype)[6:]} T={temperature} mask={mask is not None}"
    ours, theirs = both(lambda: [("logp", ft.logprob(logits[:, :L], ids, temperature=temperature)[keep])],
                        lambda: [("logp", fused_selective_log_softmax(logits, ids, temperature, mask)[keep])])
    def reference(dt):
        return torch.log_softmax(logits.to(dt)[:, :L] / temperature, -1).gather(-1, ids[..., None])[..., 0][keep]

    return desc, compare(ours, theirs, tol, dtype, f32_loss=True, exact={"logp": reference(torch.float64)},
                         torch32={"logp": reference(torch.float32)})


def ce_case(rng, g, tol):
    N, V = rng.randint(1, 24), rng.choice(VOCABS)
    dtype = torch.bfloat16 if rng.random() < 0.25 else torch.float32
    logits = (rng.choice([0.5, 2.0, 5.0]) * torch.randn(N, V, generator=g)).to(dtype)
    targets = torch.randint(0, V, (N,), generator=g)
    ignore = rng.choice([-100, 0])
    if rng.random() < 0.5:
        targets[torch.rand(N, generator=g) < 0.3] = ignore
    opts = dict(ignore_index=ignore, label_smoothing=rng.choice([0.0, 0.0, 0.1, 0.3]),
                lse_square_scale=rng.choice([0.0, 0.0, 1e-4, 1e-2]), reduction=rng.choice(["mean", "sum", "none"]),
                softcap=rng.choice([None, None, 2.0, 30.0]))
    extras = draw_extras(rng)
    upstream = torch.randn(N, generator=g)
    weight = class_weights(V, g)
    desc = f"cross_entropy N={N} V={V} {str(dtype)[6:]} {opts} {extras} class_weights={weight is not None}"

    def run(fn):
        x = logits.clone().requires_grad_()
        loss, outputs = with_extras(fn(x))
        (loss * upstream).sum().backward() if opts["reduction"] == "none" else loss.backward()
        return [("loss", loss.detach().float()), ("grad", x.grad.float())] + outputs

    ours_fn = lambda x: ft.cross_entropy(x, targets, reduction=opts["reduction"], ignore_index=ignore,  # noqa: E731
                                         label_smoothing=opts["label_smoothing"], z_loss=opts["lse_square_scale"],
                                         softcap=opts["softcap"], class_weights=weight)
    if any(extras.values()):
        ours_fn = lambda x: ft.CrossEntropyLoss(weight, **opts, **extras)(x, targets)  # noqa: E731
    ours, theirs = both(lambda: run(ours_fn),
                        lambda: run(lambda x: LigerCrossEntropyLoss(weight, **opts, **extras)(x, targets)))
    exact = dict(run(lambda x: ce_reference(x, targets, opts, weight=weight)))
    torch32 = dict(run(lambda x: ce_reference(x, targets, opts, torch.float32, weight)))
    results = compare(ours, theirs, tol, dtype, exact=exact, torch32=torch32)
    return desc, results + compare_tokens(ours, theirs, capped(logits.double(), opts), targets, opts, 1e-5)


def draw_extras(rng):
    """Liger's cross-entropy outputs besides the loss, each drawn (all off half the time)."""
    if rng.random() < 0.5:
        return {}
    return dict(return_z_loss=rng.random() < 0.4, return_token_accuracy=rng.random() < 0.6,
                return_predicted_tokens=rng.random() < 0.6)


def with_extras(out):
    """(loss, [(name, value)]) of a cross-entropy module's result: the loss alone, or Liger's
    `CrossEntropyOutput` (ours has the same fields). The tokens' entries are named `token:...`,
    compared by `compare_tokens`."""
    if torch.is_tensor(out):
        return out, []
    named = [("z_loss", out.z_loss), ("token:token_accuracy", out.token_accuracy),
             ("token:predicted_tokens", out.predicted_tokens)]
    return out.loss, [(n, v.detach() if n.startswith("token:") else v.detach().float()) for n, v in named
                      if v is not None]


def compare_tokens(ours, theirs, logits64, targets, opts, tie):
    """Predicted tokens and token accuracy against Liger's: equal, but on rows whose two largest
    float64 logits are within `tie` (relative), where either token may come out and the accuracy
    may differ by those rows."""
    if isinstance(ours, Exception) or isinstance(theirs, Exception):
        return []
    o, t = dict(ours), dict(theirs)
    kept = targets != opts.get("ignore_index", -100)
    top2 = logits64.topk(min(2, logits64.shape[-1]), -1).values
    near = (top2[:, 0] - top2[:, -1]).abs() <= tie * top2[:, 0].abs().clamp(min=1.0)
    near = near & (logits64.shape[-1] > 1) & kept
    results = []
    if "token:predicted_tokens" in t:
        got, want = o.get("token:predicted_tokens"), t["token:predicted_tokens"]
        ok = got is not None and got.dtype == want.dtype and got.shape == want.shape
        ok = ok and bool(((got == want) | near).all())
        results.append((f"predicted_tokens ({int(near.sum())} near ties)", 0.0 if ok else float("inf"), 1.0))
    if "token:token_accuracy" in t:
        got, want = o.get("token:token_accuracy"), t["token:token_accuracy"]
        if got is None or got.shape != want.shape or got.dtype != want.dtype:
            results.append(("token_accuracy: shape or dtype", float("inf"), 1.0))
        elif opts["reduction"] == "none":
            ok = bool(((got == want) | near).all())
            results.append(("token_accuracy", 0.0 if ok else float("inf"), 1.0))
        else:
            both_nan = bool(torch.isnan(got) and torch.isnan(want))
            slack = float(near.sum()) / max(float(kept.sum()), 1.0) + 1e-6
            e = 0.0 if both_nan else abs(float(got) - float(want))
            results.append(("token_accuracy", e, slack))
    return results


def ce_reference(x, targets, opts, dtype=torch.float64, weight=None):
    """Cross-entropy with label smoothing, per-class `weight` and Liger's z-loss
    (`lse_square_scale * lse^2` per kept row) in `dtype`, PyTorch's own operations, on
    `c tanh(x / c)` with a soft cap `c`. With weights `mean` divides the cross-entropy by the kept
    rows' summed target weights (PyTorch's and Liger's) and the z-loss by their count (Liger's)."""
    xx = capped(x.to(dtype), opts)
    kept = targets != opts["ignore_index"]
    w = None if weight is None else weight.to(dtype)
    per = torch.nn.functional.cross_entropy(xx, targets, weight=w, reduction="none", ignore_index=opts["ignore_index"],
                                            label_smoothing=opts["label_smoothing"])
    z = opts["lse_square_scale"] * torch.logsumexp(xx, -1) ** 2 * kept
    scale = token_scale(xx, targets, opts)
    if w is None or opts["reduction"] != "mean":
        return reduced((per + z) * scale, kept, opts)
    target_weight = (w[(targets * kept).long()] * kept).sum()
    return (per * scale).sum() / target_weight + reduced(z * scale, kept, opts)


CLASS_WEIGHTS = [False]


def class_weights(vocab, g):
    """Per-class weights in [0.25, 1.75) with `--class-weights`, else None."""
    return 0.25 + 1.5 * torch.rand(vocab, generator=g) if CLASS_WEIGHTS[0] else None


def capped(x, opts):
    """`c tanh(x / c)` with a soft cap `c`, else `x`."""
    c = opts.get("softcap")
    return x if c is None else c * torch.tanh(x / c)


def reduced(per, kept, opts):
    """Per-row values reduced as the loss: per row, summed, or summed over the kept rows' count."""
    if opts["reduction"] == "none":
        return per
    return per.sum() / (kept.sum().clamp(min=1) if opts["reduction"] == "mean" else 1)


def token_scale(xx, targets, opts):
    """Liger's `use_token_scaling`: each kept row times its own `p_y`, detached (1 without it)."""
    if not opts.get("use_token_scaling"):
        return 1.0
    kept = targets != opts["ignore_index"]
    p = torch.softmax(xx.detach(), -1).gather(-1, (targets * kept)[:, None])[:, 0]
    return p * kept


def z_loss_reference(logits, targets, opts):
    """Liger's z-loss output: `lse_square_scale * lse^2` on the kept rows, reduced as the loss."""
    xx = capped(logits.detach(), opts)
    kept = targets != opts["ignore_index"]
    per = opts["lse_square_scale"] * torch.logsumexp(xx, -1) ** 2 * kept * token_scale(xx, targets, opts)
    return reduced(per, kept, opts)


def flce_case(rng, g, tol):
    N, H, V = rng.randint(1, 24), rng.choice([8, 33, 64]), rng.choice(VOCABS)
    dtype = torch.bfloat16 if rng.random() < 0.25 else torch.float32
    h = torch.randn(N, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * rng.choice([0.1, 0.5])).to(dtype)
    b = (0.1 * torch.randn(V, generator=g)).to(dtype) if rng.random() < 0.5 else None
    targets = torch.randint(0, V, (N,), generator=g)
    if rng.random() < 0.5:
        targets[torch.rand(N, generator=g) < 0.3] = -100
    opts = dict(label_smoothing=rng.choice([0.0, 0.0, 0.1]), lse_square_scale=rng.choice([0.0, 0.0, 1e-3]),
                reduction=rng.choice(["mean", "sum", "none"]), softcap=rng.choice([None, None, 2.0, 30.0]),
                return_z_loss=rng.random() < 0.3, use_token_scaling=rng.random() < 0.3)
    if rng.random() < 0.5:
        opts.update(return_token_accuracy=rng.random() < 0.6, return_predicted_tokens=rng.random() < 0.6)
    upstream = torch.randn(N, generator=g)
    weight = class_weights(V, g)
    desc = f"fused_linear_cross_entropy N={N} H={H} V={V} {str(dtype)[6:]} bias={b is not None} {opts} " \
           f"class_weights={weight is not None}"

    def run(module):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        bb = None if b is None else b.clone().requires_grad_()
        loss, outputs = with_extras(module(ww, hh, targets, bb))
        (loss * upstream).sum().backward() if opts["reduction"] == "none" else loss.backward()
        out = [("loss", loss.detach().float()), ("grad_hidden", hh.grad.float()), ("grad_weight", ww.grad.float())]
        return out + ([("grad_bias", bb.grad.float())] if bb is not None else []) + outputs

    ours, theirs = both(lambda: run(ft.FusedLinearCrossEntropyLoss(weight, **opts)),
                        lambda: run(LigerFusedLinearCrossEntropyLoss(weight, **opts)))
    ce_opts = dict(opts, ignore_index=-100)

    def reference(dtype):
        def module(ww, hh, t, bb):
            logits = hh.to(dtype) @ ww.to(dtype).T + (0 if bb is None else bb.to(dtype))
            loss = ce_reference(logits, t, ce_opts, dtype, weight)
            z_loss = z_loss_reference(logits, t, ce_opts) if opts["return_z_loss"] else None
            return SimpleNamespace(loss=loss, z_loss=z_loss, token_accuracy=None, predicted_tokens=None)
        return dict(run(module))

    results = compare(ours, theirs, tol, dtype, exact=reference(torch.float64), torch32=reference(torch.float32))
    logits64 = capped(h.double() @ w.double().T + (0 if b is None else b.double()), ce_opts)
    tie = 1e-2 if dtype == torch.bfloat16 else 1e-5  # Liger's logits are in the inputs' dtype
    return desc, results + compare_tokens(ours, theirs, logits64, targets, ce_opts, tie)


def compare(ours, theirs, tol, dtype, f32_loss=False, exact=None, floors=None, torch32=None, perturbed=None):
    """[(name, error, gate)] or a refusal mismatch as one entry with an infinite error. bf16
    inputs: gradients are bf16 on both sides, and so are Liger's cross-entropy losses (ours are
    f32), so those are held to bf16's rounding; Liger's GRPO loss is f32 whatever the logits.
    ``floors``: a magnitude below which a value's error is not relative to itself.
    ``exact``: float64 values. An entry over its gate is not a failure when ours is within the
    gate of float64 and at least as close to it as Liger (within 1.5x: both round, as bf16
    gradients do), or, with ``torch32`` (PyTorch's or TRL's own operations in float32), when the value is
    ill-conditioned for float32 itself: that float32 misses float64 by a third of the gate or
    more and ours is within 3x of its miss. ``perturbed``: Liger's results on inputs moved by
    one ulp (called only for an entry over its gate): where those move by a third of the gate or
    more, and ours is within 3x of that move, the entry is ill-conditioned in float32 too."""
    if isinstance(theirs, Exception) or isinstance(ours, Exception):
        if isinstance(theirs, Exception) and isinstance(ours, Exception):
            return [("both refuse", 0.0, 1.0)]
        who = "Liger" if isinstance(theirs, Exception) else "ours"
        return [(f"only {who} refuses: {theirs if who == 'Liger' else ours!r}"[:300], float("inf"), 1.0)]
    want = dict(theirs)
    results = []
    for name, got in ours:
        if name.startswith("token:"):  # compared by `compare_tokens`
            continue
        if name not in want:
            results.append((f"{name}: Liger returns none", float("inf"), 1.0))
            continue
        rounded = name.startswith("grad") or not f32_loss
        gate = 1e-2 if dtype == torch.bfloat16 and rounded else tol
        key, floor = name, max(1e-6, (floors or {}).get(name, 0.0))
        e = rel(got.reshape(want[key].shape), want[key], floor)
        if e > gate and exact and key in exact:
            name, e = judged(name, e, gate, got, want[key], exact[key], (torch32 or {}).get(key), floor)
        if e > gate and perturbed is not None:
            moved = rel(dict(perturbed())[key].reshape(want[key].shape), want[key], floor)
            if moved >= gate / 3 and e <= 3 * moved:
                name, e = f"{key} (ill-conditioned in float32: Liger moves by {moved:.2g} for one ulp of its inputs)", 0.0
        results.append((name, e, gate))
    missing = {n for n in want if not n.startswith("token:")} - {n for n, _ in ours}
    results += [(f"{n}: ours returns none", float("inf"), 1.0) for n in missing]
    return results


def judged(name, e, gate, got, want, exact, peer32, floor):
    """(name, error) of an entry over its gate, renamed, and cleared where float64 says whose
    rounding it is (see `compare`)."""
    ours_exact = rel(got.reshape(exact.shape), exact, floor)
    liger_exact = rel(want.reshape(exact.shape), exact, floor)
    if ours_exact <= gate and ours_exact <= 1.5 * liger_exact:
        return f"{name} (Liger's rounding; from float64: ours {ours_exact:.2g}, Liger {liger_exact:.2g})", 0.0
    torch_exact = None if peer32 is None else rel(peer32.reshape(exact.shape), exact, floor)
    if torch_exact is not None and torch_exact >= gate / 3 and ours_exact <= 3 * torch_exact:
        return (f"{name} (ill-conditioned in float32; from float64: ours {ours_exact:.2g}, Liger {liger_exact:.2g}, "
                f"float32 peer {torch_exact:.2g})"), 0.0
    peer = "" if torch_exact is None else f", float32 peer {torch_exact:.2g}"
    return f"{name} (from float64: ours {ours_exact:.2g}, Liger {liger_exact:.2g}{peer})", e


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cases", type=int, default=200)
    p.add_argument("--tol", type=float, default=2e-5)
    p.add_argument("--only", choices=["grpo", "ce", "flce", "logprob"])
    p.add_argument("--class-weights", action="store_true", help="every cross-entropy case with per-class weights")
    args = p.parse_args()
    CLASS_WEIGHTS[0] = args.class_weights
    rng, g = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    kinds = {"grpo": grpo_case, "ce": ce_case, "flce": flce_case, "logprob": logprob_case}
    checks, refusals, failures, worst, liger_rounding = 0, 0, [], {}, []
    for case_no in range(args.cases):
        kind = args.only or rng.choice(["grpo", "grpo", "ce", "flce"])
        desc, results = kinds[kind](rng, g, args.tol)
        for name, e, gate in results:
            if name == "both refuse":
                refusals += 1
                continue
            checks += 1
            if "Liger's rounding" in name or "ill-conditioned" in name:
                liger_rounding.append(f"#{case_no} {desc}: {name}")
                continue
            key = f"{kind} {name.split(' (')[0]}"
            worst[key] = max(worst.get(key, 0.0), e / gate)
            if not e <= gate:
                failures.append(f"#{case_no} {desc}: {name} {e:.3g} > {gate:.1g}")
    print(f"{checks} checks, {refusals} cases refused by both, {len(liger_rounding)} over the gate against Liger but "
          f"not failures (Liger's rounding, or ill-conditioned in float32: below), {len(failures)} failures")
    for r in liger_rounding:
        print("JUDGED", r)
    print("worst error / gate: " + ", ".join(f"{k} {v:.3g}" for k, v in sorted(worst.items()) if v != float("inf")))
    for f in failures:
        print("FAIL", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

"""Cross-check `flashgrpo loss` against code no one here wrote.

- Cross-entropy against `torch.nn.functional.cross_entropy` in float64 (label smoothing,
  ignore_index, reductions, masks; z-loss as `+ z * logsumexp^2` on top of it).
- GRPO against Liger-Kernel's `LigerFusedLinearGRPOLoss` with weight = identity (so hidden =
  logits), over the loss types, importance-sampling levels and options it supports, and against
  a TRL-style float64 autograd implementation (TRL's `_compute_loss`) for the per-token outputs
  and the options Liger lacks (entropy bonus, sequence-level cispo/sapo).
- logprob / entropy against `log_softmax` / `gather` / `-sum p log p` with autograd.
- Fused-linear (`hidden`, `weight`, `bias` in; `grad_hidden`, `grad_weight`, `grad_bias` out):
  GRPO against `LigerFusedLinearGRPOLoss` on a real lm_head and against TRL-style float64
  autograd on the materialised `hidden @ weight.T + bias`; cross-entropy against float64
  `F.cross_entropy` on the materialised logits; bf16 / f16 fused-linear GRPO, every bf16 way,
  against float64 autograd at the precision of the gradients it hands back.

Usage: python crosscheck.py --bin PATH/TO/flashgrpo [--quick]
Exits non-zero, listing every mismatch, if any check fails.
"""

import argparse
import itertools
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F
from loss_cli import CHECKS, FAILURES, close, close_norm, run_loss  # noqa: F401 (shared helpers)

torch.manual_seed(0)
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def as_dtype(x, dtype):
    return x.to(DTYPES[dtype])


def grad_tol(dtype):
    """Relative-norm tolerance of a gradient handed back in `dtype`: about ten times the error
    of rounding the exact gradient once (bf16 8 bits, f16 11; f16's subnormals below 6e-5 cost
    more where the vocabulary is large)."""
    return {"f32": 1e-5, "bf16": 1e-2, "f16": 1e-3}[dtype]


# ---------------------------------------------------------------- cross-entropy vs torch


def check_cross_entropy(binary, quick):
    shapes = [(2, 7, 33), (1, 1, 2), (3, 5, 1000)]
    grid = itertools.product(shapes, [0.0, 0.1], [-100, 5], ["mean", "sum", "none"], ["f32", "bf16"], [False, True])
    for (B, T, V), s, ii, red, dtype, use_mask in grid:
        if quick and (B, T, V) == (3, 5, 1000) and dtype == "bf16":
            continue
        logits = as_dtype(torch.randn(B, T, V) * 2.5, dtype)
        targets = torch.randint(0, V, (B, T))
        targets[torch.rand(B, T) < 0.25] = ii
        targets[0, 0] = 0  # at least one row counts
        mask = (torch.rand(B, T) > 0.3).to(torch.uint8) if use_mask else None
        if mask is not None:
            mask[0, 0] = 1
        case = f"cross_entropy B={B} T={T} V={V} s={s} ignore={ii} {red} {dtype} mask={use_mask}"
        out = run_loss(binary, "cross_entropy", {"logits": logits, "targets": targets, "mask": mask},
                       {"label_smoothing": s, "ignore_index": ii, "reduction": red})
        x = logits.double().reshape(-1, V).requires_grad_(True)
        y = targets.reshape(-1).clone()
        if mask is not None:
            y[mask.reshape(-1) == 0] = ii  # torch has no mask: a masked row is an ignored row
        ref = F.cross_entropy(x, y, ignore_index=ii, label_smoothing=s, reduction=red)
        per_token = F.cross_entropy(x.detach(), y, ignore_index=ii, label_smoothing=s, reduction="none")
        loss = ref.sum() if red == "none" else ref
        loss.backward()
        close(case, "loss", out["loss"], loss.detach(), 1e-5)
        close(case, "per_token_loss", out["per_token_loss"], per_token.reshape(B, T), 1e-5)
        close_norm(case, "grad_logits", out["grad_logits"], x.grad.reshape(B, T, V), grad_tol(dtype))
        counted = (y != ii).reshape(B, T)
        logp = torch.log_softmax(x.detach(), -1).gather(-1, y.clamp(min=0)[:, None]).reshape(B, T)
        close(case, "logp", out["logp"], logp, 1e-5, counted)

    # z-loss and temperature on top of torch's cross-entropy.
    for z, temp in [(1e-3, 1.0), (1e-4, 0.7)]:
        B, T, V = 2, 6, 300
        logits = torch.randn(B, T, V) * 3
        targets = torch.randint(0, V, (B, T))
        case = f"cross_entropy z_loss={z} temperature={temp}"
        out = run_loss(binary, "cross_entropy", {"logits": logits, "targets": targets},
                       {"z_loss": z, "temperature": temp, "label_smoothing": 0.1})
        x = logits.double().reshape(-1, V).requires_grad_(True)
        u = x / temp
        per = F.cross_entropy(u, targets.reshape(-1), label_smoothing=0.1, reduction="none") + z * torch.logsumexp(u, -1) ** 2
        loss = per.mean()
        loss.backward()
        close(case, "loss", out["loss"], loss.detach(), 1e-5)
        close(case, "per_token_loss", out["per_token_loss"], per.detach().reshape(B, T), 1e-5)
        close_norm(case, "grad_logits", out["grad_logits"], x.grad.reshape(B, T, V), 1e-5)


# ---------------------------------------------------------------- GRPO vs Liger and TRL


def trl_grpo(logits, targets, mask, adv, old, ref, is_ratio, o, upstream=None, dtype=torch.float64):
    """TRL's GRPOTrainer._compute_loss in ``dtype`` autograd (float64 by default), with LOSSES.md's
    entropy bonus (per token, inside the reduction) and per-token outputs. With ``upstream [B, T]``,
    ``grad`` is that of ``sum(upstream * mask * per_token_loss)`` instead of the loss's (Liger's
    per-token loss, back-propagated with a per-token upstream gradient)."""
    B, T, V = logits.shape
    x = logits.to(dtype).requires_grad_(True)
    u = x / o["temperature"]
    logsm = torch.log_softmax(u, -1)
    logp = logsm.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    m = mask.to(dtype)
    old_ = logp.detach() if old is None else old.to(dtype)
    log_ratio = logp - old_
    if o["importance_sampling_level"] == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    A = adv.to(dtype).unsqueeze(1)
    lo, hi = 1 - o["epsilon_low"], 1 + o["epsilon_high"]
    lt = o["loss_type"]
    if lt == "cispo":
        per = -torch.clamp(coef_1, max=o["epsilon_high"]).detach() * A * logp
        clipped = (coef_1 > o["epsilon_high"]) & (A > 0)
    elif lt == "sapo":
        tau = torch.where(A > 0, o["sapo_temperature_pos"], o["sapo_temperature_neg"])
        per = -(torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau) * A
        clipped = ((coef_1 < lo) & (A < 0)) | ((coef_1 > hi) & (A > 0))
    else:
        coef_2 = torch.clamp(coef_1, lo, hi)
        c1 = torch.clamp(coef_1, max=o["delta"]) if o["delta"] is not None else coef_1
        per = -torch.min(c1 * A, coef_2 * A)
        clipped = ((coef_1 < lo) & (A < 0)) | ((coef_1 > hi) & (A > 0))
    per = per.expand(B, T)
    if is_ratio is not None:
        per = per * (is_ratio.to(dtype) if is_ratio.dim() == 2 else is_ratio.to(dtype).unsqueeze(1))
    kl = torch.zeros(B, T, dtype=dtype)
    if ref is not None:
        kl = torch.exp(ref.to(dtype) - logp) - (ref.to(dtype) - logp) - 1
        if o["use_bias_correction_kl"]:
            kl = kl * coef_1
        if o["beta"] != 0:
            per = per + o["beta"] * kl
    per = per - o["entropy_coef"] * entropy
    if lt in ("grpo", "sapo"):
        loss = ((per * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    elif lt == "bnpo":
        loss = (per * m).sum() / m.sum().clamp(min=1.0)
    elif lt == "dr_grpo":
        loss = (per * m).sum() / (B * (o["max_completion_length"] or T))
    else:
        n = o["num_items"] if o["num_items"] is not None else m.sum()
        loss = (per * m).sum() / torch.clamp(torch.as_tensor(n, dtype=dtype), min=1.0)
    (loss if upstream is None else (per * m * upstream.to(dtype)).sum()).backward()
    return dict(loss=loss.detach(), per_token_loss=per.detach(), logp=logp.detach(), entropy=entropy.detach(),
                kl=kl.detach().expand(B, T), is_clipped=clipped.expand(B, T).to(dtype), grad=x.grad)


def liger_grpo(logits, targets, mask, adv, old, ref, is_ratio, o):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    B, T, V = logits.shape
    h = logits.double().clone().requires_grad_(True)
    W = torch.eye(V, dtype=torch.float64)
    mod = LigerFusedLinearGRPOLoss(
        beta=o["beta"], compiled=False, use_ref_model=ref is not None, chunk_size=1,
        epsilon_low=o["epsilon_low"], epsilon_high=o["epsilon_high"], loss_type=o["loss_type"],
        max_completion_length=o["max_completion_length"] or T,
        importance_sampling_level=o["importance_sampling_level"],
        sapo_temperature_pos=o["sapo_temperature_pos"], sapo_temperature_neg=o["sapo_temperature_neg"],
        temperature=o["temperature"], delta=o["delta"], use_bias_correction_kl=o["use_bias_correction_kl"])
    out = mod(h, W, targets, mask.double(), adv.double(),
              ref_per_token_logps=None if ref is None else ref.double(),
              old_per_token_logps=None if old is None else old.double(),
              vllm_is_ratio=None if is_ratio is None else is_ratio.double(),
              num_items_in_batch=o["num_items"])
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return loss.detach(), h.grad


def grpo_options(**kw):
    o = dict(temperature=1.0, epsilon_low=0.2, epsilon_high=0.28, delta=None, beta=0.04, loss_type="dapo",
             importance_sampling_level="token", entropy_coef=0.0, use_bias_correction_kl=False,
             max_completion_length=None, num_items=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05)
    o.update(kw)
    return o


def check_grpo(binary, quick):
    cases = []
    for lt, level in itertools.product(["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"], ["token", "sequence"]):
        eps_high = 1.2 if lt == "cispo" else 0.28
        cases.append(grpo_options(loss_type=lt, importance_sampling_level=level, epsilon_high=eps_high))
        cases.append(grpo_options(loss_type=lt, importance_sampling_level=level, epsilon_high=eps_high,
                                  use_bias_correction_kl=True, temperature=0.8, entropy_coef=0.01))
    cases += [
        grpo_options(delta=1.25),
        grpo_options(beta=0.0),
        grpo_options(num_items=17.0),
        grpo_options(loss_type="dr_grpo", max_completion_length=32),
        grpo_options(loss_type="sapo", sapo_temperature_pos=2.0, sapo_temperature_neg=0.5),
        grpo_options(loss_type="grpo", epsilon_low=0.1, epsilon_high=0.1, entropy_coef=0.05),
    ]
    shapes = [(3, 6, 48), (2, 9, 130)]
    for i, o in enumerate(cases):
        for (B, T, V), dtype, policy, isr in itertools.product(shapes, ["f32", "bf16"], ["off", "on"], [None, "token", "seq"]):
            if quick and (dtype, isr) != ("f32", None) and (i + len(policy)) % 3:
                continue
            if (dtype, isr) != ("f32", None) and (B, T, V) == (2, 9, 130):
                continue
            logits = as_dtype(torch.randn(B, T, V) * 2.5, dtype)
            targets = torch.randint(0, V, (B, T))
            mask = (torch.rand(B, T) > 0.25).float()
            mask[:, 0] = 1
            adv = torch.randn(B)
            true_logp = torch.log_softmax(logits.double() / o["temperature"], -1).gather(-1, targets[..., None]).squeeze(-1)
            old = (true_logp + 0.3 * torch.randn(B, T)).float() if policy == "off" else None
            ref = (true_logp + 0.3 * torch.randn(B, T)).float() if o["beta"] != 0 else None
            is_ratio = None if isr is None else (0.5 + torch.rand(B, T) if isr == "token" else 0.5 + torch.rand(B))
            case = f"grpo {o} B={B} T={T} V={V} {dtype} {policy}-policy is_ratio={isr}"
            sets = {k: v for k, v in o.items() if v is not None}
            out = run_loss(binary, "grpo", {"logits": logits, "targets": targets, "mask": mask, "advantages": adv,
                                            "old_logp": old, "ref_logp": ref, "is_ratio": is_ratio}, sets)
            want = trl_grpo(logits, targets, mask, adv, old, ref, is_ratio, o)
            close(case, "loss (TRL-style)", out["loss"], want["loss"], 1e-5)
            for name in ["per_token_loss", "logp", "entropy", "kl", "is_clipped"]:
                close(case, f"{name} (TRL-style)", out[name], want[name], 1e-5, mask)
            close_norm(case, "grad_logits (TRL-style)", out["grad_logits"], want["grad"], grad_tol(dtype))
            liger_supports = o["entropy_coef"] == 0 and not (
                o["importance_sampling_level"] == "sequence" and o["loss_type"] in ("cispo", "sapo"))
            if liger_supports:
                loss, grad = liger_grpo(logits, targets, mask, adv, old, ref, is_ratio, o)
                # Liger computes the log-softmax in float32: compare at float32's precision.
                close(case, "loss (Liger)", out["loss"], loss, 2e-5)
                close_norm(case, "grad_logits (Liger)", out["grad_logits"], grad, max(grad_tol(dtype), 2e-5))


# ---------------------------------------------------------------- logprob and entropy


def check_logprob_entropy(binary):
    for (B, T, V), temp, dtype in itertools.product([(2, 5, 40), (1, 3, 3000)], [1.0, 0.6], ["f32", "bf16"]):
        logits = as_dtype(torch.randn(B, T, V) * 2.5, dtype)
        targets = torch.randint(0, V, (B, T))
        mask = (torch.rand(B, T) > 0.2).to(torch.bool)
        case = f"logprob/entropy B={B} T={T} V={V} temperature={temp} {dtype}"
        x = logits.double().requires_grad_(True)
        logsm = torch.log_softmax(x / temp, -1)
        logp = logsm.gather(-1, targets[..., None]).squeeze(-1)
        entropy = -(logsm.exp() * logsm).sum(-1)
        (logp * mask.double()).sum().backward()
        out = run_loss(binary, "logprob", {"logits": logits, "targets": targets, "mask": mask}, {"temperature": temp})
        close(case, "logp", out["logp"], logp.detach(), 1e-5, mask)
        close(case, "loss = sum(mask * logp)", out["loss"], (logp * mask.double()).sum().detach(), 1e-5)
        close_norm(case, "grad_logits", out["grad_logits"], x.grad, grad_tol(dtype))
        out = run_loss(binary, "entropy", {"logits": logits, "mask": mask}, {"temperature": temp})
        close(case, "entropy", out["entropy"], entropy.detach(), 1e-5, mask)
        close(case, "loss = masked mean entropy", out["loss"], entropy[mask].mean().detach(), 1e-5)


# ---------------------------------------------------------------- fused-linear


def linear_inputs(B, T, H, V, with_bias):
    hidden = torch.randn(B, T, H)
    weight = torch.randn(V, H) * (2.0 / H**0.5)
    bias = torch.randn(V) * 0.5 if with_bias else None
    return hidden, weight, bias


def materialised(hidden, weight, bias):
    """float64 logits [B, T, V] with autograd to hidden, weight, bias."""
    h = hidden.double().requires_grad_(True)
    w = weight.double().requires_grad_(True)
    b = bias.double().requires_grad_(True) if bias is not None else None
    logits = h @ w.T + (b if b is not None else 0.0)
    return h, w, b, logits


def check_linear(binary, quick):
    # GRPO: Liger's chunked fused-linear loss and TRL-style float64 autograd.
    for lt, level, with_bias in [("dapo", "token", False), ("grpo", "sequence", True), ("bnpo", "token", True),
                                 ("dr_grpo", "sequence", False), ("cispo", "token", True), ("sapo", "token", False)]:
        B, T, H, V = 3, 5, 24, 70
        o = grpo_options(loss_type=lt, importance_sampling_level=level,
                         epsilon_high=1.2 if lt == "cispo" else 0.28, temperature=0.9)
        hidden, weight, bias = linear_inputs(B, T, H, V, with_bias)
        targets = torch.randint(0, V, (B, T))
        mask = (torch.rand(B, T) > 0.25).float()
        mask[:, 0] = 1
        adv = torch.randn(B)
        with torch.no_grad():
            base = torch.log_softmax(materialised(hidden, weight, bias)[3] / o["temperature"], -1)
            true_logp = base.gather(-1, targets[..., None]).squeeze(-1)
        old = (true_logp + 0.3 * torch.randn(B, T)).float()
        ref = (true_logp + 0.3 * torch.randn(B, T)).float()
        case = f"linear grpo {lt} {level} bias={with_bias}"
        inputs = {"hidden": hidden, "weight": weight, "bias": bias, "targets": targets, "mask": mask,
                  "advantages": adv, "old_logp": old, "ref_logp": ref}
        out = run_loss(binary, "grpo", inputs, {k: v for k, v in o.items() if v is not None} | {"chunk_memory_mb": 1})
        # TRL-style on the materialised logits (float64 autograd through the linear layer).
        h, w, b, logits = materialised(hidden, weight, bias)
        want = trl_grpo(logits.detach(), targets, mask, adv, old, ref, None, o)
        logits.backward(want["grad"])
        close(case, "loss (TRL-style)", out["loss"], want["loss"], 1e-4)
        close(case, "per_token_loss (TRL-style)", out["per_token_loss"], want["per_token_loss"], 1e-4, mask)
        close_norm(case, "grad_hidden (TRL-style)", out["grad_hidden"], h.grad, 1e-4)
        close_norm(case, "grad_weight (TRL-style)", out["grad_weight"], w.grad, 1e-4)
        if with_bias:
            close_norm(case, "grad_bias (TRL-style)", out["grad_bias"], b.grad, 1e-4)
        if not (level == "sequence" and lt in ("cispo", "sapo")):
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

            lh = hidden.clone().requires_grad_(True)
            lw = weight.clone().requires_grad_(True)
            lb = bias.clone().requires_grad_(True) if bias is not None else None
            mod = LigerFusedLinearGRPOLoss(
                beta=o["beta"], compiled=False, use_ref_model=True, chunk_size=1, epsilon_low=o["epsilon_low"],
                epsilon_high=o["epsilon_high"], loss_type=lt, max_completion_length=T,
                importance_sampling_level=level, temperature=o["temperature"])
            res = mod(lh, lw, targets, mask, adv, bias=lb, ref_per_token_logps=ref, old_per_token_logps=old)
            loss = res[0] if isinstance(res, tuple) else res
            loss.backward()
            close(case, "loss (Liger)", out["loss"], loss.detach(), 2e-5)
            close_norm(case, "grad_hidden (Liger)", out["grad_hidden"], lh.grad, 1e-4)
            close_norm(case, "grad_weight (Liger)", out["grad_weight"], lw.grad, 1e-4)
            if with_bias:
                close_norm(case, "grad_bias (Liger)", out["grad_bias"], lb.grad, 1e-4)
    # Cross-entropy: float64 F.cross_entropy on the materialised logits.
    for s, red, with_bias in [(0.0, "mean", True), (0.1, "sum", False), (0.05, "none", True)]:
        B, T, H, V = 2, 7, 16, 90
        hidden, weight, bias = linear_inputs(B, T, H, V, with_bias)
        targets = torch.randint(0, V, (B, T))
        targets[0, 1] = -100
        out = run_loss(binary, "cross_entropy", {"hidden": hidden, "weight": weight, "bias": bias, "targets": targets},
                       {"label_smoothing": s, "reduction": red, "chunk_memory_mb": 1})
        h, w, b, logits = materialised(hidden, weight, bias)
        ref = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), label_smoothing=s, reduction=red)
        loss = ref.sum() if red == "none" else ref
        loss.backward()
        case = f"linear cross_entropy s={s} {red} bias={with_bias}"
        close(case, "loss", out["loss"], loss.detach(), 1e-4)
        close_norm(case, "grad_hidden", out["grad_hidden"], h.grad, 1e-4)
        close_norm(case, "grad_weight", out["grad_weight"], w.grad, 1e-4)
        if with_bias:
            close_norm(case, "grad_bias", out["grad_bias"], b.grad, 1e-4)


def check_linear_low_precision(binary):
    """bf16 / f16 fused-linear through `flashgrpo loss`, which hands the gradients back in the
    inputs' dtype: f32-grade products (`auto`, `widened`, and f16's) must be as close to float64
    autograd as rounding the exact gradient to that dtype alone (within 1.5x, + 1e-4); the
    `rounded` way (bf16's default here, where the machine has it) within LOSSES.md's bf16 gradient
    tolerance (1e-2)."""
    to = {"bf16": torch.bfloat16, "f16": torch.float16}
    for (B, T, H, V, with_bias), dtype in itertools.product([(2, 9, 40, 300, True), (1, 5, 96, 2049, False)], ["bf16", "f16"]):
        o = grpo_options(loss_type="dapo" if with_bias else "grpo", importance_sampling_level="token" if with_bias else "sequence",
                         temperature=0.9)
        hidden, weight, bias = (x.to(to[dtype]) if x is not None else None for x in linear_inputs(B, T, H, V, with_bias))
        targets = torch.randint(0, V, (B, T))
        mask = (torch.rand(B, T) > 0.25).float()
        mask[:, 0] = 1
        adv = torch.randn(B)
        h, w, b, logits = materialised(hidden, weight, bias)
        with torch.no_grad():
            true_logp = torch.log_softmax(logits / o["temperature"], -1).gather(-1, targets[..., None]).squeeze(-1)
        old = (true_logp + 0.3 * torch.randn(B, T)).float()
        ref = (true_logp + 0.3 * torch.randn(B, T)).float()
        want = trl_grpo(logits.detach(), targets, mask, adv, old, ref, None, o)
        logits.backward(want["grad"])
        exact = {"grad_hidden": h.grad, "grad_weight": w.grad, "grad_bias": b.grad if b is not None else None}
        inputs = {"hidden": hidden, "weight": weight, "bias": bias, "targets": targets, "mask": mask,
                  "advantages": adv, "old_logp": old, "ref_logp": ref}
        for way in [None, "auto", "widened", "rounded"] if dtype == "bf16" else [None]:
            case = f"linear grpo {dtype} B={B} T={T} H={H} V={V} bias={with_bias} bf16_products={way}"
            sets = {k: v for k, v in o.items() if v is not None} | {"chunk_memory_mb": 1}
            if way is not None:
                sets["bf16_products"] = way
            try:
                out = run_loss(binary, "grpo", inputs, sets)
            except RuntimeError as e:
                if way == "rounded" and "is not a way this machine has" in str(e):
                    continue  # a CPU with neither AMX nor AVX512-BF16
                raise
            close(case, "loss (TRL-style)", out["loss"], want["loss"], 1e-4)
            close(case, "per_token_loss (TRL-style)", out["per_token_loss"], want["per_token_loss"], 1e-4, mask)
            for name, g in exact.items():
                if g is None:
                    continue
                rounding_alone = ((g.to(to[dtype]).double() - g).norm() / g.norm()).item()
                rounded = way == "rounded" or (way is None and dtype == "bf16")
                tol = 1e-2 if rounded and name != "grad_bias" else 1.5 * rounding_alone + 1e-4
                close_norm(case, f"{name} (TRL-style)", out[name], g, tol)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    p.add_argument("--quick", action="store_true", help="a subset of the GRPO and cross-entropy grids")
    args = p.parse_args()
    torch.set_num_threads(1)
    check_cross_entropy(args.bin, args.quick)
    check_logprob_entropy(args.bin)
    check_grpo(args.bin, args.quick)
    check_linear(args.bin, args.quick)
    check_linear_low_precision(args.bin)
    print(f"{CHECKS[0]} checks, {len(FAILURES)} failures")
    for f in FAILURES[:50]:
        print("FAIL", f)
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()

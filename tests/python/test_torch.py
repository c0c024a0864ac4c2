"""flashgrpo.torch against independent references, on random inputs of several shapes:
TRL-style float64 autograd (tests/peers/crosscheck.py's `trl_grpo`), `F.cross_entropy`,
`log_softmax`, materialised float64 logits for the fused-linear forms, and Liger-Kernel's own
`LigerFusedLinearGRPOLoss` for the drop-in module. Also: the gradient written over the logits
(`in_place`) and errors that name the bad input. Prints "N checks, 0 failures" and exits 0."""

import functools
import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peers"))

import flashgrpo.torch as ft  # noqa: E402
from crosscheck import as_dtype, grad_tol, grpo_options, linear_inputs, materialised, trl_grpo  # noqa: E402
from loss_cli import CHECKS, FAILURES, close, close_norm, expect_error, fail, report  # noqa: E402

torch.manual_seed(0)


def kernel_options(o):
    """crosscheck's option dict as LOSSES.md keyword arguments."""
    skip = {"num_items"}
    out = {k: v for k, v in o.items() if k not in skip and v is not None}
    if o["num_items"] is not None:
        out["num_items"] = o["num_items"]
    return out


def grpo_case(B, T, V, dtype, o, policy, isr):
    logits = as_dtype(torch.randn(B, T, V) * 2.5, dtype)
    targets = torch.randint(0, V, (B, T))
    mask = (torch.rand(B, T) > 0.25).float()
    mask[:, 0] = 1
    adv = torch.randn(B)
    true_logp = torch.log_softmax(logits.double() / o["temperature"], -1).gather(-1, targets[..., None]).squeeze(-1)
    old = (true_logp + 0.3 * torch.randn(B, T)).float() if policy == "off" else None
    ref = (true_logp + 0.3 * torch.randn(B, T)).float() if o["beta"] != 0 else None
    is_ratio = None if isr is None else (0.5 + torch.rand(B, T) if isr == "token" else 0.5 + torch.rand(B))
    return logits, targets, mask, adv, old, ref, is_ratio


def check_grpo():
    cases = []
    for lt, level in itertools.product(["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"], ["token", "sequence"]):
        cases.append(grpo_options(loss_type=lt, importance_sampling_level=level,
                                  epsilon_high=1.2 if lt == "cispo" else 0.28, temperature=0.8, entropy_coef=0.01,
                                  use_bias_correction_kl=lt == "dapo"))
    cases += [grpo_options(delta=1.25), grpo_options(beta=0.0), grpo_options(num_items=17.0),
              grpo_options(loss_type="dr_grpo", max_completion_length=32)]
    shapes = [(3, 6, 48), (2, 9, 131), (1, 4, 1000)]
    for i, o in enumerate(cases):
        B, T, V = shapes[i % len(shapes)]
        for dtype, policy, isr, in_place in [("f32", "off", None, False), ("bf16", "on", "token", True),
                                             ("f32", "off", "seq", True), ("f16", "off", None, False)]:
            logits, targets, mask, adv, old, ref, is_ratio = grpo_case(B, T, V, dtype, o, policy, isr)
            case = f"torch grpo {o['loss_type']} {o['importance_sampling_level']} B={B} T={T} V={V} {dtype} " \
                   f"{policy}-policy is_ratio={isr} in_place={in_place}"
            want = trl_grpo(logits, targets, mask, adv, old, ref, is_ratio, o)
            x = logits.clone().requires_grad_(True)
            try:
                out = ft.grpo_loss(x, targets, adv, mask, old_logp=old, ref_logp=ref, is_ratio=is_ratio,
                                   in_place=in_place, **kernel_options(o))
                out.loss.backward()
            except Exception as e:  # noqa: BLE001
                fail(case, f"raised {e!r}")
                continue
            close(case, "loss", out.loss, want["loss"], 1e-5)
            for name in ["per_token_loss", "logp", "entropy", "kl", "is_clipped"]:
                got = getattr(out, name)
                if got is None:
                    if name != "kl" or ref is not None:
                        fail(case, f"{name} missing")
                    continue
                close(case, name, got, want[name], 1e-5, mask)
            close_norm(case, "grad_logits", x.grad, want["grad"], grad_tol(dtype))
            CHECKS[0] += 1
            if x.grad.dtype != logits.dtype:
                FAILURES.append(f"{case}: grad dtype {x.grad.dtype}")


def check_in_place_and_no_copy():
    """`in_place=True` writes the gradient over the logits' own memory (the logits tensor the
    caller holds is the gradient afterwards), and no gradient buffer is allocated."""
    B, T, V = 2, 5, 300
    logits = torch.randn(B, T, V)
    targets = torch.randint(0, V, (B, T))
    adv = torch.randn(B)
    x = logits.clone().requires_grad_(True)
    address = x.data_ptr()
    out = ft.grpo_loss(x, targets, adv, in_place=True, beta=0.0)
    out.loss.backward()
    case = "torch grpo in_place"
    CHECKS[0] += 1
    if x.grad.data_ptr() != address:
        FAILURES.append(f"{case}: the gradient is not the logits' memory")
    want = trl_grpo(logits, targets, torch.ones(B, T), adv, None, None, None, grpo_options(beta=0.0))
    close_norm(case, "grad", x.grad, want["grad"], 1e-5)
    # The caller's logits tensor now holds the gradient: the kernels wrote to its memory.
    close_norm(case, "logits overwritten by the gradient", x.detach(), want["grad"], 1e-5)


def check_reused_gradient_buffers():
    """Large gradients come from buffers that return to the native module when PyTorch frees
    them: correct values in every dtype, and the second step's gradient in the first's memory."""
    for dtype in ["f32", "bf16", "f16"]:
        B, T, V = 2, 4, 70000  # > 1 MiB of gradient in every dtype
        logits = as_dtype(torch.randn(B, T, V) * 2, dtype)
        targets = torch.randint(0, V, (B, T))
        r = logits.double().requires_grad_(True)
        F.cross_entropy(r.reshape(-1, V), targets.reshape(-1)).backward()
        addresses = []
        for step in range(2):
            x = logits.clone().requires_grad_(True)
            ft.cross_entropy(x, targets).backward()
            close_norm(f"reused gradient buffer {dtype} step {step}", "grad", x.grad, r.grad, grad_tol(dtype))
            addresses.append(x.grad.data_ptr())
            del x
        CHECKS[0] += 1
        if addresses[0] != addresses[1]:
            FAILURES.append(f"reused gradient buffer {dtype}: the second step's gradient is in new memory")


def check_cross_entropy():
    for (shape, V), dtype, red, s, z in itertools.product([((4, 7), 61), ((13,), 1000)], ["f32", "bf16"],
                                                          ["mean", "sum", "none"], [0.0, 0.1], [0.0, 1e-3]):
        logits = as_dtype(torch.randn(*shape, V) * 2, dtype)
        targets = torch.randint(0, V, shape)
        targets.view(-1)[1] = -100
        case = f"torch cross_entropy {list(shape)} V={V} {dtype} {red} s={s} z={z}"
        x = logits.clone().requires_grad_(True)
        got = ft.cross_entropy(x, targets, reduction=red, label_smoothing=s, z_loss=z)
        upstream = torch.rand(shape) if red == "none" else torch.tensor(1.7)
        (got * upstream).sum().backward()
        r = logits.double().requires_grad_(True)
        flat = r.reshape(-1, V)
        per = F.cross_entropy(flat, targets.reshape(-1), label_smoothing=s, reduction="none")
        lse = torch.logsumexp(flat, -1)
        valid = (targets.reshape(-1) != -100).double()
        per = (per + z * lse**2 * valid).reshape(shape)
        want = per if red == "none" else per.sum() / (valid.sum() if red == "mean" else 1.0)
        (want * upstream.double()).sum().backward()
        close(case, "loss", got.detach(), want.detach(), 1e-5)
        close_norm(case, "grad", x.grad, r.grad, grad_tol(dtype))


def check_logprob_entropy():
    for (B, T, V), temp, dtype in itertools.product([(2, 5, 40), (1, 3, 3001)], [1.0, 0.6], ["f32", "bf16"]):
        logits = as_dtype(torch.randn(B, T, V) * 2.5, dtype)
        targets = torch.randint(0, V, (B, T))
        case = f"torch logprob/entropy B={B} T={T} V={V} temperature={temp} {dtype}"
        r = logits.double().requires_grad_(True)
        logsm = torch.log_softmax(r / temp, -1)
        want_logp = logsm.gather(-1, targets[..., None]).squeeze(-1)
        want_entropy = -(logsm.exp() * logsm).sum(-1)
        upstream = torch.randn(B, T)
        (want_logp * upstream.double()).sum().backward()
        x = logits.clone().requires_grad_(True)
        logp = ft.logprob(x, targets, temperature=temp)
        (logp * upstream).sum().backward()
        close(case, "logp", logp.detach(), want_logp.detach(), 1e-5)
        close_norm(case, "grad (per-token upstream)", x.grad, r.grad, grad_tol(dtype))
        close(case, "entropy", ft.entropy(logits, temperature=temp), want_entropy.detach(), 1e-5)
        close(case, "entropy [N, V]", ft.entropy(logits.reshape(-1, V), temperature=temp),
              want_entropy.detach().reshape(-1), 1e-5)


def check_entropy_gradient():
    """``entropy`` and ``fused_linear_entropy`` differentiable per token (the kernels'
    ``entropy_gradient``) against float64 autograd of ``-sum p log p``, with a mask, a per-token
    upstream, a temperature and a soft cap; without a gradient wanted, the values alone."""
    for (B, T, V), temp, cap, dtype in [((2, 5, 40), 1.0, None, "f32"), ((1, 3, 3001), 0.7, None, "bf16"),
                                        ((2, 4, 97), 0.9, 3.0, "f32"), ((3, 2, 2049), 1.0, None, "f16")]:
        logits = as_dtype(torch.randn(B, T, V) * 2.5, dtype)
        mask = (torch.rand(B, T) > 0.3).float()
        upstream = torch.randn(B, T)
        r = logits.double().requires_grad_(True)
        u = r if cap is None else cap * torch.tanh(r / cap)
        logsm = torch.log_softmax(u / temp, -1)
        want = -(logsm.exp() * logsm).sum(-1) * mask.double()
        (want * upstream.double()).sum().backward()
        x = logits.clone().requires_grad_(True)
        got = ft.entropy(x, mask, temperature=temp, softcap=cap)
        (got * upstream).sum().backward()
        case = f"torch entropy gradient B={B} T={T} V={V} temperature={temp} softcap={cap} {dtype}"
        close(case, "entropy", got.detach(), want.detach(), 1e-5)
        close_norm(case, "grad (per-token upstream)", x.grad, r.grad, grad_tol(dtype))
        if x.grad.dtype != logits.dtype:
            fail(case, f"gradient dtype {x.grad.dtype}, expected {logits.dtype}")
        close(case, "entropy [N, V]", ft.entropy(logits.reshape(-1, V), mask.reshape(-1), temperature=temp,
                                                 softcap=cap), want.detach().reshape(-1), 1e-5)
    B, T, H, V = 3, 5, 24, 70
    for with_bias, temp in [(True, 1.0), (False, 0.8)]:
        hidden, weight, bias = linear_inputs(B, T, H, V, with_bias)
        mask = (torch.rand(B, T) > 0.3).float()
        upstream = torch.randn(B, T)
        h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
        b64 = None if bias is None else bias.double().requires_grad_(True)
        logsm = torch.log_softmax((h64 @ w64.T + (0 if b64 is None else b64)) / temp, -1)
        want = -(logsm.exp() * logsm).sum(-1) * mask.double()
        (want * upstream.double()).sum().backward()
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        b = None if bias is None else bias.clone().requires_grad_(True)
        got = ft.fused_linear_entropy(h, w, bias=b, mask=mask, temperature=temp)
        (got * upstream).sum().backward()
        case = f"fused_linear_entropy gradient, per-token upstream, bias={with_bias}, temperature={temp}"
        close(case, "entropy", got.detach(), want.detach(), 1e-5)
        close_norm(case, "grad_hidden", h.grad, h64.grad, 1e-4)
        close_norm(case, "grad_weight", w.grad, w64.grad, 1e-4)
        if with_bias:
            close_norm(case, "grad_bias", b.grad, b64.grad, 1e-4)


def check_fused_linear():
    for lt, level, with_bias, dtype in [("dapo", "token", False, "f32"), ("grpo", "sequence", True, "f32"),
                                        ("bnpo", "token", True, "bf16"), ("cispo", "token", True, "f32"),
                                        ("sapo", "token", False, "f32")]:
        B, T, H, V = 3, 5, 24, 70
        o = grpo_options(loss_type=lt, importance_sampling_level=level,
                         epsilon_high=1.2 if lt == "cispo" else 0.28, temperature=0.9)
        hidden, weight, bias = linear_inputs(B, T, H, V, with_bias)
        hidden, weight = as_dtype(hidden, dtype), as_dtype(weight, dtype)
        bias = None if bias is None else as_dtype(bias, dtype)
        targets = torch.randint(0, V, (B, T))
        mask = (torch.rand(B, T) > 0.25).float()
        mask[:, 0] = 1
        adv = torch.randn(B)
        with torch.no_grad():
            base = torch.log_softmax(materialised(hidden, weight, bias)[3] / o["temperature"], -1)
            true_logp = base.gather(-1, targets[..., None]).squeeze(-1)
        old = (true_logp + 0.3 * torch.randn(B, T)).float()
        ref = (true_logp + 0.3 * torch.randn(B, T)).float()
        case = f"torch fused_linear_grpo {lt} {level} bias={with_bias} {dtype}"
        h, w, b, logits = materialised(hidden, weight, bias)
        want = trl_grpo(logits.detach(), targets, mask, adv, old, ref, None, o)
        logits.backward(want["grad"])
        xh, xw = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        xb = None if bias is None else bias.clone().requires_grad_(True)
        out = ft.fused_linear_grpo_loss(xh, xw, targets, adv, mask, bias=xb, old_logp=old, ref_logp=ref,
                                        chunk_memory_mb=1, **kernel_options(o))
        (out.loss * 0.5).backward()
        tol = 1e-4 if dtype == "f32" else 2e-2
        close(case, "loss", out.loss, want["loss"], tol)
        close(case, "per_token_loss", out.per_token_loss, want["per_token_loss"], tol, mask)
        close_norm(case, "grad_hidden", xh.grad, 0.5 * h.grad, tol)
        close_norm(case, "grad_weight", xw.grad, 0.5 * w.grad, tol)
        if with_bias:
            close_norm(case, "grad_bias", xb.grad, 0.5 * b.grad, tol)
        CHECKS[0] += 1
        if xh.grad.dtype != hidden.dtype or xw.grad.dtype != weight.dtype:
            FAILURES.append(f"{case}: gradient dtypes {xh.grad.dtype}, {xw.grad.dtype}")
    # A frozen lm_head: only the hidden states' gradient.
    hidden, weight, _ = linear_inputs(2, 3, 8, 50, False)
    xh = hidden.clone().requires_grad_(True)
    ft.fused_linear_grpo_loss(xh, weight, torch.randint(0, 50, (2, 3)), torch.randn(2)).loss.backward()
    CHECKS[0] += 1
    if xh.grad is None or weight.grad is not None:
        FAILURES.append("torch fused_linear_grpo frozen weight: wrong gradients")
    # Cross-entropy, log-probabilities and entropy against the materialised logits.
    for s, red, with_bias in [(0.0, "mean", True), (0.1, "sum", False), (0.05, "none", True)]:
        B, T, H, V = 2, 7, 16, 90
        hidden, weight, bias = linear_inputs(B, T, H, V, with_bias)
        targets = torch.randint(0, V, (B, T))
        targets[0, 1] = -100
        h, w, b, logits = materialised(hidden, weight, bias)
        ref = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), label_smoothing=s, reduction=red)
        ref.sum().backward()
        xh, xw = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        xb = None if bias is None else bias.clone().requires_grad_(True)
        got = ft.fused_linear_cross_entropy(xh, xw, targets, bias=xb, label_smoothing=s, reduction=red,
                                            chunk_memory_mb=1)
        got.sum().backward()
        case = f"torch fused_linear_cross_entropy s={s} {red} bias={with_bias}"
        close(case, "loss", got.detach().reshape(-1), ref.detach().reshape(-1), 1e-4)
        close_norm(case, "grad_hidden", xh.grad, h.grad, 1e-4)
        close_norm(case, "grad_weight", xw.grad, w.grad, 1e-4)
        if with_bias:
            close_norm(case, "grad_bias", xb.grad, b.grad, 1e-4)
    hidden, weight, bias = linear_inputs(2, 4, 12, 77, True)
    targets = torch.randint(0, 77, (2, 4))
    h, w, b, logits = materialised(hidden, weight, bias)
    logsm = torch.log_softmax(logits / 0.7, -1)
    want_logp = logsm.gather(-1, targets[..., None]).squeeze(-1)
    want_logp.sum().backward()
    xh = hidden.clone().requires_grad_(True)
    logp = ft.fused_linear_logprob(xh, weight, targets, bias=bias, temperature=0.7)
    logp.sum().backward()
    close("torch fused_linear_logprob", "logp", logp.detach(), want_logp.detach(), 1e-5)
    close_norm("torch fused_linear_logprob", "grad_hidden", xh.grad, h.grad, 1e-4)
    close("torch fused_linear_entropy", "entropy", ft.fused_linear_entropy(hidden, weight, bias=bias, temperature=0.7),
          -(logsm.exp() * logsm).sum(-1).detach(), 1e-5)


# The drop-in's cases against Liger: (loss type, level, beta, bias, use_ref_model, constructor
# extras, forward extras). `vllm_is_ratio` is built per token; `num_items_in_batch` is a count.
LIGER_CASES = [
    ("dapo", "token", 0.04, True, True, {}, {}),
    ("grpo", "sequence", 0.0, False, False, {}, {}),
    ("bnpo", "token", 0.1, False, True, {}, {}),
    ("dr_grpo", "token", 0.04, True, True, {}, {}),
    ("dapo", "token", 0.04, False, False, {}, {}),
    ("grpo", "sequence", 0.1, True, False, {}, {}),
    ("cispo", "token", 0.0, False, False, dict(epsilon_high=4.0), dict(num_items_in_batch=40)),
    ("sapo", "token", 0.04, False, True, dict(sapo_temperature_pos=0.9, sapo_temperature_neg=1.2), {}),
    ("vespo", "token", 0.0, False, False, {}, {}),
    ("luspo", "sequence", 0.0, False, False, {}, {}),
    ("dapo", "token", 0.04, False, True, dict(delta=1.25, use_bias_correction_kl=True),
     dict(vllm_is_ratio="token", num_items_in_batch=torch.tensor(23))),
    ("grpo", "sequence", 0.04, True, True, dict(use_bias_correction_kl=True), dict(vllm_is_ratio="token")),
]


def check_liger_drop_in():
    """`FusedLinearGRPOLoss` against `LigerFusedLinearGRPOLoss` with the same arguments: loss,
    metrics and every gradient, for every loss type the two compute alike (LOSSES.md: `luspo` at
    sequence level without KL, `vespo` without `vllm_is_ratio`), with `delta`, the bias-corrected
    KL, a per-token `vllm_is_ratio` and `num_items_in_batch`."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    for lt, level, beta, with_bias, use_ref, extra, forward_extra in LIGER_CASES:
        B, T, H, V = 3, 6, 16, 83
        hidden, weight, bias = linear_inputs(B, T, H, V, with_bias)
        targets = torch.randint(0, V, (B, T))
        mask = (torch.rand(B, T) > 0.25).float()
        mask[:, 0] = 1
        adv = torch.randn(B)
        with torch.no_grad():
            true_logp = torch.log_softmax(hidden @ weight.T + (0 if bias is None else bias), -1).gather(
                -1, targets[..., None]).squeeze(-1)
        old = true_logp + 0.2 * torch.randn(B, T)
        ref = true_logp + 0.2 * torch.randn(B, T)
        forward_kwargs = dict(forward_extra)
        if forward_kwargs.get("vllm_is_ratio") == "token":
            forward_kwargs["vllm_is_ratio"] = 0.7 + 0.6 * torch.rand(B, T)
        kwargs = dict(beta=beta, compiled=False, use_ref_model=use_ref, chunk_size=1, epsilon_low=0.2,
                      epsilon_high=0.28, loss_type=lt, max_completion_length=T, importance_sampling_level=level)
        kwargs.update(extra)
        results = []
        functional = functools.partial(ft.liger_fused_linear_grpo, **kwargs)
        modules = [LigerFusedLinearGRPOLoss(**kwargs), ft.FusedLinearGRPOLoss(**kwargs)]
        for module in modules + ([functional] if lt == "dapo" else []):
            h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
            b = None if bias is None else bias.clone().requires_grad_(True)
            # Without a reference model, Liger ignores the reference given (the policy is its own).
            loss, metrics = module(h, w, targets, mask, adv, bias=b, ref_per_token_logps=ref if beta else None,
                                   old_per_token_logps=old, **forward_kwargs)
            loss.backward()
            results.append((loss.detach(), [m.detach() for m in metrics], h.grad, w.grad, None if b is None else b.grad))
        if len(results) == 3 and not all(torch.equal(x, y) for x, y in zip(results[1][2:4], results[2][2:4])):
            FAILURES.append(f"liger_fused_linear_grpo {lt}: gradients differ from the module's")
        (l_loss, l_metrics, l_h, l_w, l_b), (loss, metrics, h, w, b) = results[:2]
        case = (f"FusedLinearGRPOLoss vs Liger {lt} {level} beta={beta} bias={with_bias} use_ref_model={use_ref} "
                f"{extra} {sorted(forward_extra)}")
        close(case, "loss", loss, l_loss, 2e-5)
        CHECKS[0] += 1
        if len(metrics) != len(l_metrics):
            FAILURES.append(f"{case}: {len(metrics)} metrics, Liger {len(l_metrics)}")
        for i, (m, lm) in enumerate(zip(metrics, l_metrics)):
            close(case, f"metric {i}", m, lm, 2e-5)
        close_norm(case, "grad_hidden", h, l_h, 1e-4)
        close_norm(case, "grad_weight", w, l_w, 1e-4)
        if with_bias:
            close_norm(case, "grad_bias", b, l_b, 1e-4)


def _liger_distributed_rank(rank, world, port, queue):
    """One rank of `check_liger_drop_in_distributed`: its own batch, Liger's and the drop-in's
    loss and gradients, with and without `num_items_in_batch`; puts its failures on `queue`."""
    import torch.distributed as dist
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(100 + rank)
    failures = []
    B, T, H, V = 2, 5 + rank, 16, 59  # the ranks' token counts differ
    hidden, weight, _ = linear_inputs(B, T, H, V, False)
    targets = torch.randint(0, V, (B, T))
    mask = (torch.rand(B, T) > 0.3).float()
    mask[:, 0] = 1
    adv, old = torch.randn(B), -3 + 0.2 * torch.randn(B, T)
    for lt, num_items in [("dapo", None), ("dapo", 31), ("cispo", torch.tensor(17.0)), ("grpo", 5)]:
        kwargs = dict(beta=0.0, compiled=False, use_ref_model=False, loss_type=lt, epsilon_high=0.28,
                      max_completion_length=T)
        results = []
        for module in [LigerFusedLinearGRPOLoss(**kwargs), ft.FusedLinearGRPOLoss(**kwargs)]:
            h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
            loss, _ = module(h, w, targets, mask, adv, old_per_token_logps=old, num_items_in_batch=num_items)
            loss.backward()
            results.append((loss.detach().double(), h.grad.double(), w.grad.double()))
        (l_loss, l_h, l_w), (loss, h, w) = results
        for name, got, want in [("loss", loss, l_loss), ("grad_hidden", h, l_h), ("grad_weight", w, l_w)]:
            err = ((got - want).norm() / want.norm().clamp(min=1e-30)).item()
            if not err <= 1e-4:
                failures.append(f"rank {rank} of {world}, {lt} num_items_in_batch={num_items}: {name} relative "
                                f"error {err:.3e} against Liger")
    dist.destroy_process_group()
    queue.put(failures)


def check_liger_drop_in_distributed():
    """Under `torch.distributed` (two gloo ranks with different token counts) the drop-in's
    dapo / cispo normaliser is Liger's: `num_items_in_batch / world_size`, or without it the
    mask's sum over the ranks / world_size."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    processes = [context.Process(target=_liger_distributed_rank, args=(rank, 2, port, queue)) for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=300)
    for process in processes:  # a rank that hung (its peer crashed in the collective): end it
        if process.is_alive():
            process.kill()
            process.join()
    CHECKS[0] += 1
    if any(p.exitcode != 0 for p in processes):
        FAILURES.append(f"Liger drop-in under torch.distributed: exit codes {[p.exitcode for p in processes]}")
        return
    for _ in processes:
        FAILURES.extend(queue.get())


def check_logits_level_modules():
    """`GRPOLoss` / `triton_grpo_loss` on Liger's `[B, L+1, V]` logits equal `grpo_loss` on the
    first L positions; `FusedLinearCrossEntropyLoss` equals `F.cross_entropy`."""
    B, L, V = 3, 5, 64
    logits = torch.randn(B, L + 1, V)
    ids = torch.randint(0, V, (B, L))
    mask = (torch.rand(B, L) > 0.3).float()
    mask[:, 0] = 1
    adv, old, ref = torch.randn(B), torch.randn(B, L) - 4, torch.randn(B, L) - 4
    # inplace=True is Liger's default: the gradient is written over the logits in the backward,
    # times the upstream (here 0.5: `(loss * 0.5).backward()`).
    for lt, inplace in [("dapo", False), ("grpo", False), ("dr_grpo", False), ("bnpo", False), ("dapo", True),
                        ("grpo", True)]:
        case = f"GRPOLoss [B, L+1, V] {lt} inplace={inplace}"
        x = logits.clone().requires_grad_(True)
        loss, metrics = ft.GRPOLoss(loss_type=lt, inplace=inplace)(x, old, ref, ids, adv, mask)
        if not torch.equal(x.detach(), logits):
            FAILURES.append(f"{case}: the forward changed the logits")
        (loss * 0.5).backward()
        o = grpo_options(loss_type=lt, temperature=0.9, epsilon_high=0.4, max_completion_length=L)
        want = trl_grpo(logits[:, :L].contiguous(), ids, mask, adv, old, ref, None, o)
        close(case, "loss", loss, want["loss"], 1e-5)
        close(case, "kl_mean", metrics[0], (want["kl"] * mask).sum() / mask.sum(), 1e-5)
        close(case, "clip_ratio", metrics[1], (want["is_clipped"] * mask).sum() / mask.sum(), 1e-5)
        close_norm(case, "grad (first L positions)", x.grad[:, :L], 0.5 * want["grad"], 1e-5)
        CHECKS[0] += 1
        if x.grad[:, L].abs().max() != 0:
            FAILURES.append(f"{case}: gradient at the unscored last position")
    hidden, weight, bias = linear_inputs(2, 4, 8, 40, True)
    targets = torch.randint(0, 40, (8,))
    targets[3] = -100
    module = ft.FusedLinearCrossEntropyLoss(lse_square_scale=1e-3, label_smoothing=0.1)
    got = module(weight, hidden.reshape(8, 8), targets, bias)
    logits = hidden.reshape(8, 8).double() @ weight.double().T + bias.double()
    valid = targets != -100
    per = F.cross_entropy(logits, targets, label_smoothing=0.1, reduction="none") + 1e-3 * torch.logsumexp(
        logits, -1) ** 2 * valid
    close("FusedLinearCrossEntropyLoss", "loss", got, per.sum() / valid.sum(), 1e-5)


def check_softcap():
    """``softcap=c`` (Gemma 2's final logit soft-capping, Liger's ``softcap``): every function on
    ``c tanh(logits / c)``, against float64 autograd through the cap (TRL's GRPO on the capped
    logits, its gradient chained by hand), and the Liger drop-in ``FusedLinearCrossEntropyLoss``."""
    cap_of = lambda x, c: c * torch.tanh(x / c)  # noqa: E731
    for (B, T, V), c, dtype in [((2, 5, 61), 3.0, "f32"), ((1, 4, 3001), 30.0, "bf16"), ((3, 3, 200), 1.0, "f32")]:
        logits = as_dtype(torch.randn(B, T, V) * 8, dtype)
        targets = torch.randint(0, V, (B, T))
        targets[0, 1] = -100
        case = f"torch softcap={c} B={B} T={T} V={V} {dtype}"
        for red in ["mean", "none"]:
            x = logits.clone().requires_grad_(True)
            got = ft.cross_entropy(x, targets, reduction=red, label_smoothing=0.1, z_loss=1e-3, softcap=c)
            upstream = torch.rand(B, T) if red == "none" else torch.tensor(1.3)
            (got * upstream).sum().backward()
            r = logits.double().requires_grad_(True)
            flat = cap_of(r, c).reshape(-1, V)
            valid = (targets.reshape(-1) != -100).double()
            per = F.cross_entropy(flat, targets.reshape(-1), label_smoothing=0.1, reduction="none")
            per = (per + 1e-3 * torch.logsumexp(flat, -1) ** 2 * valid).reshape(B, T)
            want = per if red == "none" else per.sum() / valid.sum()
            (want * upstream.double()).sum().backward()
            close(case, f"cross_entropy {red}", got.detach(), want.detach(), 1e-5)
            close_norm(case, f"cross_entropy {red} grad", x.grad, r.grad, grad_tol(dtype))
        ids = targets.clamp(min=0)
        r = logits.double().requires_grad_(True)
        logsm = torch.log_softmax(cap_of(r, c) / 0.7, -1)
        want_logp = logsm.gather(-1, ids[..., None]).squeeze(-1)
        upstream = torch.randn(B, T)
        (want_logp * upstream.double()).sum().backward()
        x = logits.clone().requires_grad_(True)
        logp = ft.logprob(x, ids, temperature=0.7, softcap=c)
        (logp * upstream).sum().backward()
        close(case, "logprob", logp.detach(), want_logp.detach(), 1e-5)
        close_norm(case, "logprob grad", x.grad, r.grad, grad_tol(dtype))
        close(case, "entropy", ft.entropy(logits, temperature=0.7, softcap=c),
              -(logsm.exp() * logsm).sum(-1).detach(), 1e-5)
        o = grpo_options(loss_type="grpo", importance_sampling_level="sequence", temperature=0.9)
        capped = cap_of(logits.double(), c)
        true_logp = torch.log_softmax(capped / 0.9, -1).gather(-1, ids[..., None]).squeeze(-1)
        mask = (targets != -100).float()
        adv = torch.randn(B)
        old = (true_logp + 0.2 * torch.randn(B, T)).float()
        ref = (true_logp + 0.2 * torch.randn(B, T)).float()
        want = trl_grpo(capped, ids, mask, adv, old, ref, None, o)
        x = logits.clone().requires_grad_(True)
        out = ft.grpo_loss(x, ids, adv, mask, old_logp=old, ref_logp=ref, softcap=c, **kernel_options(o))
        out.loss.backward()
        close(case, "grpo loss", out.loss.detach(), want["loss"], 1e-5)
        slope = 1 - torch.tanh(logits.double() / c) ** 2
        close_norm(case, "grpo grad", x.grad, want["grad"] * slope, grad_tol(dtype))
    hidden, weight, bias = linear_inputs(2, 4, 8, 40, True)
    weight = weight * 6
    targets = torch.randint(0, 40, (8,))
    targets[3] = -100
    for c, red in [(2.0, "mean"), (30.0, "sum"), (5.0, "none")]:
        case = f"FusedLinearCrossEntropyLoss softcap={c} {red}"
        h, w, b = (t.clone().requires_grad_(True) for t in (hidden.reshape(8, 8), weight, bias))
        got = ft.FusedLinearCrossEntropyLoss(label_smoothing=0.1, softcap=c, reduction=red)(w, h, targets, b)
        upstream = torch.rand(8) if red == "none" else torch.tensor(1.0)
        (got * upstream).sum().backward()
        hd, wd, bd = (t.detach().double().requires_grad_(True) for t in (h, w, b))
        logits = cap_of(hd @ wd.T + bd, c)
        per = F.cross_entropy(logits, targets, label_smoothing=0.1, reduction="none", ignore_index=-100)
        want = per if red == "none" else per.sum() / ((targets != -100).sum() if red == "mean" else 1)
        (want * upstream.double()).sum().backward()
        close(case, "loss", got.detach(), want.detach(), 1e-5)
        for name, g, wg in [("d hidden", h.grad, hd.grad), ("d weight", w.grad, wd.grad), ("d bias", b.grad, bd.grad)]:
            close_norm(case, name, g, wg, 1e-4)
    expect_error("softcap <= 0", ValueError, ["softcap"], lambda: ft.FusedLinearCrossEntropyLoss(softcap=0.0))
    expect_error("softcap <= 0, functions", ValueError, ["softcap"],
                 lambda: ft.logprob(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), softcap=-1.0))


def check_z_loss_and_token_scaling():
    """``FusedLinearCrossEntropyLoss(return_z_loss=True)``: Liger's ``CrossEntropyOutput`` with
    ``z_loss = lse_square_scale * lse^2`` over the rows not ignored, reduced as the loss, against
    float64; the loss and its gradients as without it. ``use_token_scaling=True`` against float64
    autograd with ``p_y`` detached."""
    hidden, weight, bias = linear_inputs(2, 5, 8, 50, True)
    h = hidden.reshape(10, 8)
    targets = torch.randint(0, 50, (10,))
    targets[[2, 7]] = -100
    for red, z, cap, dtype in [("mean", 1e-3, None, "f32"), ("sum", 1e-2, 5.0, "f32"), ("none", 1e-3, None, "f32"),
                               ("mean", 0.0, None, "f32"), ("mean", 1e-3, None, "bf16")]:
        case = f"FusedLinearCrossEntropyLoss return_z_loss {red} z={z} softcap={cap} {dtype}"
        hh, ww, bb = (as_dtype(t, dtype).clone().requires_grad_(True) for t in (h, weight, bias))
        out = ft.FusedLinearCrossEntropyLoss(lse_square_scale=z, softcap=cap, reduction=red,
                                             return_z_loss=True)(ww, hh, targets, bb)
        if not isinstance(out, ft.CrossEntropyOutput) or out.token_accuracy is not None:
            fail(case, f"returned {type(out).__name__}")
            continue
        upstream = torch.rand(10) if red == "none" else torch.tensor(1.0)
        (out.loss * upstream).sum().backward()
        logits = hh.detach().double() @ ww.detach().double().T + bb.detach().double()
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        kept = (targets != -100).double()
        z_rows = z * torch.logsumexp(logits, -1) ** 2 * kept
        want = z_rows if red == "none" else z_rows.sum() / (kept.sum() if red == "mean" else 1.0)
        if out.z_loss.dtype != hh.dtype or out.z_loss.requires_grad:
            fail(case, f"z_loss dtype {out.z_loss.dtype}, requires_grad {out.z_loss.requires_grad}")
        close(case, "z_loss", out.z_loss.float(), want, 1e-5 if dtype == "f32" else 1e-2)
        plain = ft.FusedLinearCrossEntropyLoss(lse_square_scale=z, softcap=cap, reduction=red)
        close(case, "loss as without z_loss", out.loss.detach(), plain(ww, hh, targets, bb).detach(), 0.0)
    # use_token_scaling (DFT): each kept row's loss, gradient and z-loss times its detached p_y.
    for red in ["mean", "none"]:
        case = f"FusedLinearCrossEntropyLoss use_token_scaling {red}"
        hh, ww, bb = (t.clone().requires_grad_(True) for t in (h, weight, bias))
        out = ft.FusedLinearCrossEntropyLoss(lse_square_scale=1e-3, label_smoothing=0.1, reduction=red,
                                             use_token_scaling=True, return_z_loss=True)(ww, hh, targets, bb)
        upstream = torch.rand(10) if red == "none" else torch.tensor(1.0)
        (out.loss * upstream).sum().backward()
        hd, wd, bd = (t.detach().double().requires_grad_(True) for t in (hh, ww, bb))
        logits = hd @ wd.T + bd
        kept = (targets != -100).double()
        lse = torch.logsumexp(logits, -1)
        p = torch.softmax(logits.detach(), -1).gather(-1, (targets * (targets != -100))[:, None])[:, 0] * kept
        per = (F.cross_entropy(logits, targets, label_smoothing=0.1, reduction="none") + 1e-3 * lse**2 * kept) * p
        z_rows = 1e-3 * lse.detach() ** 2 * kept * p
        want, want_z = (per, z_rows) if red == "none" else (per.sum() / kept.sum(), z_rows.sum() / kept.sum())
        (want * upstream.double()).sum().backward()
        close(case, "loss", out.loss.detach(), want.detach(), 1e-5)
        close(case, "z_loss", out.z_loss, want_z, 1e-5)
        for name, g, wg in [("d hidden", hh.grad, hd.grad), ("d weight", ww.grad, wd.grad), ("d bias", bb.grad, bd.grad)]:
            close_norm(case, name, g, wg, 1e-4)


def check_token_accuracy_and_predicted_tokens():
    """Liger's ``return_token_accuracy`` / ``return_predicted_tokens`` on ``CrossEntropyLoss``
    (``LigerCrossEntropyLoss``) and ``FusedLinearCrossEntropyLoss``: the predicted tokens are
    ``torch.argmax`` of the (soft-capped) float64 logits (-1 on ignored rows; a near tie may go
    either way, checked on the logits), the accuracy 1 where that is the target over the rows not
    ignored, per token or their mean (``sum`` too, as Liger), NaN over no rows; the loss and its
    gradients as without them."""
    N, H, V = 12, 8, 61
    hidden, weight, bias = linear_inputs(1, N, H, V, True)
    h = hidden.reshape(N, H)
    targets = torch.randint(0, V, (N,))
    targets[[2, 7]] = -100
    logits64 = h.double() @ weight.double().T + bias.double()
    targets[[0, 5]] = logits64[[0, 5]].argmax(-1)  # some rows right
    for module, red, cap, dtype, extras in [
        ("logits", "mean", None, "f32", (False, True, True)),
        ("logits", "none", 4.0, "f32", (True, True, False)),
        ("logits", "sum", None, "bf16", (False, True, True)),
        ("linear", "mean", None, "f32", (True, True, True)),
        ("linear", "none", None, "f32", (False, False, True)),
        ("linear", "sum", 3.0, "bf16", (False, True, True)),
    ]:
        z_flag, acc_flag, tok_flag = extras
        case = f"{module} CrossEntropyLoss {red} softcap={cap} {dtype} z/accuracy/tokens={extras}"
        kw = dict(lse_square_scale=1e-3, softcap=cap, reduction=red, return_z_loss=z_flag,
                  return_token_accuracy=acc_flag, return_predicted_tokens=tok_flag)
        hh, ww, bb = (as_dtype(t, dtype).clone().requires_grad_(True) for t in (h, weight, bias))
        if module == "logits":
            x = (hh.detach() @ ww.detach().T + bb.detach()).clone().requires_grad_(True)
            seen = x.detach().double()
            out = ft.CrossEntropyLoss(**kw)(x, targets)
            plain = ft.CrossEntropyLoss(lse_square_scale=1e-3, softcap=cap, reduction=red)(x.detach(), targets)
        else:
            seen = hh.detach().double() @ ww.detach().double().T + bb.detach().double()
            out = ft.FusedLinearCrossEntropyLoss(**kw)(ww, hh, targets, bb)
            plain = ft.FusedLinearCrossEntropyLoss(lse_square_scale=1e-3, softcap=cap, reduction=red)(ww, hh, targets,
                                                                                                    bb)
        if not isinstance(out, ft.CrossEntropyOutput):
            fail(case, f"returned {type(out).__name__}")
            continue
        if (out.z_loss is not None) != z_flag or (out.token_accuracy is not None) != acc_flag or \
                (out.predicted_tokens is not None) != tok_flag:
            fail(case, "the extras returned are not those asked for")
            continue
        close(case, "loss as without the extras", out.loss.detach(), plain.detach(), 0.0)
        capped = seen if cap is None else cap * torch.tanh(seen / cap)
        kept = targets != -100
        want_tokens = torch.where(kept, capped.argmax(-1), -1)
        tokens = out.predicted_tokens
        if tokens is None:
            tokens = ft.CrossEntropyLoss(softcap=cap, return_predicted_tokens=True)(seen.float(), targets).predicted_tokens
        CHECKS[0] += 1
        if tokens.dtype != torch.int64 or tuple(tokens.shape) != tuple(targets.shape):
            fail(case, f"predicted_tokens {tokens.dtype} {list(tokens.shape)}")
        rows = torch.arange(N)
        # The token predicted is the largest logit, to the rounding of the logits and of the cap.
        top = capped[rows, want_tokens.clamp(min=0)]
        got_value = capped[rows, tokens.clamp(min=0)]
        near = (top - got_value).abs() <= 1e-5 * top.abs().clamp(min=1.0)
        if not torch.equal(tokens < 0, ~kept) or not bool(near[kept].all()):
            fail(case, f"predicted_tokens {tokens.tolist()} vs argmax {want_tokens.tolist()}")
        if acc_flag:
            correct = ((tokens == targets) & kept).float()
            want = correct if red == "none" else correct.sum() / kept.sum()
            CHECKS[0] += 1
            if out.token_accuracy.dtype != torch.float32 or out.token_accuracy.requires_grad:
                fail(case, f"token_accuracy {out.token_accuracy.dtype}")
            close(case, "token_accuracy", out.token_accuracy, want, 0.0)
        if module == "logits" and dtype == "f32" and red != "none":
            (out.loss).backward()
            x2 = x.detach().clone().requires_grad_(True)
            ft.CrossEntropyLoss(lse_square_scale=1e-3, softcap=cap, reduction=red)(x2, targets).backward()
            close(case, "d logits as without the extras", x.grad, x2.grad, 0.0)
    # The loss in the logits' dtype (Liger's `loss_1d` is), the fused-linear one in float32.
    xb = torch.randn(6, 40).to(torch.bfloat16)
    yb = torch.randint(0, 40, (6,))
    got = ft.CrossEntropyLoss(return_token_accuracy=True)(xb, yb).loss.dtype
    got_linear = ft.FusedLinearCrossEntropyLoss()(torch.randn(40, 8).to(torch.bfloat16),
                                                  torch.randn(6, 8).to(torch.bfloat16), yb).dtype
    CHECKS[0] += 1
    if (got, got_linear) != (torch.bfloat16, torch.float32):
        fail("loss dtypes of the cross-entropy drop-ins", f"{got}, {got_linear}")
    # `ignore_index=-1`, the value of a predicted token on an ignored row: such a row is not right.
    x = torch.randn(5, 30)
    y = x.argmax(-1)
    y[1] = -1
    out = ft.CrossEntropyLoss(ignore_index=-1, reduction="none", return_token_accuracy=True,
                              return_predicted_tokens=True)(x, y)
    close("ignore_index=-1", "token_accuracy", out.token_accuracy, torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0]), 0.0)
    close("ignore_index=-1", "predicted_tokens", out.predicted_tokens.double(),
          torch.where(y < 0, -1, x.argmax(-1)).double(), 0.0)
    # Liger's attributes, read at each call.
    module = ft.FusedLinearCrossEntropyLoss()
    w8, h8, y = torch.randn(30, 8), torch.randn(5, 8), y.clamp(min=0)
    CHECKS[0] += 1
    if not torch.is_tensor(module(w8, h8, y)):
        fail("FusedLinearCrossEntropyLoss attributes", "the plain loss expected")
    module.return_predicted_tokens = True
    got = module(w8, h8, y)
    CHECKS[0] += 1
    if not isinstance(got, ft.CrossEntropyOutput) or got.predicted_tokens is None:
        fail("FusedLinearCrossEntropyLoss attributes", "return_predicted_tokens set after construction is not read")
    # Liger's functional forms: the modules called once.
    kw = dict(ignore_index=-1, reduction="sum", lse_square_scale=1e-3, return_z_loss=True, return_token_accuracy=True)
    want, got = ft.CrossEntropyLoss(**kw)(x, y), ft.liger_cross_entropy(x, y, **kw)
    close("liger_cross_entropy", "loss", got.loss, want.loss, 0.0)
    close("liger_cross_entropy", "z_loss", got.z_loss, want.z_loss, 0.0)
    close("liger_cross_entropy", "token_accuracy", got.token_accuracy, want.token_accuracy, 0.0)
    got = ft.liger_fused_linear_cross_entropy(h8, w8, y, None, return_predicted_tokens=True)
    close("liger_fused_linear_cross_entropy", "predicted_tokens", got.predicted_tokens.double(),
          module(w8, h8, y).predicted_tokens.double(), 0.0)
    # No row taking part: Liger's 0 / 0.
    none_kept = torch.full((4,), -100)
    out = ft.CrossEntropyLoss(return_token_accuracy=True, return_predicted_tokens=True)(torch.randn(4, 9), none_kept)
    CHECKS[0] += 1
    if not (torch.isnan(out.token_accuracy) and torch.equal(out.predicted_tokens, torch.full((4,), -1))):
        fail("CrossEntropyLoss over ignored rows only", f"{out.token_accuracy} {out.predicted_tokens}")


def check_class_weights():
    """Per-class weights (``CrossEntropyLoss(weight=)``, ``FusedLinearCrossEntropyLoss(ce_weight=)``,
    the functions' ``class_weights=``) against float64 ``F.cross_entropy(weight=, label_smoothing=)``
    autograd, with Liger's unweighted z-loss added (``mean`` over the rows not ignored): every
    reduction, label smoothing (the weights then reach every column), a soft cap, bf16, ignored
    rows; the weights read at each call; bad weights named."""
    N, H, V = 14, 8, 67
    hidden, weight, bias = linear_inputs(1, N, H, V, True)
    h = hidden.reshape(N, H)
    targets = torch.randint(0, V, (N,))
    targets[[3, 9]] = -100
    c = torch.rand(V) * 1.5 + 0.25
    c[::7] = 0.0
    for module, red, s, z, cap, dtype in [
        ("logits", "mean", 0.0, 0.0, None, "f32"),
        ("logits", "mean", 0.1, 1e-3, None, "f32"),
        ("logits", "sum", 0.3, 0.0, 4.0, "f32"),
        ("logits", "none", 0.2, 1e-3, None, "f32"),
        ("logits", "mean", 0.1, 0.0, None, "bf16"),
        ("linear", "mean", 0.1, 1e-3, None, "f32"),
        ("linear", "none", 0.0, 0.0, 3.0, "f32"),
        ("linear", "sum", 0.2, 0.0, None, "bf16"),
        ("function", "mean", 0.1, 1e-3, None, "f32"),
        ("function-linear", "mean", 0.1, 0.0, None, "f32"),
        ("in-place", "sum", 0.1, 0.0, None, "f32"),
    ]:
        case = f"class weights, {module} {red} s={s} z={z} softcap={cap} {dtype}"
        hh, ww, bb = (as_dtype(t, dtype).clone().requires_grad_(True) for t in (h, weight, bias))
        logits = (hh.detach() @ ww.detach().T + bb.detach()).clone()
        x = logits.clone().requires_grad_(True)
        kw = dict(lse_square_scale=z, label_smoothing=s, reduction=red, softcap=cap)
        if module == "logits":
            got = ft.CrossEntropyLoss(weight=c, **kw)(x, targets)
        elif module == "linear":
            got = ft.FusedLinearCrossEntropyLoss(ce_weight=c, **kw)(ww, hh, targets, bb)
        elif module == "function":
            got = ft.cross_entropy(x, targets, reduction=red, label_smoothing=s, z_loss=z, class_weights=c)
        elif module == "function-linear":
            got = ft.fused_linear_cross_entropy(hh, ww, targets, bias=bb, reduction=red, label_smoothing=s, z_loss=z,
                                                class_weights=c)
        else:
            x = logits.clone()
            got = ft.cross_entropy(x.requires_grad_(True), targets, reduction=red, label_smoothing=s,
                                   class_weights=c, in_place=True)
        upstream = torch.rand(N) if red == "none" else torch.tensor(1.0)
        (got.float() * upstream).sum().backward()
        hd, wd, bd = (t.detach().double().requires_grad_(True) for t in (hh, ww, bb))
        xd = hd @ wd.T + bd if module in ("linear", "function-linear") else logits.double().requires_grad_(True)
        capped = xd if cap is None else cap * torch.tanh(xd / cap)
        kept = (targets != -100).double()
        want = F.cross_entropy(capped, targets, weight=c.double(), label_smoothing=s, reduction=red)
        z_rows = z * torch.logsumexp(capped, -1) ** 2 * kept
        want = want + (z_rows if red == "none" else z_rows.sum() / (kept.sum() if red == "mean" else 1.0))
        (want * upstream.double()).sum().backward()
        close(case, "loss", got.detach().float(), want.detach(), 1e-5 if dtype == "f32" else 1e-2)
        if module in ("linear", "function-linear"):
            tol = 1e-4 if dtype == "f32" else 2e-2
            for name, g, wg in [("d hidden", hh.grad, hd.grad), ("d weight", ww.grad, wd.grad),
                                ("d bias", bb.grad, bd.grad)]:
                close_norm(case, name, g, wg, tol)
        else:
            close_norm(case, "d logits", x.grad, xd.grad, 1e-5 if dtype == "f32" else 1e-2)
    # The weights are an attribute read at each call, as Liger's forward reads it.
    module = ft.CrossEntropyLoss()
    x = torch.randn(6, 20)
    y = torch.randint(0, 20, (6,))
    plain = module(x, y)
    module.weight = torch.rand(20) + 0.5
    close("CrossEntropyLoss.weight set after construction", "loss", module(x, y),
          F.cross_entropy(x.double(), y, weight=module.weight.double()), 1e-5)
    close("CrossEntropyLoss without weight", "loss", plain, F.cross_entropy(x.double(), y), 1e-5)
    close("cross_entropy(weight=), F.cross_entropy's name", "loss", ft.cross_entropy(x, y, weight=module.weight),
          F.cross_entropy(x.double(), y, weight=module.weight.double()), 1e-5)
    expect_error("weight and class_weights both", ValueError, ["weight", "class_weights"],
                 lambda: ft.cross_entropy(x, y, weight=module.weight, class_weights=module.weight))
    expect_error("class weights of the wrong length", ValueError, ["`weight`", "[20]"],
                 lambda: ft.CrossEntropyLoss(weight=torch.ones(19))(x, y))
    expect_error("ce_weight of the wrong length", ValueError, ["`ce_weight`", "[20]"],
                 lambda: ft.FusedLinearCrossEntropyLoss(ce_weight=torch.ones(19))(torch.randn(20, 4), torch.randn(6, 4), y))
    expect_error("function class weights of the wrong length", ValueError, ["class_weights", "[20]"],
                 lambda: ft.cross_entropy(x, y, class_weights=torch.ones(19)))
    expect_error("integer class weights", TypeError, ["weight", "floating"],
                 lambda: ft.CrossEntropyLoss(weight=torch.ones(20, dtype=torch.int64)))
    expect_error("class weights with a NaN", ValueError, ["class_weights", "class 4"],
                 lambda: ft.cross_entropy(x, y, class_weights=torch.ones(20).index_fill(0, torch.tensor([4]),
                                                                                         float("nan"))))
    import flashgrpo.arrays as fa  # noqa: PLC0415
    expect_error("class weights on another op", ValueError, ["class_weights", "grpo"],
                 lambda: fa.loss("grpo", x.numpy()[None], y.numpy()[None], [1.0], class_weights=[1.0] * 20))


def check_triton_per_token():
    """`triton_grpo_loss(reduce=False)`: the per-token loss back-propagated with a per-token
    upstream gradient (`loss.backward(dy)`, as Liger's tests do), in place (written in the
    backward: the logits keep their values until then) or not, against float64 autograd. At
    sequence level the upstream of every token reaches its sequence's shared weight."""
    B, L, V = 3, 7, 97
    for lt, level, inplace, dtype, extra in [
            ("dapo", "token", True, "f32", {}), ("grpo", "token", False, "f32", {}),
            ("cispo", "token", True, "bf16", {}), ("sapo", "token", False, "f32", {}),
            ("bnpo", "sequence", True, "f32", {}), ("dr_grpo", "sequence", False, "f32", {}),
            ("grpo", "sequence", True, "bf16", dict(use_bias_correction_kl=True)),
            ("dapo", "sequence", False, "f32", dict(use_bias_correction_kl=True, vllm_is_ratio="token")),
            ("grpo", "sequence", True, "f32", dict(vllm_is_ratio="sequence", delta=1.05)),
            ("dapo", "token", True, "f16", {})]:
        logits = as_dtype(torch.randn(B, L + 1, V) * 2, dtype)
        ids = torch.randint(0, V, (B, L))
        mask = (torch.rand(B, L) > 0.3).float()
        mask[:, 0] = 1
        adv = torch.randn(B)
        true_logp = torch.log_softmax(logits[:, :L].double() / 0.9, -1).gather(-1, ids[..., None]).squeeze(-1)
        old = (true_logp + 0.2 * torch.randn(B, L)).float()
        ref = (true_logp + 0.2 * torch.randn(B, L)).float()
        dy = torch.randn(B, L)
        isr = {None: None, "token": torch.rand(B, L) + 0.5, "sequence": torch.rand(B) + 0.5}[extra.get("vllm_is_ratio")]
        o = grpo_options(loss_type=lt, temperature=0.9, epsilon_high=1.5 if lt == "cispo" else 0.4,
                         importance_sampling_level=level, max_completion_length=L,
                         use_bias_correction_kl=extra.get("use_bias_correction_kl", False), delta=extra.get("delta"))
        want = trl_grpo(logits[:, :L].contiguous(), ids, mask, adv, old, ref, isr, o, upstream=dy)
        case = f"triton_grpo_loss reduce=False {lt} {level} inplace={inplace} {dtype} {extra}"
        x = logits.clone().requires_grad_(True)
        try:
            loss, kl, clipped = ft.triton_grpo_loss(x, old, ref, ids, adv, mask, eps_high=o["epsilon_high"],
                                                    loss_type=lt, importance_sampling_level=level, inplace=inplace,
                                                    use_bias_correction_kl=o["use_bias_correction_kl"],
                                                    vllm_is_ratio=isr, delta=o["delta"])
            if not torch.equal(x.detach(), logits):
                FAILURES.append(f"{case}: the forward changed the logits")
            loss.backward(dy)
        except Exception as e:  # noqa: BLE001
            fail(case, f"raised {e!r}")
            continue
        close(case, "per_token_loss", loss, want["per_token_loss"], 1e-5, mask)
        close(case, "kl", kl, want["kl"], 1e-5, mask)
        if lt != "sapo":
            close(case, "is_clipped", clipped, want["is_clipped"], 1e-5, mask)
        elif clipped.abs().max() != 0:
            FAILURES.append(f"{case}: sapo reports clipped tokens (Liger reports none)")
        close_norm(case, "grad (first L positions)", x.grad[:, :L], want["grad"], grad_tol(dtype))
        CHECKS[0] += 1
        if x.grad[:, L].abs().max() != 0 or x.grad.dtype != logits.dtype:
            FAILURES.append(f"{case}: gradient at the unscored position, or of dtype {x.grad.dtype}")
    expect_error("reduce=False with a loss type that mixes tokens", ValueError, ["geo_mean", "reduce=True"],
                 lambda: ft.triton_grpo_loss(torch.randn(B, L + 1, V), None, None, ids, adv, mask, beta=0.0,
                                             loss_type="geo_mean"))
    for level, inplace in [("token", True), ("sequence", True), ("sequence", False)]:
        x = torch.randn(B, L + 1, V, requires_grad=True)
        loss, _, _ = ft.triton_grpo_loss(x, None, None, ids, adv, mask, beta=0.0, importance_sampling_level=level,
                                         inplace=inplace)
        dy = torch.rand(B, L)
        dy[mask == 0] = float("inf")  # an upstream on masked tokens writes nothing there
        loss.backward(dy)
        CHECKS[0] += 1
        if not torch.isfinite(x.grad).all():
            FAILURES.append(f"triton_grpo_loss {level} inplace={inplace}: an infinite upstream on masked tokens made "
                            f"the gradient non-finite")


def check_per_token_fused_linear():
    """Per-token fused-linear outputs back-propagated with a per-token upstream gradient
    (`FusedLinearCrossEntropyLoss(reduction="none")`, `fused_linear_logprob`), and a weight of
    another dtype than the hidden states (cast as Liger casts it), against float64 autograd."""
    B, T, H, V = 2, 5, 12, 71
    for with_bias in (False, True):
        hidden, weight, bias = linear_inputs(B, T, H, V, with_bias)
        targets = torch.randint(0, V, (B * T,))
        targets[3] = -100
        dy = torch.rand(B * T)
        h64, w64 = hidden.reshape(B * T, H).double().requires_grad_(True), weight.double().requires_grad_(True)
        b64 = None if bias is None else bias.double().requires_grad_(True)
        logits = h64 @ w64.T + (0 if b64 is None else b64)
        per = F.cross_entropy(logits, targets, reduction="none", label_smoothing=0.1)
        (per * dy.double()).sum().backward()
        h, w = hidden.reshape(B * T, H).clone().requires_grad_(True), weight.clone().requires_grad_(True)
        b = None if bias is None else bias.clone().requires_grad_(True)
        case = f"FusedLinearCrossEntropyLoss reduction=none, per-token upstream, bias={with_bias}"
        got = ft.FusedLinearCrossEntropyLoss(reduction="none", label_smoothing=0.1)(w, h, targets, b)
        got.backward(dy)
        close(case, "per-token loss", got, per.detach(), 1e-5)
        close_norm(case, "grad_hidden", h.grad, h64.grad, 1e-4)
        close_norm(case, "grad_weight", w.grad, w64.grad, 1e-4)
        if with_bias:
            close_norm(case, "grad_bias", b.grad, b64.grad, 1e-4)
        CHECKS[0] += 1

        ids = targets.clamp(min=0).reshape(B, T)
        h64.grad = w64.grad = None
        lp = torch.log_softmax(h64.reshape(B, T, H) @ w64.T + (0 if b64 is None else b64.detach()), -1)
        lp = lp.gather(-1, ids[..., None]).squeeze(-1)
        (lp * dy.reshape(B, T).double()).sum().backward()
        h3, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        case = f"fused_linear_logprob, per-token upstream, bias={with_bias}"
        got = ft.fused_linear_logprob(h3, w, ids, bias=bias)
        got.backward(dy.reshape(B, T))
        close(case, "logp", got, lp.detach(), 1e-5)
        close_norm(case, "grad_hidden", h3.grad.reshape(B * T, H), h64.grad, 1e-4)
        close_norm(case, "grad_weight", w.grad, w64.grad, 1e-4)
        CHECKS[0] += 1

    hidden, weight, _ = linear_inputs(B, T, H, V, False)
    ids, adv = torch.randint(0, V, (B, T)), torch.randn(B)
    case = "fused-linear GRPO, bf16 hidden states with an f32 lm_head"
    hb = hidden.to(torch.bfloat16)
    results = []
    for w_in in (weight.clone(), weight.to(torch.bfloat16).clone()):
        h, w = hb.clone().requires_grad_(True), w_in.requires_grad_(True)
        out = ft.fused_linear_grpo_loss(h, w, ids, adv, beta=0.0, bf16_products="auto")
        out.loss.backward()
        results.append((out.loss.detach(), h.grad, w.grad))
    (loss_mixed, gh_mixed, gw_mixed), (loss_same, gh_same, _) = results
    close(case, "loss", loss_mixed, loss_same, 1e-6)
    close_norm(case, "grad_hidden", gh_mixed.float(), gh_same.float(), 1e-6)
    CHECKS[0] += 1
    if gw_mixed.dtype != torch.float32 or gh_mixed.dtype != torch.bfloat16:
        FAILURES.append(f"{case}: gradient dtypes {gh_mixed.dtype}, {gw_mixed.dtype}")


def check_bf16_products():
    """`bf16_products` picks the bf16 products' way per call: every way this machine has agrees
    with TRL-style float64 autograd on the same bf16 inputs within bf16's tolerance (the rounded
    ways too), and a way it lacks is a ValueError naming the key and the ways it has."""
    B, T, H, V = 2, 6, 32, 300
    hidden, weight, _ = linear_inputs(B, T, H, V, False)
    targets, adv, mask = torch.randint(0, V, (B, T)), torch.randn(B), torch.ones(B, T)
    bh, bw = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)
    o = grpo_options(beta=0.0)
    h, w, _, logits = materialised(bh.float(), bw.float(), None)
    reference = trl_grpo(logits.detach(), targets, mask, adv, None, None, None, o)
    logits.backward(reference["grad"])
    want = (reference["loss"], h.grad, w.grad)

    def run(h, w, **kw):
        xh, xw = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = ft.fused_linear_grpo_loss(xh, xw, targets, adv, mask, **kernel_options(o), **kw)
        out.loss.backward()
        return out.loss.detach().double(), xh.grad.double(), xw.grad.double()

    for way in ["auto", "widened", "rounded", "avx512-bf16", "amx"]:
        try:
            got = run(bh, bw, bf16_products=way)
        except ValueError as e:
            CHECKS[0] += 1
            if way in ("auto", "widened") or "bf16_products" not in str(e):
                FAILURES.append(f"bf16_products={way}: {e}")
            continue
        case = f"torch fused_linear_grpo bf16_products={way}"
        close(case, "loss", got[0], want[0], 2e-2)
        close_norm(case, "grad_hidden", got[1], want[1], 2e-2)
        close_norm(case, "grad_weight", got[2], want[2], 2e-2)
    expect_error("unknown bf16_products", ValueError, ["bf16_products", "`tpu`", "widened"],
                 lambda: run(bh, bw, bf16_products="tpu"))


def check_default_products():
    """Unnamed, the bf16 products' way is `rounded` where every gradient handed back is bf16 (the
    machine having a rounded way and FLASHGRPO_BF16_PRODUCTS unset) and `auto` where one comes
    back in f32 (an f32 lm_head): the same bits as naming that way."""
    B, T, H, V = 2, 5, 24, 130
    hidden, weight, _ = linear_inputs(B, T, H, V, False)
    ids, adv = torch.randint(0, V, (B, T)), torch.randn(B)
    bh = hidden.to(torch.bfloat16)

    def grads(w_in, w_grad, **kw):
        h, w = bh.clone().requires_grad_(True), w_in.clone().requires_grad_(w_grad)
        ft.fused_linear_grpo_loss(h, w, ids, adv, beta=0.0, **kw).loss.backward()
        return [g for g in (h.grad, w.grad) if g is not None]

    def accepted(way):
        try:
            grads(weight.to(torch.bfloat16), True, bf16_products=way)
            return True
        except ValueError:
            return False

    wanted = os.environ.get("FLASHGRPO_BF16_PRODUCTS")  # naming a way this machine has: it decides
    rounded_here = accepted("rounded") and not (wanted and accepted(wanted))
    expected = "rounded" if rounded_here else "auto"
    for case, w_in, w_grad, way in [("bf16 lm_head", weight.to(torch.bfloat16), True, expected),
                                    ("frozen bf16 lm_head", weight.to(torch.bfloat16), False, expected),
                                    ("f32 lm_head", weight, True, "auto")]:
        CHECKS[0] += 1
        got, named = grads(w_in, w_grad), grads(w_in, w_grad, bf16_products=way)
        if any(not torch.equal(a, b) for a, b in zip(got, named)):
            FAILURES.append(f"default bf16_products, {case}: not the bits of bf16_products={way}")


def check_pooled_cast():
    """A large f32 gradient goes back to a bf16 input through a pooled buffer (`_as_dtype`): the
    bits of `Tensor.to`, step after step (the pool's buffers reused)."""
    B, T, H, V = 2, 8, 128, 4096  # the weight's f32 gradient is 2 MiB: pooled
    hidden, weight, _ = linear_inputs(B, T, H, V, False)
    ids, adv = torch.randint(0, V, (B, T)), torch.randn(B)

    def grads():
        h = hidden.to(torch.bfloat16).requires_grad_(True)
        w = weight.to(torch.bfloat16).requires_grad_(True)
        ft.fused_linear_grpo_loss(h, w, ids, adv, beta=0.0).loss.backward()
        return h.grad, w.grad

    pooled = ft._as_dtype
    try:
        ft._as_dtype = lambda g, dtype: g.to(dtype)
        want = grads()
    finally:
        ft._as_dtype = pooled
    for step in range(3):
        CHECKS[0] += 1
        got = grads()
        if any(g.dtype != torch.bfloat16 or not torch.equal(g, w) for g, w in zip(got, want)):
            FAILURES.append(f"pooled cast to bf16, step {step}: not the bits of Tensor.to")


def check_errors():
    logits, targets, adv = torch.randn(2, 3, 10), torch.randint(0, 10, (2, 3)), torch.randn(2)
    expect_error("unknown option", TypeError, ["epsilon_hgh", "epsilon_high"],
                 lambda: ft.grpo_loss(logits, targets, adv, epsilon_hgh=0.3))
    expect_error("bad option value", ValueError, ["loss_type"], lambda: ft.grpo_loss(logits, targets, adv,
                                                                                      loss_type="nope"))
    expect_error("advantages shape", ValueError, ["advantages", "[3]"],
                 lambda: ft.grpo_loss(logits, targets, torch.randn(3)))
    expect_error("targets shape", ValueError, ["targets"], lambda: ft.grpo_loss(logits, targets[:, :2], adv))
    expect_error("float64 logits", TypeError, ["logits", "float64"],
                 lambda: ft.grpo_loss(logits.double(), targets, adv))
    expect_error("float targets", TypeError, ["targets", "integer"],
                 lambda: ft.logprob(logits, targets.float()))
    expect_error("empty vocabulary", ValueError, ["vocabulary"],
                 lambda: ft.cross_entropy(torch.zeros(3, 0), torch.zeros(3, dtype=torch.long)))
    empty = torch.zeros(0, 10, requires_grad=True)
    ce = ft.cross_entropy(empty, torch.zeros(0, dtype=torch.long))
    ce.backward()
    close("cross_entropy over no rows", "loss", ce, torch.zeros(()), 0.0)
    CHECKS[0] += 1
    if empty.grad is None or empty.grad.shape != (0, 10):
        FAILURES.append("cross_entropy over no rows: no gradient of shape [0, 10]")
    bad = targets.clone()
    bad[1, 2] = 10
    expect_error("target out of range", ValueError, ["targets[1, 2]", "10"], lambda: ft.grpo_loss(logits, bad, adv))
    expect_error("ref_logp required", ValueError, ["ref_logp"], lambda: ft.grpo_loss(logits, targets, adv, beta=0.1))
    expect_error("weight shape", ValueError, ["weight"],
                 lambda: ft.fused_linear_grpo_loss(torch.randn(2, 3, 4), torch.randn(10, 5), targets, adv))
    expect_error("integer ce_weight", TypeError, ["ce_weight"],
                 lambda: ft.FusedLinearCrossEntropyLoss(ce_weight=torch.ones(10, dtype=torch.int32)))
    expect_error("label_smoothing out of range", ValueError, ["label_smoothing"],
                 lambda: ft.CrossEntropyLoss(label_smoothing=1.5))
    expect_error("predicted_tokens without an output", ValueError, ["predicted_tokens", "CrossEntropyLoss"],
                 lambda: ft.cross_entropy(torch.randn(3, 5), torch.zeros(3, dtype=torch.long), predicted_tokens=True))
    expect_error("use_ref_model without a reference", ValueError, ["use_ref_model", "ref_input"],
                 lambda: ft.FusedLinearGRPOLoss(use_ref_model=True)(
                     torch.randn(2, 3, 4), torch.randn(10, 4), targets, torch.ones(2, 3), adv))
    expect_error("Liger's constructor checks", ValueError, ["sapo_temperature_neg"],
                 lambda: ft.FusedLinearGRPOLoss(sapo_temperature_neg=0.0))
    # Both of Liger's GRPO losses refuse these at sequence level (and the chunked one dr_grpo
    # without max_completion_length); the drop-ins do too, with Liger's words.
    for lt, words in [("cispo", ["Sequence-level", "cispo"]), ("sapo", ["Sequence-level", "sapo"]),
                      ("vespo", ["vespo", "importance_sampling_level='token'"])]:
        expect_error(f"Liger's sequence-level check, {lt}, Triton", ValueError, words,
                     lambda: ft.triton_grpo_loss(logits, None, None, targets, adv, beta=0.0, loss_type=lt,
                                                 importance_sampling_level="sequence"))
        module = ft.FusedLinearGRPOLoss(loss_type=lt, importance_sampling_level="sequence", use_ref_model=False)
        expect_error(f"Liger's sequence-level check, {lt}, chunked", ValueError, words,
                     lambda: module(torch.randn(2, 3, 4), torch.randn(10, 4), targets, torch.ones(2, 3), adv))
    module = ft.FusedLinearGRPOLoss(loss_type="dr_grpo", use_ref_model=False)
    expect_error("Liger's dr_grpo check, chunked", ValueError, ["max_completion_length", "dr_grpo"],
                 lambda: module(torch.randn(2, 3, 4), torch.randn(10, 4), targets, torch.ones(2, 3), adv))
    old = torch.randn(2, 3) - 3
    expect_error("Liger's Triton checks", ValueError, ["delta", "cispo"],
                 lambda: ft.triton_grpo_loss(logits, old, None, targets, adv, beta=0.0, loss_type="cispo", delta=1.5))
    # Liger's Triton loss reads `delta = 0` as off, and the sapo temperatures for sapo alone.
    off = ft.triton_grpo_loss(logits, old, None, targets, adv, beta=0.0, reduce=True, inplace=False)[0]
    for name, kwargs in [("delta=0", dict(delta=0.0)), ("sapo temperature, dapo", dict(sapo_temperature_pos=0.0))]:
        got = ft.triton_grpo_loss(logits, old, None, targets, adv, beta=0.0, reduce=True, inplace=False, **kwargs)[0]
        close(f"triton_grpo_loss {name}", "loss", got, off, 0.0)


def main():
    torch.set_num_threads(1)
    check_grpo()
    check_in_place_and_no_copy()
    check_reused_gradient_buffers()
    check_cross_entropy()
    check_logprob_entropy()
    check_entropy_gradient()
    check_fused_linear()
    check_liger_drop_in()
    check_liger_drop_in_distributed()
    check_logits_level_modules()
    check_softcap()
    check_z_loss_and_token_scaling()
    check_token_accuracy_and_predicted_tokens()
    check_class_weights()
    check_triton_per_token()
    check_per_token_fused_linear()
    check_bf16_products()
    check_default_products()
    check_pooled_cast()
    check_errors()
    sys.exit(report("flashgrpo.torch"))


if __name__ == "__main__":
    main()

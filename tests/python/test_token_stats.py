"""Per-token log-probabilities, entropies and log-sum-exps, all differentiable at once
(`flashgrpo.torch.token_stats`, `fused_linear_token_stats`), and the drop-ins built on them:
verl's `FusedLinearForPPO` and Liger-Kernel's `LigerFusedLinearScaledCrossEntropyFunction`.
References: float64 autograd through materialised logits, and Liger's own function (on the CPU,
its PyTorch fallback: verl's formulas) run side by side. Prints "N checks, 0 failures"."""

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peers"))

import flashgrpo.torch as ft  # noqa: E402
from crosscheck import as_dtype, grad_tol, linear_inputs  # noqa: E402
from loss_cli import CHECKS, FAILURES, close, close_norm, expect_error, report  # noqa: E402

torch.manual_seed(0)


def reference_stats(logits64, targets, temperature, softcap=None):
    """float64 `(logp, entropy, lse)` of each row of `logits64`, differentiable."""
    u = logits64 if softcap is None else softcap * torch.tanh(logits64 / softcap)
    u = u / temperature
    lse = torch.logsumexp(u, -1)
    logsm = u - lse[..., None]
    logp = logsm.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    return logp, entropy, lse


def upstreams(shape, used):
    """Random upstreams of the three outputs, `None` for those `used` leaves out."""
    return [torch.randn(shape) if k in used else None for k in ("logp", "entropy", "lse")]


def weighted(outputs, ups, mask=None):
    """`sum_k sum_i up_k[i] * output_k[i]` over the outputs with an upstream (masked rows out)."""
    total = 0.0
    for out, up in zip(outputs, ups):
        if up is not None:
            term = out * up.to(out.dtype)
            total = total + (term if mask is None else term * mask.to(out.dtype)).sum()
    return total


USED = [("logp", "entropy", "lse"), ("entropy",), ("lse",), ("logp", "lse"), ("logp",)]


def linear_case(B, T, H, V, with_bias, dtype, temperature, used):
    """A fused-linear case: `(hidden, weight, bias)` in `dtype` (bias `None` without one), targets,
    a mask, upstreams of the `used` outputs, and the float64 reference's masked outputs and
    gradients of `(hidden, weight, bias)` through materialised logits."""
    hidden, weight, bias = linear_inputs(B, T, H, V, with_bias)
    hidden, weight = as_dtype(hidden, dtype), as_dtype(weight, dtype)
    bias = None if bias is None else as_dtype(bias, dtype)
    targets = torch.randint(0, V, (B, T))
    mask = (torch.rand(B, T) > 0.3).float()
    ups = upstreams((B, T), used)
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    b64 = None if bias is None else bias.double().requires_grad_(True)
    want = reference_stats(h64 @ w64.T + (0 if b64 is None else b64), targets, temperature)
    weighted(want, ups, mask).backward()
    outputs = [w.detach() * mask.double() for w in want]
    return (hidden, weight, bias), targets, mask, ups, outputs, (h64.grad, w64.grad, None if b64 is None else b64.grad)


def check_token_stats():
    """Logits-level: each output's value and the gradient of any combination of the three, with a
    mask, a temperature, a soft cap, `[B, T, V]` and `[N, V]`, every dtype."""
    grid = [((2, 5, 40), 1.0, None, "f32"), ((1, 3, 3001), 0.7, None, "bf16"), ((2, 4, 97), 0.9, 3.0, "f32"),
            ((3, 2, 2049), 1.0, None, "f16"), ((7, 1, 33), 1.3, None, "f32")]
    for ((B, T, V), temp, cap, dtype), used in itertools.product(grid, USED):
        logits = as_dtype(torch.randn(B, T, V) * 2.5, dtype)
        targets = torch.randint(0, V, (B, T))
        mask = (torch.rand(B, T) > 0.3).float()
        ups = upstreams((B, T), used)
        r = logits.double().requires_grad_(True)
        want = reference_stats(r, targets, temp, cap)
        weighted(want, ups, mask).backward()
        x = logits.clone().requires_grad_(True)
        got = ft.token_stats(x, targets, mask, temperature=temp, softcap=cap)
        weighted(got, ups).backward()
        case = f"token_stats B={B} T={T} V={V} T={temp} softcap={cap} {dtype} through {'+'.join(used)}"
        for name, g, w in zip(("logp", "entropy", "lse"), got, want):
            close(case, name, g.detach(), w.detach() * mask.double(), 1e-5)
        close_norm(case, "grad", x.grad, r.grad, grad_tol(dtype))
        if x.grad.dtype != logits.dtype:
            FAILURES.append(f"{case}: gradient dtype {x.grad.dtype}, expected {logits.dtype}")
    # [N, V], and no gradient wanted: the values alone.
    logits, targets = torch.randn(6, 50), torch.randint(0, 50, (6,))
    want = reference_stats(logits.double(), targets, 1.0)
    got = ft.token_stats(logits, targets)
    for name, g, w in zip(("logp", "entropy", "lse"), got, want):
        close("token_stats [N, V], no gradient", name, g, w, 1e-5)


def check_fused_linear_token_stats():
    """Fused-linear: the three outputs and the gradients of hidden, weight and bias for each
    combination of used outputs, against float64 materialised logits."""
    B, T, H, V = 3, 5, 24, 70
    for (with_bias, temp, dtype), used in itertools.product([(True, 1.0, "f32"), (False, 0.8, "f32"),
                                                             (False, 1.0, "bf16")], USED):
        (hidden, weight, bias), targets, mask, ups, want, want_grads = linear_case(B, T, H, V, with_bias, dtype,
                                                                                  temp, used)
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        b = None if bias is None else bias.clone().requires_grad_(True)
        got = ft.fused_linear_token_stats(h, w, targets, bias=b, mask=mask, temperature=temp)
        weighted(got, ups).backward()
        case = f"fused_linear_token_stats bias={with_bias} temperature={temp} {dtype} through {'+'.join(used)}"
        tol = 1e-4 if dtype == "f32" else 2e-2
        for name, g, want_k in zip(("logp", "entropy", "lse"), got, want):
            close(case, name, g.detach(), want_k, 1e-5)
        for name, g, want_g in zip(("grad_hidden", "grad_weight", "grad_bias"), (h, w, b), want_grads):
            if want_g is not None:
                close_norm(case, name, g.grad, want_g, tol)


def liger_function():
    from liger_kernel.ops.fused_linear_scaled_cross_entropy import LigerFusedLinearScaledCrossEntropyFunction

    return LigerFusedLinearScaledCrossEntropyFunction


def run_scaled_ce(fn, hidden, weight, target, ups, **kw):
    """Outputs of `fn` (the drop-in or Liger's) and the gradients of hidden and weight of the
    outputs weighted by `ups` (one upstream per output, in their order)."""
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = fn(h, w, target, **kw)
    out = out if isinstance(out, tuple) else (out,)
    sum(((o.float() * u).sum() for o, u in zip(out, ups)), torch.zeros(())).backward()
    return [o.detach() for o in out], h.grad, w.grad


def check_liger_scaled_cross_entropy():
    """The drop-in against Liger's own function (its PyTorch fallback on the CPU), outputs and
    gradients, with ignored rows, entropy, selected tokens (duplicates kept), temperatures, f32
    and bf16; and against float64 autograd."""
    liger = liger_function()
    M, H, V = 37, 32, 301
    grid = itertools.product([1.0, 0.7], [False, True], [None, [5, 0, 300, 5]], ["f32", "bf16"])
    for temp, entropy, selected, dtype in grid:
        hidden, weight, _ = linear_inputs(1, M, H, V, False)
        hidden, weight = as_dtype(hidden.reshape(M, H), dtype), as_dtype(weight, dtype)
        target = torch.randint(0, V, (M,))
        target[[2, 11, 30]] = -100
        ids = None if selected is None else torch.tensor(selected)
        kw = dict(temperature=temp, return_entropy=entropy, selected_token_ids=ids)
        shapes = [(M,)] + ([(M,)] if entropy else []) + ([(M, len(selected))] if selected else [])
        ups = [torch.randn(s) for s in shapes]
        got, gh, gw = run_scaled_ce(ft.liger_fused_linear_scaled_cross_entropy, hidden, weight, target, ups, **kw)
        want, wh, ww = run_scaled_ce(liger.apply, hidden, weight, target, ups, **kw)
        case = f"liger_fused_linear_scaled_cross_entropy T={temp} entropy={entropy} selected={selected} {dtype}"
        CHECKS[0] += 1
        if [(o.shape, o.dtype) for o in got] != [(o.shape, o.dtype) for o in want]:
            FAILURES.append(f"{case}: outputs {[(o.shape, o.dtype) for o in got]} vs Liger's "
                            f"{[(o.shape, o.dtype) for o in want]}")
            continue
        # Liger's fallback takes bf16 logits (the product rounded to bf16): compare loosely there.
        out_tol, g_tol = (1e-5, 1e-4) if dtype == "f32" else (3e-2, 3e-2)
        for k, (g, w) in enumerate(zip(got, want)):
            close(case, f"output {k}", g, w, out_tol)
        close_norm(case, "grad_hidden vs Liger", gh, wh, g_tol)
        close_norm(case, "grad_weight vs Liger", gw, ww, g_tol)
        # float64 autograd: the exact values of the same outputs.
        h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
        valid = target != -100
        logp, ent, lse = reference_stats(h64 @ w64.T, target.clamp(min=0), temp)
        exact = [torch.where(valid, -logp, 0.0)] + ([torch.where(valid, ent, 0.0)] if entropy else [])
        if selected:
            sel = (h64 @ w64.T / temp).index_select(1, ids) - lse[:, None]
            exact.append(torch.where(valid[:, None], sel, 0.0))
        sum((e * u.double()).sum() for e, u in zip(exact, ups)).backward()
        for k, (g, e) in enumerate(zip(got, exact)):
            close(case, f"output {k} vs float64", g, e.detach(), 1e-5 if dtype == "f32" else 2e-2)
        tol = 1e-4 if dtype == "f32" else 2e-2
        close_norm(case, "grad_hidden vs float64", gh, h64.grad, tol)
        close_norm(case, "grad_weight vs float64", gw, w64.grad, tol)


def check_fused_linear_for_ppo():
    """verl's `FusedLinearForPPO` drop-in: against Liger's fallback (verl's formulas; log p =
    -NLL) with `[T, D]` and `[B, T, D]` inputs, and a per-token temperature against float64
    autograd."""
    liger = liger_function()
    B, T, H, V = 2, 9, 16, 211
    hidden, weight, _ = linear_inputs(B, T, H, V, False)
    ids = torch.randint(0, V, (B, T))
    d_logp, d_ent = torch.randn(B, T), torch.randn(B, T)
    for flat, temp in [(True, 1.0), (False, 0.6)]:
        h_in = hidden.reshape(B * T, H) if flat else hidden
        shape = (B * T,) if flat else (B, T)
        h, w = h_in.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        logp, ent = ft.FusedLinearForPPO()(h, w, ids.reshape(shape), temperature=temp)
        ((logp * d_logp.reshape(shape)).sum() + (ent * d_ent.reshape(shape)).sum()).backward()
        hl, wl = hidden.reshape(B * T, H).clone().requires_grad_(True), weight.clone().requires_grad_(True)
        nll, went = liger.apply(hl, wl, ids.reshape(-1), temp, return_entropy=True)
        ((-nll * d_logp.reshape(-1)).sum() + (went * d_ent.reshape(-1)).sum()).backward()
        case = f"FusedLinearForPPO {'[T, D]' if flat else '[B, T, D]'} temperature={temp}"
        CHECKS[0] += 1
        if logp.shape != shape or ent.shape != shape or logp.dtype != torch.float32:
            FAILURES.append(f"{case}: shapes {logp.shape}, {ent.shape}, dtype {logp.dtype}")
        close(case, "log_probs", logp.reshape(-1), -nll.detach(), 1e-5)
        close(case, "entropy", ent.reshape(-1), went.detach(), 1e-5)
        close_norm(case, "grad_hidden", h.grad.reshape(B * T, H), hl.grad, 1e-4)
        close_norm(case, "grad_weight", w.grad, wl.grad, 1e-4)
    # One temperature per token: `hidden / T_i` before the kernel.
    temps = 0.5 + torch.rand(B, T)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp, ent = ft.FusedLinearForPPO()(h, w, ids, temperature=temps)
    ((logp * d_logp).sum() + (ent * d_ent).sum()).backward()
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    want_logp, want_ent, _ = reference_stats(h64 @ w64.T / temps.double()[..., None], ids, 1.0)
    ((want_logp * d_logp.double()).sum() + (want_ent * d_ent.double()).sum()).backward()
    case = "FusedLinearForPPO per-token temperature"
    close(case, "log_probs", logp, want_logp.detach(), 1e-5)
    close(case, "entropy", ent, want_ent.detach(), 1e-5)
    close_norm(case, "grad_hidden", h.grad, h64.grad, 1e-4)
    close_norm(case, "grad_weight", w.grad, w64.grad, 1e-4)


def check_errors_and_edges():
    """Liger's exception types for bad arguments; a backward through no output; a second
    backward refused."""
    f = ft.liger_fused_linear_scaled_cross_entropy
    h, w, y = torch.randn(4, 8), torch.randn(20, 8), torch.randint(0, 20, (4,))
    expect_error("temperature 0", ValueError, ["temperature"], lambda: f(h, w, y, temperature=0.0))
    expect_error("temperature a string", TypeError, ["temperature"], lambda: f(h, w, y, temperature="1"))
    expect_error("return_entropy not a bool", TypeError, ["return_entropy"], lambda: f(h, w, y, return_entropy=1))
    expect_error("m_tiles_per_cluster 0", ValueError, ["m_tiles_per_cluster"], lambda: f(h, w, y,
                                                                                          m_tiles_per_cluster=0))
    expect_error("m_tiles_per_cluster a float", TypeError, ["m_tiles_per_cluster"],
                 lambda: f(h, w, y, m_tiles_per_cluster=1.0))
    expect_error("target of int32", TypeError, ["target", "int64"], lambda: f(h, w, y.int()))
    expect_error("target of another length", ValueError, ["target", "[3]"], lambda: f(h, w, y[:3]))
    expect_error("no tokens", ValueError, ["non-empty"], lambda: f(h[:0], w, y[:0]))
    expect_error("float64 inputs", TypeError, ["float64"], lambda: f(h.double(), w.double(), y))
    expect_error("selected ids of rank 2", ValueError, ["selected_token_ids", "[K]"],
                 lambda: f(h, w, y, selected_token_ids=torch.tensor([[3]])))
    expect_error("mixed dtypes", TypeError, ["_input", "weight"], lambda: f(h, w.bfloat16(), y))
    expect_error("selected id out of range", ValueError, ["selected_token_ids[1]", "20"],
                 lambda: f(h, w, y, selected_token_ids=torch.tensor([3, 20])))
    expect_error("selected ids of int32", TypeError, ["selected_token_ids"],
                 lambda: f(h, w, y, selected_token_ids=torch.tensor([3], dtype=torch.int32)))
    bad = y.clone()
    bad[2] = 25
    expect_error("target out of range", ValueError, ["targets", "25"], lambda: f(h, w, bad))
    expect_error("per-token temperature of another length", ValueError, ["temperature", "3"],
                 lambda: ft.FusedLinearForPPO()(h, w, y, temperature=torch.ones(3)))
    # Every target ignored: zeros, and zero gradients.
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    nll, ent = f(hh, ww, torch.full((4,), -100), return_entropy=True)
    (nll.sum() + ent.sum()).backward()
    CHECKS[0] += 1
    if nll.abs().sum() != 0 or ent.abs().sum() != 0 or hh.grad.abs().sum() != 0 or ww.grad.abs().sum() != 0:
        FAILURES.append("every target ignored: outputs or gradients not zero")
    # The gradient is written once: a second backward is refused by name.
    hh = h.clone().requires_grad_(True)
    stats = ft.fused_linear_token_stats(hh, w, y)
    stats.entropy.sum().backward(retain_graph=True)
    expect_error("second backward", RuntimeError, ["already"], lambda: stats.entropy.sum().backward())


def main():
    torch.set_num_threads(1)
    check_token_stats()
    check_fused_linear_token_stats()
    check_liger_scaled_cross_entropy()
    check_fused_linear_for_ppo()
    check_errors_and_edges()
    sys.exit(report("token stats"))


if __name__ == "__main__":
    main()

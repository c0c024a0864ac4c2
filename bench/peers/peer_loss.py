"""What a user would write instead of flashgrpo, timed on this machine: the same losses on
materialised logits, forward + backward (`value_and_grad`), in PyTorch eager, `torch.compile`
or `jax.jit`. Prints one JSON object: step times, the RSS before the timed steps (inputs and
framework) and its peak during them.

Usage: python peer_loss.py --framework torch-eager|torch-compile|jax|liger|flashgrpo-torch|flashgrpo-torch-inplace|
                                       flashgrpo-jax|flashgrpo-jax-inplace|flashgrpo-jax-arrays
                           --op grpo|cross_entropy|logprob
                           --n N --vocab V --dtype f32|bf16 [--hidden H] [--warmup 2] [--steps 5]

With --hidden, GRPO is computed from hidden states and an lm_head: TRL's loss on materialised
`hidden @ weight.T` (torch-eager / torch-compile), or Liger-Kernel's `LigerFusedLinearGRPOLoss`,
or flashgrpo's drop-in `flashgrpo.torch.FusedLinearGRPOLoss` (flashgrpo-torch).

The flashgrpo-* frameworks time the `flashgrpo` wheel from Python on the same inputs, to measure
the cost of the Python boundary against `flashgrpo bench`: `flashgrpo.torch`'s functions with a
gradient buffer from PyTorch (flashgrpo-torch) or written over the logits (flashgrpo-torch-inplace,
the logits restored between steps, untimed), `flashgrpo.jax` (the XLA FFI custom calls under
`jax.jit(jax.value_and_grad)`, flashgrpo-jax; with `in_place=True` and the logits donated, a
fresh copy each step made untimed, flashgrpo-jax-inplace) and `flashgrpo.arrays` on JAX arrays.

The losses are written the way TRL and the original system write them: GRPO (dapo, token level,
beta = 0.04, eps 0.2 / 0.28) as TRL's `_compute_loss` (log_softmax, gather, ratio, clamp, min,
k3 KL, masked mean); cross-entropy as `F.cross_entropy` / `optax`-style log_softmax; logprob as
`sum(mask * log_softmax.gather)`.
"""

import argparse
import json
import os
import statistics
import time

EPS_LOW, EPS_HIGH, BETA, LOGIT_STD = 0.2, 0.28, 0.04, 2.0


def status_bytes(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def reset_peak_rss():
    """Linux: sets VmHWM to the current RSS, so the peak measured is that of the timed steps."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def torch_linear_step(args):
    """GRPO from hidden states and the lm_head: TRL on materialised logits (eager / compile), or
    Liger-Kernel's chunked `LigerFusedLinearGRPOLoss`."""
    import torch

    torch.manual_seed(0)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    n, v, h = args.n, args.vocab, args.hidden
    b = 4 if n % 4 == 0 else 1
    t = n // b
    hidden = torch.randn(b, t, h).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h) * LOGIT_STD / h**0.5).to(dtype).requires_grad_(True)
    ids = torch.randint(0, v, (b, t))
    mask = (torch.rand(b, t) > 0.1).float()
    with torch.no_grad():
        base = torch.cat([
            torch.gather((hidden[i].float() @ weight.float().T).log_softmax(-1), -1, ids[i][:, None]).squeeze(-1)[None]
            for i in range(b)
        ])
    old = base + 0.3 * torch.randn(b, t)
    ref = base + 0.3 * torch.randn(b, t)
    adv = torch.randn(b)

    if args.framework in ("liger", "flashgrpo-torch"):
        if args.framework == "liger":
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        else:
            from flashgrpo.torch import FusedLinearGRPOLoss as LigerFusedLinearGRPOLoss

        loss_module = LigerFusedLinearGRPOLoss(beta=BETA, compiled=False, use_ref_model=True, chunk_size=1,
                                               epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, loss_type="dapo")

        def loss_fn():
            out = loss_module(hidden, weight, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)
            return out[0] if isinstance(out, tuple) else out
    else:
        def grpo():
            logits = (hidden @ weight.T).float()
            logp = torch.gather(logits.log_softmax(-1), -1, ids[..., None]).squeeze(-1)
            ratio = torch.exp(logp - old)
            a = adv[:, None]
            per = -torch.min(ratio * a, torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            return ((per + BETA * kl) * mask).sum() / mask.sum()

        loss_fn = torch.compile(grpo) if args.framework == "torch-compile" else grpo

    def step():
        hidden.grad = None
        weight.grad = None
        loss = loss_fn()
        loss.backward()
        return float(loss.detach())

    grad_bytes = (hidden.numel() + weight.numel()) * hidden.element_size()
    return step, (hidden.numel() + weight.numel()) * hidden.element_size(), grad_bytes


def torch_step(args):
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    n, v = args.n, args.vocab
    logits = (torch.randn(n, v) * LOGIT_STD).to(dtype).requires_grad_(True)
    ids = torch.randint(0, v, (n,))
    mask = (torch.rand(n) > 0.1).float()
    with torch.no_grad():
        base = torch.gather(logits.float().log_softmax(-1), -1, ids[:, None]).squeeze(-1)
    old = base + 0.3 * torch.randn(n)
    ref = base + 0.3 * torch.randn(n)
    adv = torch.randn(n)

    if args.framework.startswith("flashgrpo"):
        return flashgrpo_torch_step(args, logits, ids, mask, old, ref, adv)

    def grpo(logits):
        logp = torch.gather(logits.float().log_softmax(-1), -1, ids[:, None]).squeeze(-1)
        ratio = torch.exp(logp - old)
        per = -torch.min(ratio * adv, torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * adv)
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        per = per + BETA * kl
        return (per * mask).sum() / mask.sum()

    def cross_entropy(logits):
        return F.cross_entropy(logits.float(), torch.where(mask > 0, ids, -100))

    def logprob(logits):
        logp = torch.gather(logits.float().log_softmax(-1), -1, ids[:, None]).squeeze(-1)
        return (logp * mask).sum()

    f = {"grpo": grpo, "cross_entropy": cross_entropy, "logprob": logprob}[args.op]
    if args.framework == "torch-compile":
        f = torch.compile(f)

    def step():
        logits.grad = None
        loss = f(logits)
        loss.backward()
        return float(loss.detach())

    return step, logits.numel() * logits.element_size(), logits.numel() * logits.element_size()


def flashgrpo_torch_step(args, logits, ids, mask, old, ref, adv):
    """The same losses through `flashgrpo.torch` (logits `[N, V]` as `[1, N, V]` for GRPO, whose
    per-sequence advantages are then one per row: `[N, 1, V]`)."""
    import torch
    import flashgrpo.torch as ft

    n, v = logits.shape
    in_place = args.framework == "flashgrpo-torch-inplace"
    x = logits.detach().clone().requires_grad_(True)
    pristine = logits.detach()

    def f():
        if args.op == "grpo":
            return ft.grpo_loss(x.view(n, 1, v), ids.view(n, 1), adv, mask.view(n, 1), old_logp=old.view(n, 1),
                                ref_logp=ref.view(n, 1), in_place=in_place, beta=BETA, epsilon_low=EPS_LOW,
                                epsilon_high=EPS_HIGH, loss_type="dapo").loss
        if args.op == "cross_entropy":
            return ft.cross_entropy(x, torch.where(mask > 0, ids, -100), in_place=in_place)
        return (ft.logprob(x, ids, in_place=in_place) * mask).sum()

    def step():
        if in_place:
            with torch.no_grad():
                x.copy_(pristine)  # restores the logits the previous step overwrote
        x.grad = None
        start = time.perf_counter()
        loss = f()
        loss.backward()
        return float(loss.detach()), time.perf_counter() - start

    return step, logits.numel() * logits.element_size(), 0 if in_place else logits.numel() * logits.element_size()


def jax_arrays_step(args):
    """`flashgrpo.arrays` on JAX arrays (read in place; the gradient is a NumPy array)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import flashgrpo.arrays as fa

    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[args.dtype]
    n, v = args.n, args.vocab
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    logits = (jax.random.normal(k[0], (n, v)) * LOGIT_STD).astype(dtype).block_until_ready()
    ids = np.asarray(jax.random.randint(k[1], (n,), 0, v))
    base = np.asarray(jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), ids[:, None], -1)[:, 0])
    old = base + 0.3 * np.asarray(jax.random.normal(k[2], (n,)))
    ref = base + 0.3 * np.asarray(jax.random.normal(k[3], (n,)))
    adv = np.asarray(jax.random.normal(k[4], (n,)))
    mask = np.asarray(jax.random.uniform(k[5], (n,)) > 0.1, dtype=np.float32)
    out = np.empty(logits.shape, dtype=logits.dtype)
    out.fill(0)
    rows3 = logits.reshape(n, 1, v).block_until_ready()  # GRPO's [B, T, V] with B = N, made once

    def step():
        if args.op == "grpo":
            r = fa.loss("grpo", rows3, ids.reshape(n, 1), adv, mask.reshape(n, 1),
                        old_logp=old.reshape(n, 1), ref_logp=ref.reshape(n, 1), out=out.reshape(n, 1, v),
                        beta=BETA, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, loss_type="dapo")
        elif args.op == "cross_entropy":
            r = fa.loss("cross_entropy", logits, np.where(mask > 0, ids, -100), out=out)
        else:
            r = fa.loss("logprob", logits, ids, mask=mask, out=out)
        return r["loss"]

    return step, logits.size * logits.dtype.itemsize, out.nbytes


def flashgrpo_jax_step(args):
    """`flashgrpo.jax.grpo_loss` (XLA FFI custom calls) under `jax.jit(jax.value_and_grad)`, on the
    inputs of `jax_step`."""
    import jax
    import jax.numpy as jnp
    import flashgrpo.jax as fj

    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[args.dtype]
    n, v = args.n, args.vocab
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    logits = (jax.random.normal(k[0], (n, v)) * LOGIT_STD).astype(dtype).reshape(n, 1, v)
    ids = jax.random.randint(k[1], (n, 1), 0, v)
    base = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), ids[..., None], -1)[..., 0]
    old = base + 0.3 * jax.random.normal(k[2], (n, 1))
    ref = base + 0.3 * jax.random.normal(k[3], (n, 1))
    adv = jax.random.normal(k[4], (n,))
    mask = (jax.random.uniform(k[5], (n, 1)) > 0.1).astype(jnp.float32)
    if args.op != "grpo":
        raise SystemExit("flashgrpo-jax times grpo")
    in_place = args.framework == "flashgrpo-jax-inplace"
    loss_fn = jax.value_and_grad(lambda x: fj.grpo_loss(x, ids, adv, mask, old_logp=old, ref_logp=ref, beta=BETA,
                                                        epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
                                                        in_place=in_place))
    f = jax.jit(loss_fn, donate_argnums=0 if in_place else ())
    copy = jax.jit(lambda x: x + 0)

    def step():
        if not in_place:
            loss, grad = f(logits)
            grad.block_until_ready()
            return float(loss)
        work = copy(logits).block_until_ready()  # donated below: a fresh copy each step, untimed
        start = time.perf_counter()
        loss, grad = f(work)
        grad.block_until_ready()
        return float(loss), time.perf_counter() - start

    return step, logits.size * logits.dtype.itemsize, logits.size * logits.dtype.itemsize


def jax_step(args):
    import jax
    import jax.numpy as jnp

    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[args.dtype]
    n, v = args.n, args.vocab
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    logits = (jax.random.normal(k[0], (n, v)) * LOGIT_STD).astype(dtype)
    ids = jax.random.randint(k[1], (n,), 0, v)
    base = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), ids[:, None], -1)[:, 0]
    old = base + 0.3 * jax.random.normal(k[2], (n,))
    ref = base + 0.3 * jax.random.normal(k[3], (n,))
    adv = jax.random.normal(k[4], (n,))
    mask = (jax.random.uniform(k[5], (n,)) > 0.1).astype(jnp.float32)

    def logp_of(logits):
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return jnp.take_along_axis(lp, ids[:, None], axis=-1)[:, 0]

    def grpo(logits):
        logp = logp_of(logits)
        ratio = jnp.exp(logp - old)
        per = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * adv)
        kl = jnp.exp(ref - logp) - (ref - logp) - 1
        return ((per + BETA * kl) * mask).sum() / mask.sum()

    def cross_entropy(logits):
        return -(logp_of(logits) * mask).sum() / mask.sum()

    def logprob(logits):
        return (logp_of(logits) * mask).sum()

    f = jax.jit(jax.value_and_grad({"grpo": grpo, "cross_entropy": cross_entropy, "logprob": logprob}[args.op]))

    def step():
        loss, grad = f(logits)
        grad.block_until_ready()
        return float(loss)

    return step, logits.size * logits.dtype.itemsize, logits.size * logits.dtype.itemsize


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--framework", required=True, choices=["torch-eager", "torch-compile", "jax", "liger",
                                                          "flashgrpo-torch", "flashgrpo-torch-inplace",
                                                          "flashgrpo-jax-arrays", "flashgrpo-jax",
                                                          "flashgrpo-jax-inplace"])
    p.add_argument("--op", default="grpo", choices=["grpo", "cross_entropy", "logprob"])
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--hidden", type=int, help="fused-linear mode: GRPO from hidden states [N, H] and an lm_head [V, H]")
    args = p.parse_args()
    if args.hidden:
        if args.op != "grpo" or args.framework not in ("torch-eager", "torch-compile", "liger", "flashgrpo-torch"):
            p.error("--hidden times GRPO in torch-eager, torch-compile, liger or flashgrpo-torch")
        step, input_bytes, grad_bytes = torch_linear_step(args)
    elif args.framework == "liger":
        p.error("liger is timed in fused-linear mode (--hidden)")
    elif args.framework == "flashgrpo-jax-arrays":
        step, input_bytes, grad_bytes = jax_arrays_step(args)
    elif args.framework in ("flashgrpo-jax", "flashgrpo-jax-inplace"):
        step, input_bytes, grad_bytes = flashgrpo_jax_step(args)
    else:
        step, input_bytes, grad_bytes = (jax_step if args.framework == "jax" else torch_step)(args)
    reset_peak_rss()
    rss_before = status_bytes("VmRSS:")
    times, loss = [], None
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        loss = step()
        elapsed = time.perf_counter() - start
        if isinstance(loss, tuple):  # the step timed itself (it restores its inputs first)
            loss, elapsed = loss
        if i >= args.warmup:
            times.append(elapsed)
    times.sort()
    print(json.dumps({
        "framework": args.framework, "op": args.op, "n": args.n, "vocab": args.vocab, "dtype": args.dtype,
        "step_s_p50": statistics.median(times), "step_s_min": times[0], "loss": loss,
        "hidden": args.hidden, "input_bytes": input_bytes, "grad_bytes": grad_bytes, "rss_before_steps_bytes": rss_before,
        "peak_rss_bytes": status_bytes("VmHWM:"),
    }))


if __name__ == "__main__":
    main()

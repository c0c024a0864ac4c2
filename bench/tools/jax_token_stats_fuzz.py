"""Random cases of `flashgrpo.jax.token_stats` / `fused_linear_token_stats` against float64 PyTorch
autograd through materialised logits (the helpers of tests/python/test_jax_token_stats.py): ragged
V from 1 to 4,097, H from 1 to 33, random dtype, temperature, soft cap, mask density, used outputs
and chunk budget, under `jit`.
Usage: SEED=7 CASES=120 OMP_NUM_THREADS=1 .venv-peers/bin/python bench/tools/jax_token_stats_fuzz.py
Prints "N checks, 0 failures"."""

import os
import random
import sys

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(root, "tests", "python"))
sys.path.insert(0, os.path.join(root, "tests", "peers"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import test_jax_token_stats as t  # noqa: E402
import torch  # noqa: E402
from loss_cli import report  # noqa: E402


def logits_case(rng, B, T, V, dtype, temp, cap, mask, targets, ups):
    """Ours and the reference over logits: outputs, gradients, reference gradients, tolerance."""
    x = t.as_dtype(torch.randn(B, T, V) * 3, dtype)
    r = x.double().requires_grad_(True)
    want = t.reference_stats(r, targets, temp, cap)
    t.weighted(want, ups, mask).backward()

    def ours(xx):
        s = t.fj.token_stats(xx, jnp.asarray(targets.numpy()), t.to_jax(mask), temperature=temp, softcap=cap)
        return t.jax_weighted(s, ups), s

    (_, got), grad = jax.jit(jax.value_and_grad(ours, has_aux=True))(t.to_jax(x, dtype))
    return got, want, (grad,), (r.grad,), 2 * t.grad_tol(dtype)


def linear_case(rng, B, T, V, dtype, temp, cap, mask, targets, ups):
    """Ours and the reference from hidden states and lm_head (a bias or not, a random budget)."""
    hidden, weight, bias = t.linear_inputs(B, T, rng.choice([1, 5, 16, 33]), V, rng.random() < 0.5)
    hidden, weight = t.as_dtype(hidden, dtype), t.as_dtype(weight, dtype)
    bias = None if bias is None else t.as_dtype(bias, dtype)
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    b64 = None if bias is None else bias.double().requires_grad_(True)
    want = t.reference_stats(h64 @ w64.T + (0 if b64 is None else b64), targets, temp, cap)
    t.weighted(want, ups, mask).backward()
    budget = rng.choice([1, 64])

    def ours(h, w, b):
        s = t.fj.fused_linear_token_stats(h, w, jnp.asarray(targets.numpy()), bias=b, mask=t.to_jax(mask),
                                          temperature=temp, softcap=cap, chunk_memory_mb=budget)
        return t.jax_weighted(s, ups), s

    args = (t.to_jax(hidden, dtype), t.to_jax(weight, dtype), t.to_jax(bias, dtype))
    (_, got), grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2), has_aux=True))(*args)
    refs = (h64.grad, w64.grad, None if b64 is None else b64.grad)
    return got, want, grads, refs, 1e-4 if dtype == "f32" else 3e-2


def main():
    rng = random.Random(int(os.environ.get("SEED", "7")))
    torch.manual_seed(rng.randrange(1 << 30))
    for case in range(int(os.environ.get("CASES", "80"))):
        B, T, V = rng.randint(1, 4), rng.randint(1, 6), rng.choice([1, 2, 3, 17, 64, 129, 1000, 4097])
        dtype, temp = rng.choice(["f32", "bf16", "f16"]), rng.choice([1.0, 0.6, 1.7])
        cap = rng.choice([None, None, 2.0, 30.0])
        used, linear = rng.choice(t.USED), rng.random() < 0.4
        mask = (torch.rand(B, T) > rng.random() * 0.8).float()
        targets = torch.randint(0, V, (B, T))
        ups = t.upstreams((B, T), used)
        run = linear_case if linear else logits_case
        got, want, grads, refs, tol = run(rng, B, T, V, dtype, temp, cap, mask, targets, ups)
        name = f"case {case} linear={linear} B={B} T={T} V={V} {dtype} T={temp} cap={cap} {'+'.join(used)}"
        value_tol = 2e-2 if linear and dtype != "f32" else 1e-5
        for k, g, w in zip(t.fj.TOKEN_STATS, got, want):
            t.close(name, k, t.to_torch(g), w.detach() * mask.double(), value_tol)
        for g, r in zip(grads, refs):
            if r is not None:
                t.close_norm(name, "grad", t.to_torch(g), r, tol)
    sys.exit(report("jax token stats fuzz"))


if __name__ == "__main__":
    main()

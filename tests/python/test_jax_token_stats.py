"""`flashgrpo.jax.token_stats` and `fused_linear_token_stats`: each token's log-probability,
entropy and log-sum-exp, all differentiable with their own cotangents, under `jit`, `grad` and
`vmap`; `entropy` and `fused_linear_entropy`, differentiable per token. Reference: float64
PyTorch autograd through materialised logits (test_token_stats.py's). Prints "N checks, 0
failures"."""

import itertools
import os
import sys

import jax

jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "peers"))
sys.path.insert(0, here)

import flashgrpo.jax as fj  # noqa: E402
from crosscheck import as_dtype, grad_tol, linear_inputs  # noqa: E402
from loss_cli import CHECKS, FAILURES, close, close_norm, expect_error, report  # noqa: E402
from test_token_stats import USED, linear_case, reference_stats, upstreams, weighted  # noqa: E402

torch.manual_seed(1)
JAX_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def to_jax(x, dtype="f32"):
    """A torch tensor (exactly representable in `dtype`) as a JAX array of `dtype`."""
    return None if x is None else jnp.asarray(x.float().numpy(), dtype=JAX_DTYPES[dtype])


def to_torch(x):
    return torch.from_numpy(np.asarray(jnp.asarray(x, jnp.float32)).astype(np.float64))


def jax_weighted(stats, ups):
    """`sum_k sum_i up_k[i] * stats_k[i]` in JAX over the outputs with an upstream."""
    total = jnp.float32(0.0)
    for out, up in zip(stats, ups):
        if up is not None:
            total = total + (out * to_jax(up)).sum()
    return total


def check_logits():
    """Each output's value and the logits' gradient through any combination of the three, with a
    mask, a temperature, a soft cap, `[B, T, V]` and `[N, V]`, every dtype, under `jit`."""
    grid = [((2, 5, 40), 1.0, None, "f32"), ((1, 3, 3001), 0.7, None, "bf16"), ((2, 4, 97), 0.9, 3.0, "f32"),
            ((3, 2, 2049), 1.0, None, "f16"), ((7, 1, 33), 1.3, None, "f32"), ((6, 50), 1.0, None, "f32")]
    for (shape, temp, cap, dtype), used in itertools.product(grid, USED):
        *rows, V = shape
        logits = as_dtype(torch.randn(*shape) * 2.5, dtype)
        targets = torch.randint(0, V, rows)
        mask = (torch.rand(*rows) > 0.3).float()
        ups = upstreams(tuple(rows), used)
        r = logits.double().requires_grad_(True)
        want = reference_stats(r, targets, temp, cap)
        weighted(want, ups, mask).backward()

        def ours(x):
            stats = fj.token_stats(x, jnp.asarray(targets.numpy()), to_jax(mask), temperature=temp, softcap=cap)
            return jax_weighted(stats, ups), stats

        (_, got), grad = jax.jit(jax.value_and_grad(ours, has_aux=True))(to_jax(logits, dtype))
        case = f"jax token_stats {list(shape)} T={temp} softcap={cap} {dtype} through {'+'.join(used)}"
        for name, g, w in zip(fj.TOKEN_STATS, got, want):
            close(case, name, to_torch(g), w.detach() * mask.double(), 1e-5)
        close_norm(case, "grad", to_torch(grad), r.grad, grad_tol(dtype))
        CHECKS[0] += 1
        if grad.dtype != JAX_DTYPES[dtype]:
            FAILURES.append(f"{case}: gradient dtype {grad.dtype}, expected {JAX_DTYPES[dtype]}")


def check_fused_linear():
    """The three outputs and the gradients of hidden, weight and bias for each combination of used
    outputs (bf16 with each products' way), against float64 materialised logits."""
    B, T, H, V = 3, 5, 24, 70
    grid = [(True, 1.0, "f32", None), (False, 0.8, "f32", None), (True, 1.0, "bf16", "rounded"),
            (False, 1.0, "bf16", "widened"), (True, 0.9, "f16", None)]
    for (with_bias, temp, dtype, way), used in itertools.product(grid, USED):
        (hidden, weight, bias), targets, mask, ups, want, want_grads = linear_case(B, T, H, V, with_bias, dtype,
                                                                                  temp, used)

        def ours(h, w, b):
            stats = fj.fused_linear_token_stats(h, w, jnp.asarray(targets.numpy()), bias=b, mask=to_jax(mask),
                                                temperature=temp, chunk_memory_mb=1, bf16_products=way)
            return jax_weighted(stats, ups), stats

        args = (to_jax(hidden, dtype), to_jax(weight, dtype), to_jax(bias, dtype))
        try:
            (_, got), grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2), has_aux=True))(*args)
            jax.block_until_ready(grads)
        except Exception as e:  # noqa: BLE001 - a machine without a rounded way refuses it, naming the key
            CHECKS[0] += 1
            if way != "rounded" or "bf16_products" not in str(e):
                FAILURES.append(f"jax fused_linear_token_stats {dtype} {way}: {e}")
            continue
        case = f"jax fused_linear_token_stats bias={with_bias} T={temp} {dtype} {way} through {'+'.join(used)}"
        tol = 1e-4 if dtype == "f32" else 2e-2
        for name, g, w in zip(fj.TOKEN_STATS, got, want):
            close(case, name, to_torch(g), w, 1e-5 if dtype == "f32" else 1e-2)
        for name, g, w in zip(("grad_hidden", "grad_weight", "grad_bias"), grads, want_grads):
            if w is not None:
                close_norm(case, name, to_torch(g), w, tol)


def check_entropy():
    """`entropy` and `fused_linear_entropy` with a per-token cotangent, a mask, a temperature and a
    soft cap: values and gradients."""
    for (B, T, V), temp, cap, dtype in [((2, 5, 40), 1.0, None, "f32"), ((1, 4, 1001), 0.7, 5.0, "bf16"),
                                        ((3, 2, 257), 1.2, None, "f16")]:
        logits = as_dtype(torch.randn(B, T, V) * 2.5, dtype)
        mask = (torch.rand(B, T) > 0.3).float()
        up = torch.randn(B, T)
        r = logits.double().requires_grad_(True)
        want = reference_stats(r, torch.zeros(B, T, dtype=torch.int64), temp, cap)[1]
        (want * up.double() * mask.double()).sum().backward()
        value, grad = jax.jit(jax.value_and_grad(
            lambda x: (fj.entropy(x, to_jax(mask), temperature=temp, softcap=cap) * to_jax(up)).sum()))(
            to_jax(logits, dtype))
        case = f"jax entropy [{B}, {T}, {V}] T={temp} softcap={cap} {dtype}"
        close(case, "weighted value", to_torch(value), (want * up.double() * mask.double()).sum().detach(), 1e-5)
        close_norm(case, "grad", to_torch(grad), r.grad, grad_tol(dtype))
    hidden, weight, bias = linear_inputs(2, 3, 16, 60, True)
    up, mask = torch.randn(2, 3), (torch.rand(2, 3) > 0.3).float()
    h64, w64, b64 = (x.double().requires_grad_(True) for x in (hidden, weight, bias))
    want = reference_stats(h64 @ w64.T + b64, torch.zeros(2, 3, dtype=torch.int64), 0.9)[1]
    (want * up.double() * mask.double()).sum().backward()
    grads = jax.jit(jax.grad(lambda h, w, b: (fj.fused_linear_entropy(h, w, bias=b, mask=to_jax(mask), temperature=0.9)
                                              * to_jax(up)).sum(), argnums=(0, 1, 2)))(
        to_jax(hidden), to_jax(weight), to_jax(bias))
    for name, g, w in zip(["grad_hidden", "grad_weight", "grad_bias"], grads, (h64.grad, w64.grad, b64.grad)):
        close_norm("jax fused_linear_entropy", name, to_torch(g), w, 1e-4)


def check_vmap():
    """Under `vmap(grad)`, each mapped problem its own call: the same as one call per problem."""
    hidden, weight, _ = linear_inputs(2, 4, 16, 50, False)
    targets = jnp.asarray(torch.randint(0, 50, (2, 4)).numpy())
    stacked = jnp.stack([to_jax(hidden), to_jax(hidden) * 0.5])
    w = to_jax(weight)

    def value(h):
        stats = fj.fused_linear_token_stats(h, w, targets)
        return stats.logp.sum() - 0.3 * stats.entropy.sum() + 0.1 * (stats.lse**2).sum()

    mapped = jax.vmap(jax.grad(value))(stacked)
    for i in range(2):
        close_norm("jax fused_linear_token_stats under vmap(grad)", f"problem {i}", to_torch(mapped[i]),
                   to_torch(jax.grad(value)(stacked[i])), 1e-6)
    logits = jnp.stack([to_jax(torch.randn(3, 20)), to_jax(torch.randn(3, 20))])
    ids = jnp.asarray(torch.randint(0, 20, (3,)).numpy())
    mapped = jax.vmap(jax.grad(lambda x: fj.token_stats(x, ids).entropy.sum()))(logits)
    for i in range(2):
        r = torch.from_numpy(np.asarray(logits[i], np.float64)).requires_grad_(True)
        reference_stats(r, torch.from_numpy(np.asarray(ids, np.int64)), 1.0)[1].sum().backward()
        close_norm("jax token_stats under vmap(grad)", f"problem {i}", to_torch(mapped[i]), r.grad, 1e-5)


def check_edges():
    """No rows; every row masked; errors that name the input."""
    empty = fj.token_stats(jnp.zeros((0, 7)), jnp.zeros((0,), jnp.int32))
    grad = jax.grad(lambda x: fj.token_stats(x, jnp.zeros((0,), jnp.int32)).lse.sum())(jnp.zeros((0, 7)))
    CHECKS[0] += 1
    if any(s.shape != (0,) for s in empty) or grad.shape != (0, 7):
        FAILURES.append(f"jax token_stats over no rows: shapes {[s.shape for s in empty]}, grad {grad.shape}")
    logits, ids = jnp.asarray(torch.randn(2, 3, 9).numpy()), jnp.zeros((2, 3), jnp.int32)
    masked = jax.value_and_grad(lambda x: sum(s.sum() for s in fj.token_stats(x, ids, jnp.zeros((2, 3)))))(logits)
    CHECKS[0] += 1
    if float(masked[0]) != 0.0 or float(jnp.abs(masked[1]).sum()) != 0.0:
        FAILURES.append("jax token_stats, every row masked: outputs or gradient not zero")
    expect_error("jax token_stats, float targets", TypeError, ["targets"],
                 lambda: fj.token_stats(logits, jnp.zeros((2, 3))))
    expect_error("jax token_stats, targets of another shape", ValueError, ["targets", "[2, 2]"],
                 lambda: fj.token_stats(logits, jnp.zeros((2, 2), jnp.int32)))
    bad = ids.at[1, 2].set(9)
    expect_error("jax token_stats, a target out of range", Exception, ["target", "9"],
                 lambda: jax.block_until_ready(fj.token_stats(logits, bad)))
    expect_error("jax token_stats, an option of the wrong type", Exception, ["softcap"],
                 lambda: fj.token_stats(logits, ids, softcap="x"))
    expect_error("jax fused_linear_token_stats, weight of another H", ValueError, ["weight", "hidden"],
                 lambda: fj.fused_linear_token_stats(jnp.zeros((4, 8)), jnp.zeros((9, 5)), jnp.zeros((4,), jnp.int32)))


def main():
    torch.set_num_threads(1)
    check_logits()
    check_fused_linear()
    check_entropy()
    check_vmap()
    check_edges()
    sys.exit(report("jax token stats"))


if __name__ == "__main__":
    main()

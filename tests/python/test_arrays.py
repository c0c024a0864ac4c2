"""flashgrpo.arrays on NumPy and JAX CPU arrays (float32, bfloat16, float16) against the float64
PyTorch references of tests/peers/crosscheck.py; the gradient written into a caller's buffer and
over a NumPy logits array. Prints "N checks, 0 failures"."""

import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peers"))

import flashgrpo.arrays as fa  # noqa: E402
import flashgrpo.jax  # noqa: E402
from crosscheck import grpo_options, linear_inputs, materialised, trl_grpo  # noqa: E402
from loss_cli import CHECKS, FAILURES, close, close_norm, expect_error, report  # noqa: E402

NP_DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}


def to_torch(a):
    return torch.from_numpy(np.asarray(a, dtype=np.float64))


def check_grpo():
    rng = np.random.default_rng(0)
    for (B, T, V), dtype, framework in [((3, 6, 48), "f32", "numpy"), ((2, 9, 131), "bf16", "numpy"),
                                        ((2, 4, 77), "f16", "numpy"), ((3, 6, 48), "f32", "jax"),
                                        ((2, 5, 300), "bf16", "jax")]:
        logits = (rng.standard_normal((B, T, V)) * 2.5).astype(NP_DTYPES[dtype])
        targets = rng.integers(0, V, (B, T))
        mask = (rng.random((B, T)) > 0.25).astype(np.float32)
        mask[:, 0] = 1
        adv = rng.standard_normal(B).astype(np.float32)
        old = rng.standard_normal((B, T)).astype(np.float32) - 4
        ref = rng.standard_normal((B, T)).astype(np.float32) - 4
        o = grpo_options(loss_type="dapo")
        want = trl_grpo(to_torch(logits), torch.from_numpy(targets), torch.from_numpy(mask), torch.from_numpy(adv),
                        torch.from_numpy(old), torch.from_numpy(ref), None, o)
        x = jnp.asarray(logits) if framework == "jax" else logits
        out = fa.loss("grpo", x, targets, adv, mask, old_logp=old, ref_logp=ref, grad=True, beta=o["beta"],
                      epsilon_high=o["epsilon_high"])
        case = f"arrays grpo {framework} {dtype} B={B} T={T} V={V}"
        close(case, "loss", torch.tensor(out["loss"]), want["loss"], 1e-5)
        for name in ["per_token_loss", "logp", "entropy", "kl"]:
            close(case, name, torch.from_numpy(out[name]), want[name], 1e-5, torch.from_numpy(mask))
        tol = 1e-5 if dtype == "f32" else 1e-2
        close_norm(case, "grad", to_torch(out["grad"]), want["grad"], tol)
        CHECKS[0] += 1
        if out["grad"].dtype != logits.dtype:
            FAILURES.append(f"{case}: grad dtype {out['grad'].dtype}")
        if framework == "numpy":
            # The gradient into a buffer of the caller's, then over the logits themselves.
            buffer = np.zeros_like(logits)
            fa.loss("grpo", logits, targets, adv, mask, old_logp=old, ref_logp=ref, out=buffer, beta=o["beta"],
                    epsilon_high=o["epsilon_high"])
            close_norm(case, "grad into out=", to_torch(buffer), want["grad"], tol)
            overwritten = logits.copy()
            res = fa.loss("grpo", overwritten, targets, adv, mask, old_logp=old, ref_logp=ref, in_place=True,
                          beta=o["beta"], epsilon_high=o["epsilon_high"])
            CHECKS[0] += 1
            if res["grad"] is not overwritten:
                FAILURES.append(f"{case}: in_place returned another array")
            close_norm(case, "grad over the logits", to_torch(overwritten), want["grad"], tol)


def check_cross_entropy_and_linear():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((13, 1000)).astype(np.float32)
    targets = rng.integers(0, 1000, 13)
    targets[2] = -100
    for framework in ["numpy", "jax"]:
        x = jnp.asarray(logits) if framework == "jax" else logits
        out = fa.loss("cross_entropy", x, targets, grad=True, label_smoothing=0.1)
        r = to_torch(logits).requires_grad_(True)
        want = torch.nn.functional.cross_entropy(r, torch.from_numpy(targets), label_smoothing=0.1)
        want.backward()
        case = f"arrays cross_entropy {framework}"
        close(case, "loss", torch.tensor(out["loss"]), want.detach(), 1e-5)
        close_norm(case, "grad", to_torch(out["grad"]), r.grad, 1e-5)
        # `predicted_tokens=True`: each row's first argmax, int64, -1 on the ignored row.
        tokens = fa.loss("cross_entropy", x, targets, predicted_tokens=True).get("predicted_tokens")
        want_tokens = np.where(targets != -100, logits.argmax(-1), -1)
        CHECKS[0] += 1
        if tokens is None or tokens.dtype != np.int64 or not np.array_equal(tokens, want_tokens):
            FAILURES.append(f"{case}: predicted_tokens {tokens} vs {want_tokens}")
    torch.manual_seed(2)
    hidden, weight, bias = linear_inputs(2, 5, 16, 90, True)
    t = torch.randint(0, 90, (2, 5))
    adv = torch.randn(2)
    h, w, b, lg = materialised(hidden, weight, bias)
    o = grpo_options(beta=0.0)
    want = trl_grpo(lg.detach(), t, torch.ones(2, 5), adv, None, None, None, o)
    lg.backward(want["grad"])
    for framework in ["numpy", "jax"]:
        conv = (lambda a: jnp.asarray(a.numpy())) if framework == "jax" else (lambda a: a.numpy())
        out = fa.linear_loss("grpo", conv(hidden), conv(weight), t.numpy(), adv.numpy(), bias=conv(bias), grad=True,
                             beta=0.0, epsilon_high=0.28, chunk_memory_mb=1)
        case = f"arrays linear grpo {framework}"
        close(case, "loss", torch.tensor(out["loss"]), want["loss"], 1e-4)
        close_norm(case, "grad_hidden", to_torch(out["grad_hidden"]), h.grad, 1e-4)
        close_norm(case, "grad_weight", to_torch(out["grad_weight"]), w.grad, 1e-4)
        close_norm(case, "grad_bias", to_torch(out["grad_bias"]), b.grad, 1e-4)
        tokens = fa.linear_loss("entropy", conv(hidden), conv(weight), bias=conv(bias), predicted_tokens=True,
                                chunk_memory_mb=1)["predicted_tokens"]
        CHECKS[0] += 1
        if not np.array_equal(tokens, lg.detach().argmax(-1).numpy()):
            FAILURES.append(f"{case}: predicted_tokens {tokens} vs {lg.argmax(-1)}")


def check_errors():
    CHECKS[0] += 1
    try:
        fa.loss("grpo", jnp.zeros((1, 2, 5)), np.zeros((1, 2), np.int64), np.zeros(1), in_place=True)
        FAILURES.append("in_place on a JAX array: no error")
    except ValueError as e:
        if "JAX" not in str(e):
            FAILURES.append(f"in_place on a JAX array: {e}")
    CHECKS[0] += 1
    try:
        fa.loss("softmax", np.zeros((1, 2, 5), np.float32))
        FAILURES.append("unknown op: no error")
    except ValueError as e:
        if "softmax" not in str(e):
            FAILURES.append(f"unknown op: {e}")
    logits, targets = np.zeros((4, 5), np.float32), np.array([0, 1, 2, 3])
    expect_error("arrays float targets", TypeError, ["targets", "integer"],
                 lambda: fa.loss("cross_entropy", logits, targets + 0.7))
    expect_error("arrays out= with in_place", ValueError, ["out", "in_place"],
                 lambda: fa.loss("cross_entropy", logits.copy(), targets, in_place=True, out=np.zeros_like(logits)))
    expect_error("predicted_tokens through flashgrpo.jax", NotImplementedError, ["predicted_tokens", "flashgrpo.jax"],
                 lambda: flashgrpo.jax.cross_entropy(jnp.asarray(logits), jnp.asarray(targets), predicted_tokens=True))


def main():
    jax.config.update("jax_platforms", "cpu")
    check_grpo()
    check_cross_entropy_and_linear()
    check_errors()
    sys.exit(report("flashgrpo.arrays"))


if __name__ == "__main__":
    main()

"""flashgrpo.jax (XLA FFI custom calls) against plain JAX reference code (`jax.nn.log_softmax` in
float32, as the original system's reference), under `jit`, `grad` and `vmap`, within LOSSES.md's
tolerances; then the original's gradcheck at its shape (GRPO, dapo, beta 0.04, B=1, T=129,
V=151936, off-policy, 10% masked rows) from Python. Prints "N checks, 0 failures"."""

import os
import sys

import jax

jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peers"))

import flashgrpo.jax as fj  # noqa: E402
from checks import CHECKS, FAILURES, expect_error  # noqa: E402


def close(case, name, got, want, tol, mask=None):
    """Elementwise |got - want| <= tol * max(1, |want|)."""
    CHECKS[0] += 1
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.abs(got.reshape(want.shape) - want) / np.maximum(1.0, np.abs(want))
    if mask is not None:
        err = err[np.asarray(mask, bool)]
    worst = float(err.max()) if err.size else 0.0
    if not worst <= tol:
        FAILURES.append(f"{case}: {name} worst scaled error {worst:.3e} > {tol:.0e}")
    return worst


def close_norm(case, name, got, want, tol):
    CHECKS[0] += 1
    got, want = np.asarray(got, np.float64).reshape(np.shape(want)), np.asarray(want, np.float64)
    norm = np.linalg.norm(want)
    err = np.linalg.norm(got - want) / (norm if norm > 0 else 1.0)
    if not err <= tol:
        FAILURES.append(f"{case}: {name} relative norm error {err:.3e} > {tol:.0e}")
    return err


def reference_grpo(logits, targets, mask, adv, old, ref, beta=0.04, eps_low=0.2, eps_high=0.28, temperature=1.0,
                   loss_type="dapo"):
    """TRL's / the original's GRPO loss in plain JAX, float32."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    logp = jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]
    old_ = jax.lax.stop_gradient(logp) if old is None else old
    ratio = jnp.exp(logp - old_)
    a = adv[:, None]
    per = -jnp.minimum(ratio * a, jnp.clip(ratio, 1 - eps_low, 1 + eps_high) * a)
    if beta != 0.0:
        per = per + beta * (jnp.exp(ref - logp) - (ref - logp) - 1)
    if loss_type == "grpo":
        return ((per * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0)).mean()
    return (per * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def inputs(key, B, T, V, dtype=jnp.float32, std=2.5):
    k = jax.random.split(key, 6)
    logits = (jax.random.normal(k[0], (B, T, V)) * std).astype(dtype)
    targets = jax.random.randint(k[1], (B, T), 0, V)
    mask = (jax.random.uniform(k[2], (B, T)) > 0.25).astype(jnp.float32).at[:, 0].set(1.0)
    adv = jax.random.normal(k[3], (B,))
    true = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), targets[..., None], -1)[..., 0]
    old = true + 0.3 * jax.random.normal(k[4], (B, T))
    ref = true + 0.3 * jax.random.normal(k[5], (B, T))
    return logits, targets, mask, adv, old, ref


def check_grpo():
    for (B, T, V), dtype, loss_type, temperature in [((3, 6, 48), jnp.float32, "dapo", 1.0),
                                                     ((2, 9, 131), jnp.float32, "grpo", 0.8),
                                                     ((2, 5, 1000), jnp.bfloat16, "dapo", 1.0)]:
        logits, targets, mask, adv, old, ref = inputs(jax.random.PRNGKey(B * T), B, T, V, dtype)
        case = f"jax grpo {loss_type} B={B} T={T} V={V} {dtype.__name__} temperature={temperature}"
        opts = dict(beta=0.04, epsilon_high=0.28, loss_type=loss_type, temperature=temperature)

        def ours(x):
            return fj.grpo_loss(x, targets, adv, mask, old_logp=old, ref_logp=ref, **opts)

        def theirs(x):
            return reference_grpo(x, targets, mask, adv, old, ref, loss_type=loss_type, temperature=temperature)

        loss, grad = jax.jit(jax.value_and_grad(ours))(logits)
        want_loss, want_grad = jax.jit(jax.value_and_grad(theirs))(logits)
        close(case, "loss (jit, value_and_grad)", loss, want_loss, 1e-5)
        close_norm(case, "grad", grad.astype(jnp.float32), want_grad.astype(jnp.float32),
                   1e-5 if dtype == jnp.float32 else 1e-2)
        CHECKS[0] += 1
        if grad.dtype != logits.dtype:
            FAILURES.append(f"{case}: gradient dtype {grad.dtype}")
        # Forward only, with the per-token outputs.
        loss2, outs = fj.grpo_loss(logits, targets, adv, mask, old_logp=old, ref_logp=ref, return_outputs=True,
                                   **opts)
        close(case, "loss (forward only)", loss2, want_loss, 1e-5)
        lp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, -1)
        close(case, "logp", outs["logp"], jnp.take_along_axis(lp, targets[..., None], -1)[..., 0], 1e-5, mask)
        close(case, "entropy", outs["entropy"], -(jnp.exp(lp) * lp).sum(-1), 1e-5, mask)


def check_in_place():
    """`in_place=True`: the same gradient, written into the logits' buffer (donated to `jit`)."""
    logits, targets, mask, adv, old, ref = inputs(jax.random.PRNGKey(5), 2, 7, 300)
    opts = dict(beta=0.04, epsilon_high=0.28)
    want = jax.grad(lambda x: fj.grpo_loss(x, targets, adv, mask, old_logp=old, ref_logp=ref, **opts))(logits)
    f = jax.jit(jax.grad(lambda x: fj.grpo_loss(x, targets, adv, mask, old_logp=old, ref_logp=ref, in_place=True,
                                                 **opts)), donate_argnums=0)
    got = f(logits + 0.0)
    close_norm("jax in_place (donated)", "grad", got, want, 1e-7)
    got = jax.jit(jax.grad(lambda x: fj.cross_entropy(x, targets, in_place=True)))(logits)
    want = jax.grad(lambda x: fj.cross_entropy(x, targets))(logits)
    close_norm("jax in_place (not donated: XLA copies)", "grad", got, want, 1e-7)


def check_cross_entropy_logprob_entropy():
    key = jax.random.PRNGKey(7)
    logits = jax.random.normal(key, (13, 777)) * 2
    targets = jax.random.randint(key, (13,), 0, 777).at[3].set(-100)
    valid = (targets != -100).astype(jnp.float32)

    def ref_ce(x):
        lp = jax.nn.log_softmax(x, -1)
        nll = -jnp.take_along_axis(lp, jnp.maximum(targets, 0)[:, None], -1)[:, 0]
        return (nll * valid).sum() / valid.sum()

    loss, grad = jax.jit(jax.value_and_grad(lambda x: fj.cross_entropy(x, targets)))(logits)
    want, want_grad = jax.value_and_grad(ref_ce)(logits)
    close("jax cross_entropy (mean by default)", "loss", loss, want, 1e-5)
    close_norm("jax cross_entropy", "grad", grad, want_grad, 1e-5)
    # logprob with a per-token cotangent; entropy.
    t2 = jnp.maximum(targets, 0)
    cot = jax.random.normal(jax.random.PRNGKey(8), (13,))

    def ref_logp(x):
        return jnp.take_along_axis(jax.nn.log_softmax(x / 0.7, -1), t2[:, None], -1)[:, 0]

    got, vjp = jax.vjp(lambda x: fj.logprob(x, t2, temperature=0.7), logits)
    want, want_vjp = jax.vjp(ref_logp, logits)
    close("jax logprob", "logp", got, want, 1e-5)
    close_norm("jax logprob", "vjp (per-token cotangent)", vjp(cot)[0], want_vjp(cot)[0], 1e-5)
    lp = jax.nn.log_softmax(logits, -1)
    close("jax entropy", "entropy", fj.entropy(logits), -(jnp.exp(lp) * lp).sum(-1), 1e-5)


def check_edges():
    """Options given as NumPy / JAX scalars, an empty batch (loss 0, zero gradients, as over rows
    that all take no part), and the inputs a JAX user may get wrong, each a clear error."""
    V = 19
    logits = jax.random.normal(jax.random.PRNGKey(3), (5, V))
    targets = jnp.array([0, 3, 18, 7, 7])
    plain = fj.cross_entropy(logits, targets, label_smoothing=float(np.float32(0.1)))  # the scalars' value
    close("jax option as a NumPy scalar", "loss", fj.cross_entropy(logits, targets, label_smoothing=np.float32(0.1)),
          plain, 0.0)
    close("jax option as a JAX scalar", "loss", fj.cross_entropy(logits, targets, label_smoothing=jnp.float32(0.1)),
          plain, 0.0)
    empty_t = jnp.zeros((0,), jnp.int32)
    loss, grad = jax.value_and_grad(lambda x: fj.cross_entropy(x, empty_t))(jnp.zeros((0, V)))
    close("jax cross_entropy over no rows", "loss", loss, 0.0, 0.0)
    CHECKS[0] += 1
    if grad.shape != (0, V):
        FAILURES.append(f"jax cross_entropy over no rows: gradient shape {grad.shape}")
    close("jax grpo_loss over no rows", "loss",
          fj.grpo_loss(jnp.zeros((0, 4, V)), jnp.zeros((0, 4), jnp.int32), jnp.zeros((0,))), 0.0, 0.0)
    h_grad, w_grad = jax.grad(lambda h, w: fj.fused_linear_cross_entropy(h, w, empty_t), argnums=(0, 1))(
        jnp.zeros((0, 8)), jnp.ones((V, 8)))
    close("jax fused_linear_cross_entropy over no rows", "grad weight", w_grad, jnp.zeros((V, 8)), 0.0)
    mask = jnp.ones((2, 3))
    expect_error("jax option traced under jit", TypeError, ["num_items", "traced", "jax.jit"],
                 lambda: jax.jit(lambda x, m: fj.grpo_loss(x, jnp.ones((2, 3), jnp.int32), jnp.ones(2), m,
                                                           num_items=m.sum()))(jnp.zeros((2, 3, V)), mask))
    expect_error("jax float targets", TypeError, ["targets", "float32", "integer"],
                 lambda: fj.logprob(logits, targets.astype(jnp.float32)))
    expect_error("jax empty vocabulary", ValueError, ["logits", "empty"],
                 lambda: fj.cross_entropy(jnp.zeros((3, 0)), jnp.zeros((3,), jnp.int32)))


def check_vmap():
    """vmap over a batch of independent losses equals a loop over them, values and gradients."""
    logits, targets, mask, adv, old, ref = inputs(jax.random.PRNGKey(3), 4, 5, 64)
    per_example = jax.jit(jax.vmap(jax.value_and_grad(lambda x, t: fj.cross_entropy(x, t))))
    losses, grads = per_example(logits, targets)
    for i in range(4):
        want, want_grad = jax.value_and_grad(lambda x: fj.cross_entropy(x, targets[i]))(logits[i])
        close("jax vmap cross_entropy", f"loss {i}", losses[i], want, 1e-6)
        close_norm("jax vmap cross_entropy", f"grad {i}", grads[i], want_grad, 1e-6)
    # vmap of GRPO over groups: each group [1, T, V] is its own loss.
    group = jax.vmap(lambda x, t, m, a, o, r: fj.grpo_loss(x[None], t[None], a[None], m[None], old_logp=o[None],
                                                           ref_logp=r[None], beta=0.04, epsilon_high=0.28))
    got = group(logits, targets, mask, adv, old, ref)
    for i in range(4):
        want = reference_grpo(logits[i:i + 1], targets[i:i + 1], mask[i:i + 1], adv[i:i + 1], old[i:i + 1],
                              ref[i:i + 1])
        close("jax vmap grpo", f"group {i}", got[i], want, 1e-5)


def check_fused_linear():
    k = jax.random.split(jax.random.PRNGKey(11), 4)
    B, T, H, V = 2, 5, 16, 90
    hidden = jax.random.normal(k[0], (B, T, H))
    weight = jax.random.normal(k[1], (V, H)) * (2.0 / H**0.5)
    bias = jax.random.normal(k[2], (V,)) * 0.5
    targets = jax.random.randint(k[3], (B, T), 0, V)
    mask = jnp.ones((B, T)).at[1, 3:].set(0.0)
    adv = jnp.array([0.7, -1.2])

    def ours(h, w, b):
        return fj.fused_linear_grpo_loss(h, w, targets, adv, mask, bias=b, beta=0.0, epsilon_high=0.28,
                                         chunk_memory_mb=1)

    def theirs(h, w, b):
        return reference_grpo(h @ w.T + b, targets, mask, adv, None, None, beta=0.0)

    loss, grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2)))(hidden, weight, bias)
    want, want_grads = jax.value_and_grad(theirs, argnums=(0, 1, 2))(hidden, weight, bias)
    close("jax fused_linear_grpo", "loss", loss, want, 1e-5)
    for name, g, w in zip(["hidden", "weight", "bias"], grads, want_grads):
        close_norm("jax fused_linear_grpo", f"grad_{name}", g, w, 1e-4)
    # bf16 inputs with a chosen products' way (the forward and the custom VJP's backward both).
    bf = [x.astype(jnp.bfloat16) for x in (hidden, weight, bias)]
    want, want_grads = jax.value_and_grad(theirs, argnums=(0, 1, 2))(*[x.astype(jnp.float32) for x in bf])
    for way in ["widened", "rounded"]:
        def chosen(h, w, b):
            return fj.fused_linear_grpo_loss(h, w, targets, adv, mask, bias=b, beta=0.0, epsilon_high=0.28,
                                             bf16_products=way).astype(jnp.float32)
        try:
            bl, bg = jax.block_until_ready(jax.jit(jax.value_and_grad(chosen, argnums=(0, 1, 2)))(*bf))
        except Exception as e:  # noqa: BLE001 - a machine without a rounded way refuses it, naming the key
            CHECKS[0] += 1
            if way == "widened" or "bf16_products" not in str(e):
                FAILURES.append(f"jax bf16_products={way}: {e}")
            continue
        close(f"jax fused_linear_grpo bf16_products={way}", "loss", bl, want, 2e-2)
        for name, g, w in zip(["hidden", "weight"], bg, want_grads):
            close_norm(f"jax fused_linear_grpo bf16_products={way}", f"grad_{name}", g.astype(jnp.float32), w, 3e-2)
    # Unnamed, the way is `rounded` where every gradient handed back is bf16 (a machine with a
    # rounded way, FLASHGRPO_BF16_PRODUCTS unset), `auto` with an f32 lm_head: the named way's bits.
    def grads_of(way, h, w, b):
        f = lambda h, w, b: fj.fused_linear_grpo_loss(h, w, targets, adv, mask, bias=b, beta=0.0,  # noqa: E731
                                                      bf16_products=way).astype(jnp.float32)
        return jax.grad(f, argnums=(0, 1, 2))(h, w, b)

    def accepted(way):
        try:
            jax.block_until_ready(grads_of(way, *bf))  # the way is checked when the call runs
            return True
        except Exception:  # noqa: BLE001 - a way this machine lacks, refused naming the key
            return False

    wanted = os.environ.get("FLASHGRPO_BF16_PRODUCTS")  # naming a way this machine has: it decides
    rounded_here = accepted("rounded") and not (wanted and accepted(wanted))
    mixed = (bf[0], weight, bias)
    for case, inputs, way in [("bf16", bf, "rounded" if rounded_here else "auto"), ("f32 lm_head", mixed, "auto")]:
        CHECKS[0] += 1
        got, named = grads_of(None, *inputs), grads_of(way, *inputs)
        if any(not bool(jnp.array_equal(a, b)) for a, b in zip(got, named)):
            FAILURES.append(f"jax default bf16_products, {case}: not the bits of bf16_products={way}")
    ce = jax.grad(lambda h, w: fj.fused_linear_cross_entropy(h, w, targets, label_smoothing=0.1), argnums=(0, 1))

    def ref_ce(h, w):
        lp = jax.nn.log_softmax(h @ w.T, -1)
        nll = -jnp.take_along_axis(lp, targets[..., None], -1)[..., 0]
        return (0.9 * nll - 0.1 * lp.mean(-1)).mean()

    for name, g, w in zip(["hidden", "weight"], ce(hidden, weight), jax.grad(ref_ce, argnums=(0, 1))(hidden, weight)):
        close_norm("jax fused_linear_cross_entropy", f"grad_{name}", g, w, 1e-4)
    lp = jax.nn.log_softmax(hidden @ weight.T + bias, -1)
    close("jax fused_linear_logprob", "logp", fj.fused_linear_logprob(hidden, weight, targets, bias=bias),
          jnp.take_along_axis(lp, targets[..., None], -1)[..., 0], 1e-5)

    # Per-token outputs back-propagated with a per-token cotangent (and under vmap over a batch
    # of such problems): the gradients of sum(g * out) against plain JAX.
    g = jax.random.uniform(jax.random.PRNGKey(5), (B, T))

    def ours_rows(h, w, b):
        logp = fj.fused_linear_logprob(h, w, targets, bias=b, chunk_memory_mb=1)
        ce = fj.fused_linear_cross_entropy(h, w, targets, bias=b, reduction="none", label_smoothing=0.1)
        return (g * logp).sum() + (g[::-1] * ce).sum()

    def theirs_rows(h, w, b):
        lp = jax.nn.log_softmax(h @ w.T + b, -1)
        logp = jnp.take_along_axis(lp, targets[..., None], -1)[..., 0]
        ce = 0.9 * -logp - 0.1 * lp.mean(-1)
        return (g * logp).sum() + (g[::-1] * ce).sum()

    value, grads = jax.jit(jax.value_and_grad(ours_rows, argnums=(0, 1, 2)))(hidden, weight, bias)
    want, want_grads = jax.value_and_grad(theirs_rows, argnums=(0, 1, 2))(hidden, weight, bias)
    close("jax fused-linear per-token outputs", "value", value, want, 1e-5)
    for name, got, w in zip(["hidden", "weight", "bias"], grads, want_grads):
        close_norm("jax fused-linear per-token outputs", f"grad_{name}", got, w, 1e-4)
    stacked = jnp.stack([hidden, hidden * 0.5])
    per_problem = jax.vmap(jax.grad(lambda h: (g * fj.fused_linear_logprob(h, weight, targets)).sum()))(stacked)
    for i in range(2):
        want = jax.grad(lambda h: (g * jnp.take_along_axis(jax.nn.log_softmax(h @ weight.T, -1), targets[..., None],
                                                           -1)[..., 0]).sum())(stacked[i])
        close_norm("jax fused_linear_logprob under vmap(grad)", f"problem {i}", per_problem[i], want, 1e-4)


def check_fused_linear_mixed_dtypes():
    """A weight of another dtype than the hidden states is cast to theirs (as Liger-Kernel and
    the PyTorch front end do); each gradient comes back in its input's dtype."""
    k = jax.random.split(jax.random.PRNGKey(13), 4)
    B, T, H, V = 2, 3, 32, 70
    targets = jax.random.randint(k[3], (B, T), 0, V)
    adv = jnp.array([0.4, -0.9])
    for hidden_dtype, weight_dtype in [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16)]:
        hidden = jax.random.normal(k[0], (B, T, H)).astype(hidden_dtype)
        weight = (jax.random.normal(k[1], (V, H)) * (2.0 / H**0.5)).astype(weight_dtype)
        bias = (jax.random.normal(k[2], (V,)) * 0.5).astype(weight_dtype)
        case = f"jax fused_linear_grpo hidden {hidden_dtype.__name__} weight {weight_dtype.__name__}"

        def ours(h, w, b):
            return fj.fused_linear_grpo_loss(h, w, targets, adv, bias=b, beta=0.0)

        def theirs(h, w, b):
            return reference_grpo(h @ w.T + b, targets, jnp.ones((B, T)), adv, None, None, beta=0.0)

        # The reference at the inputs as the kernels take them (in the hidden states' dtype), in
        # f32 throughout: an f32 gradient must keep f32's accuracy (no trip through bf16).
        as_taken = [x.astype(hidden_dtype).astype(jnp.float32) for x in (hidden, weight, bias)]
        loss, grads = jax.value_and_grad(ours, argnums=(0, 1, 2))(hidden, weight, bias)
        want, want_grads = jax.value_and_grad(theirs, argnums=(0, 1, 2))(*as_taken)
        close(case, "loss", loss, want, 1e-4)
        for name, g, w, x in zip(["hidden", "weight", "bias"], grads, want_grads, (hidden, weight, bias)):
            if g.dtype != x.dtype:
                FAILURES.append(f"{case}: grad_{name} dtype {g.dtype}, input {x.dtype}")
            tol = 1e-4 if x.dtype == jnp.float32 else 1e-2
            close_norm(case, f"grad_{name}", g.astype(jnp.float32), w, tol)


def gradcheck_original():
    """The original system's gradcheck from Python: GRPO, dapo, beta 0.04, eps 0.2 / 0.28,
    off-policy, 10% masked rows, B=1, T=129, V=151936, f32; reference in float32 JAX."""
    B, T, V = 1, 129, 151936
    logits, targets, _, _, old, ref = inputs(jax.random.PRNGKey(0), B, T, V)
    mask = (jax.random.uniform(jax.random.PRNGKey(1), (B, T)) > 0.1).astype(jnp.float32).at[:, 0].set(1.0)
    adv = jnp.array([0.8])
    loss, grad = jax.jit(jax.value_and_grad(
        lambda x: fj.grpo_loss(x, targets, adv, mask, old_logp=old, ref_logp=ref, beta=0.04, epsilon_high=0.28)))(logits)
    want, want_grad = jax.jit(jax.value_and_grad(lambda x: reference_grpo(x, targets, mask, adv, old, ref)))(logits)
    diff = np.abs(np.asarray(grad, np.float64) - np.asarray(want_grad, np.float64))
    rel_norm = close_norm("gradcheck original", "dlogits_rel_norm", grad, want_grad, 1e-5)
    close("gradcheck original", "loss", loss, want, 1e-5)
    print(f"gradcheck (original shape B=1 T=129 V=151936, f32, from JAX): loss_ref {float(want):.6e} "
          f"loss_kernel {float(loss):.6e} abs_diff_loss {abs(float(loss) - float(want)):.2e} "
          f"dlogits_max_abs {diff.max():.2e} dlogits_rel_norm {rel_norm:.2e}")


def check_class_weights():
    """``class_weights`` (PyTorch's ``weight``) against plain JAX: each row's target weighs
    ``c[y]``, label smoothing's uniform target ``c_j / V``, ``mean`` over the rows' summed target
    weights; logits-level (``jit``, ``grad``, a per-token cotangent with ``reduction="none"``) and
    fused-linear; weights of the wrong length named."""
    key = jax.random.PRNGKey(11)
    k = jax.random.split(key, 5)
    N, V, H, s = 13, 301, 16, 0.1
    logits = jax.random.normal(k[0], (N, V)) * 2
    targets = jax.random.randint(k[1], (N,), 0, V).at[4].set(-100)
    c = jax.random.uniform(k[2], (V,)) * 1.5 + 0.25
    valid = (targets != -100).astype(jnp.float32)
    safe = jnp.maximum(targets, 0)

    def per_row(x):
        lp = jax.nn.log_softmax(x, -1)
        nll = -jnp.take_along_axis(lp, safe[:, None], -1)[:, 0]
        return ((1 - s) * c[safe] * nll + s / V * -(lp * c).sum(-1)) * valid

    def ref_mean(x):
        return per_row(x).sum() / (c[safe] * valid).sum()

    loss, grad = jax.jit(jax.value_and_grad(
        lambda x: fj.cross_entropy(x, targets, label_smoothing=s, class_weights=c)))(logits)
    want, want_grad = jax.value_and_grad(ref_mean)(logits)
    close("jax cross_entropy class_weights", "loss", loss, want, 1e-5)
    close_norm("jax cross_entropy class_weights", "grad", grad, want_grad, 1e-5)
    cot = jax.random.normal(k[3], (N,))
    got, vjp = jax.vjp(lambda x: fj.cross_entropy(x, targets, label_smoothing=s, class_weights=c, reduction="none"),
                       logits)
    want, want_vjp = jax.vjp(per_row, logits)
    close("jax cross_entropy class_weights none", "per_token_loss", got, want, 1e-5)
    close_norm("jax cross_entropy class_weights none", "vjp", vjp(cot)[0], want_vjp(cot)[0], 1e-5)
    hidden = jax.random.normal(k[4], (N, H))
    weight = jax.random.normal(k[0], (V, H)) * 0.4
    got = jax.grad(lambda h, w: fj.fused_linear_cross_entropy(h, w, targets, label_smoothing=s, class_weights=c),
                   argnums=(0, 1))(hidden, weight)
    want = jax.grad(lambda h, w: ref_mean(h @ w.T), argnums=(0, 1))(hidden, weight)
    for name, g, w in zip(("hidden", "weight"), got, want):
        close_norm("jax fused_linear_cross_entropy class_weights", f"grad_{name}", g, w, 1e-4)
    expect_error("jax class_weights of the wrong length", ValueError, ["class_weights", f"[{V}]"],
                 lambda: fj.cross_entropy(logits, targets, class_weights=c[:-1]))


def main():
    check_grpo()
    check_in_place()
    check_cross_entropy_logprob_entropy()
    check_class_weights()
    check_edges()
    check_vmap()
    check_fused_linear()
    check_fused_linear_mixed_dtypes()
    gradcheck_original()
    for f in FAILURES[:40]:
        print("FAIL", f)
    print(f"flashgrpo.jax: {CHECKS[0]} checks, {len(FAILURES)} failures")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()

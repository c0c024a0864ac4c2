"""The inputs are read in place and the gradient written in place: the peak memory of a call
rises by far less than one copy of the logits. Each framework runs in a fresh process, whose
peak resident set (VmHWM, reset through /proc/self/clear_refs) is read before and after the call.
Prints "N checks, 0 failures"."""

import subprocess
import sys

B, T, V = 4, 512, 32768  # 256 MiB of float32 logits
LOGITS_MIB = B * T * V * 4 / 2**20
# Allowed rise: the per-token outputs, per-thread scratch and the interpreter's own noise.
ALLOWED_MIB = 0.1 * LOGITS_MIB

CHILD = r"""
import sys
import numpy as np

def peak_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

framework, mode = sys.argv[1], sys.argv[2]
B, T, V = {B}, {T}, {V}
targets = np.random.default_rng(0).integers(0, V, (B, T))
adv = np.ones(B, np.float32)
if framework == "torch":
    import torch
    import flashgrpo.torch as ft
    logits = torch.empty(B, T, V).normal_()
    if mode == "in_place":
        logits.requires_grad_(True)
    reset_peak(); before = peak_mib()
    out = ft.grpo_loss(logits, torch.from_numpy(targets), torch.from_numpy(adv), in_place=mode == "in_place")
    if mode == "in_place":
        out.loss.backward()
        assert logits.grad.data_ptr() == logits.data_ptr()
elif framework == "jax-ffi":
    import jax
    jax.config.update("jax_platforms", "cpu")
    import jax.numpy as jnp
    import flashgrpo.jax as fj
    logits = jax.random.normal(jax.random.PRNGKey(0), (B, T, V), dtype=jnp.float32).block_until_ready()
    t, a = jnp.asarray(targets), jnp.asarray(adv)
    if mode == "in_place":  # the gradient in the donated logits' buffer
        f = jax.jit(jax.grad(lambda x: fj.grpo_loss(x, t, a, in_place=True)), donate_argnums=0)
    else:
        f = jax.jit(lambda x: fj.grpo_loss(x, t, a))
    f.lower(logits).compile()
    reset_peak(); before = peak_mib()
    jax.block_until_ready(f(logits))
else:
    import flashgrpo.arrays as fa
    if framework == "jax":
        import jax
        jax.config.update("jax_platforms", "cpu")
        import jax.numpy as jnp
        logits = jax.random.normal(jax.random.PRNGKey(0), (B, T, V), dtype=jnp.float32).block_until_ready()
    else:
        logits = np.empty((B, T, V), np.float32)
        for b in range(B):
            logits[b] = np.random.default_rng(b).standard_normal((T, V), dtype=np.float32)
    reset_peak(); before = peak_mib()
    fa.loss("grpo", logits, targets, adv, in_place=mode == "in_place")
print(peak_mib() - before)
"""


def main():
    checks, failures = 0, []
    for framework, mode in [("torch", "forward"), ("torch", "in_place"), ("numpy", "forward"),
                            ("numpy", "in_place"), ("jax", "forward"), ("jax-ffi", "forward"),
                            ("jax-ffi", "in_place")]:
        child = CHILD.replace("{B}", str(B)).replace("{T}", str(T)).replace("{V}", str(V))
        r = subprocess.run([sys.executable, "-c", child, framework, mode], capture_output=True, text=True)
        checks += 1
        if r.returncode != 0:
            failures.append(f"{framework} {mode}: failed\n{r.stderr[-2000:]}")
            continue
        rise = float(r.stdout.strip().splitlines()[-1])
        print(f"{framework} {mode}: peak rise {rise:.1f} MiB with {LOGITS_MIB:.0f} MiB of logits")
        if not rise < ALLOWED_MIB:
            failures.append(f"{framework} {mode}: the peak rose by {rise:.1f} MiB (> {ALLOWED_MIB:.0f} MiB): a copy?")
    for f in failures:
        print("FAIL", f)
    print(f"flashgrpo no-copy: {checks} checks, {len(failures)} failures")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

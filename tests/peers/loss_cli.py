"""What the loss cross-check scripts share: running `flashgrpo loss` on tensors, and the two
comparisons of LOSSES.md's tolerances (elementwise scaled error, relative norm error), each
recording a check and, when it fails, a line in FAILURES."""

import os
import subprocess
import tempfile

from checks import CHECKS, FAILURES, expect_error  # noqa: F401 (the shared counters, re-exported)
from safetensors.torch import load_file, save_file


def option_value(v):
    """`--set` syntax: None -> null, booleans lower-case."""
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def run_loss(binary, op, tensors, sets, impl="fused"):
    """`flashgrpo loss --op OP` on `tensors` (None values left out) with `--set KEY=VALUE` each."""
    with tempfile.TemporaryDirectory() as d:
        inp, out = os.path.join(d, "in.safetensors"), os.path.join(d, "out.safetensors")
        save_file({k: v.contiguous() for k, v in tensors.items() if v is not None}, inp)
        cmd = [binary, "loss", "--op", op, "--inputs", inp, "--out", out, "--impl", impl]
        for k, v in sets.items():
            cmd += ["--set", f"{k}={option_value(v)}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}\n{r.stderr}")
        return load_file(out)


def close(case, name, got, want, tol, mask=None):
    """Elementwise |got - want| <= tol * max(1, |want|), on mask positions if given."""
    CHECKS[0] += 1
    got, want = got.double().reshape(want.shape), want.double()
    err = (got - want).abs() / want.abs().clamp(min=1.0)
    if mask is not None:
        err = err[mask.bool()]
    worst = err.max().item() if err.numel() else 0.0
    if not worst <= tol:
        FAILURES.append(f"{case}: {name} worst scaled error {worst:.3e} > {tol:.0e}")


def close_norm(case, name, got, want, tol):
    """||got - want|| / ||want|| <= tol."""
    CHECKS[0] += 1
    got, want = got.double().reshape(want.shape), want.double()
    norm = want.norm().item()
    err = (got - want).norm().item() / (norm if norm > 0 else 1.0)
    if not err <= tol:
        FAILURES.append(f"{case}: {name} relative norm error {err:.3e} > {tol:.0e}")


def fail(case, message):
    """A check that could not run (e.g. `flashgrpo loss` refused the inputs)."""
    CHECKS[0] += 1
    FAILURES.append(f"{case}: {message}")


def report(what):
    """Prints the failures and the count; the exit status."""
    for f in FAILURES[:40]:
        print("FAIL", f)
    print(f"{what}: {CHECKS[0]} checks, {len(FAILURES)} failures")
    return 1 if FAILURES else 0

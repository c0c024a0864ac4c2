"""Running a peer script's arms side by side: step times with the arms alternated (A B C, then
C B A), one JSON line per arm, and the process's peak memory (Linux `/proc/self`)."""

import argparse
import json
import statistics
import time


def parser(arms):
    """The peer scripts' common arguments: the shape (N=1024, H=896, V=151936 by default), the
    dtype, the rounds and `--only ARM` (one of `arms`, alone in its process, with its memory)."""
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", choices=arms)
    return p


def alternated(arms, rounds, step):
    """Seconds of `step(arm)` for each arm over `rounds` rounds, every other round reversed, so
    that this VM's drift hits every arm alike."""
    times = {arm: [] for arm in arms}
    for r in range(rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            t0 = time.perf_counter()
            step(arm)
            times[arm].append(time.perf_counter() - t0)
    return times


def print_arms(times, fields, peak_above_mib=None):
    """One JSON line per arm: `fields`, its step times and their median (s), and with
    `peak_above_mib` the peak memory above the inputs and their gradients."""
    for arm, seconds in times.items():
        extra = {} if peak_above_mib is None else dict(peak_above_inputs_and_grads_mib=round(peak_above_mib))
        print(json.dumps(dict(arm=arm, **fields, step_s=[round(t, 4) for t in seconds],
                              step_s_p50=round(statistics.median(seconds), 4), **extra)))


def reset_peak():
    """`VmHWM` set to the current RSS, so that the peak measured is the steps' (not the inputs'
    creation, whose f32 temporaries are larger than bf16 inputs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def resident_mib(field):
    """`VmRSS` or `VmHWM` in MiB."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")

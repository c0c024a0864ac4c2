"""flashgrpo's TensorBoard event files read back with the `tensorboard` package (what
`tensorboard --logdir` and `wandb sync --sync-tensorboard` read): every scalar of a run's
metrics.jsonl (and sft_metrics.jsonl) is there under its name, at its step, with its value (f32).

Usage: python tensorboard_read.py --run DIR
"""

import argparse
import json
import math
import os
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def expected(path):
    want = {}
    for line in open(path):
        r = json.loads(line)
        for k, v in r.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                want[(k, r["step"])] = float(v)
    return want


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    args = ap.parse_args()
    failures, checks = [], 0
    for jsonl, sub in [("metrics.jsonl", "grpo"), ("sft_metrics.jsonl", "sft")]:
        path = os.path.join(args.run, jsonl)
        if not os.path.exists(path):
            continue
        acc = EventAccumulator(os.path.join(args.run, "tensorboard", sub), size_guidance={"scalars": 0})
        acc.Reload()
        got = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
        want = expected(path)
        for key, v in want.items():
            checks += 1
            g = got.get(key)
            ok = g is not None and (math.isclose(g, v, rel_tol=1e-6, abs_tol=1e-30) or (math.isnan(g) and math.isnan(v)))
            if not ok:
                failures.append(f"{sub}: {key[0]} at step {key[1]}: {g} in TensorBoard, {v} in {jsonl}")
        extra = set(got) - set(want)
        if extra:
            failures.append(f"{sub}: {len(extra)} scalars not in {jsonl}, e.g. {sorted(extra)[:3]}")
        print(f"{sub}: {len(want)} scalars of {jsonl} in TensorBoard, {len(acc.Tags()['scalars'])} tags")
    print(f"{checks} checks, {len(failures)} failures")
    for f in failures[:20]:
        print("FAIL", f)
    sys.exit(1 if failures or checks == 0 else 0)


if __name__ == "__main__":
    main()

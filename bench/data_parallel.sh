#!/usr/bin/env bash
# Data-parallel GRPO on this machine: 1 process x 2 threads against 2 MPI ranks x 1 thread
# (data-parallel, and vocabulary-parallel: `parallel.vocab=2`), the same global batch (the
# built-in settings), from the same warm start, arms alternated round by round (this VM's speed
# drifts). Prints the medians of steps 2..N of every round per arm: step,
# rollout, update and, for 2 ranks, the time inside collectives (time/comm_s).
# Usage: bench/data_parallel.sh WARM_START_DIR [STEPS=20] [ROUNDS=2] [OUT=runs/bench-dp]
# Needs the MPI build: scripts/setup-mpi.sh && cargo build --release --features mpi --target-dir target/mpi
set -euo pipefail
cd "$(dirname "$0")/.."
warm=${1:?usage: bench/data_parallel.sh WARM_START_DIR [STEPS] [ROUNDS] [OUT]}
steps=${2:-20}
rounds=${3:-2}
out=${4:-runs/bench-dp}
bin=target/mpi/release/flashgrpo
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
sets=(--set "model.path=$warm" --set sft.steps=0 --set "grpo.steps=$steps" --set progress=false
      --set grpo.eval_every_steps=0 --set data.eval_limit=0 --set grpo.checkpoint_every=0)
for r in $(seq 1 "$rounds"); do
    "$bin" --threads 2 train "${sets[@]}" --out "$out/one-r$r" > /dev/null
    mpirun --oversubscribe --bind-to none -np 2 "$bin" --threads 1 train "${sets[@]}" --out "$out/two-r$r" > /dev/null
    mpirun --oversubscribe --bind-to none -np 2 "$bin" --threads 1 train "${sets[@]}" --set parallel.vocab=2 \
        --out "$out/vocab-r$r" > /dev/null
    mpirun --oversubscribe --bind-to none -np 2 "$bin" --threads 1 train "${sets[@]}" \
        --set parallel.overlap_grad_sum=false --out "$out/after-r$r" > /dev/null
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
keys = ["time/step_s", "time/rollout_s", "time/update_s", "time/comm_s"]
print(f"| per GRPO step (median) | {' | '.join(keys)} |")
print("|---|" + "---|" * len(keys))
for arm, label in [("one", "1 process x 2 threads"), ("two", "2 ranks x 1 thread (MPI), data 2"),
                   ("after", "2 ranks x 1 thread (MPI), data 2, sum after the backward"),
                   ("vocab", "2 ranks x 1 thread (MPI), vocab 2")]:
    rows = []
    for r in range(1, rounds + 1):
        recs = [json.loads(l) for l in open(f"{out}/{arm}-r{r}/metrics.jsonl")]
        rows += [x for x in recs if x.get("step", 0) >= 2 and "time/step_s" in x]
    cells = []
    for k in keys:
        v = [x[k] for x in rows if k in x]
        cells.append(f"{statistics.median(v):.4f} s" if v else "-")
    print(f"| {label} | {' | '.join(cells)} |")
PY

#!/usr/bin/env bash
# GPU calls of 2026-11-26 (late), on an H200: the CUDA tests (with the new blocks-of-rows test) and
# gradchecks, then the row-local objective overlapped with the passes (gpu-carry/flashgrpo, a block
# of rows at a time) against the committed base (gpu-carry/flashgrpo-base: the whole objective
# between the two whole passes), alternated, fused and in place, each call's host-clock phases.
# `STAGES=first` (call 1: the first version, blocks read back synchronously): B=1 T=4096 3 rounds,
# B=16 T=2048 2 rounds, then the peers at B=16 T=2048. Default (call 2: two blocks queued ahead,
# copied back into page-locked memory): B=1 T=4096 2 rounds, B=16 T=2048 three runs. Call 2 found
# the new binary reading its statistics before their copy had run (cudarc records a pinned
# buffer's event only when it tracks several streams); call 3 ran the fix.
set -u
FINAL=${OUT:-/tmp/gpu-out}; mkdir -p "$FINAL"
export OUT=/tmp/gpu-run; mkdir -p "$OUT"
stage() { local limit=$1; shift; echo "#### $* (limit ${limit}s)"; local t0=$SECONDS
    timeout --kill-after=5 "$limit" "$@"; echo "#### rc=$? in $((SECONDS - t0)) s"; }
variant() { # variant NAME B T IMPL ROUND
    local fg=gpu-carry/flashgrpo
    [ "$1" = base ] && fg=gpu-carry/flashgrpo-base
    local f="$OUT/ab-$1-b$2-t$3-$4-$5"
    FLASHGRPO_CUDA_PHASES=1 $fg bench --config configs/bench-grpo-original.yaml --device cuda --json \
        --set batch=$2 --set seq_len=$3 --set impl=$4 --set warmup=3 --set steps=10 > "$f.json" 2> "$f.txt"
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("%-5s %-22s p50 %.3f ms loss %.7f" % (sys.argv[2], sys.argv[3], r["bench/step_s_p50"]*1e3, r.get("bench/loss", float("nan"))))' \
        "$f.json" "$1" "b$2 t$3 $4"
    grep "cuda phases" "$f.txt" | tail -1
}
ab() { local rounds=$1; shift; for round in $(seq "$rounds"); do for impl in fused fused-inplace; do
    for v in base new; do variant $v "$@" $impl $round; done; done; done; }
export -f variant ab; export OUT
{
if [ "${STAGES:-}" = first ]; then
stage 150 bash bench/gpu/run.sh check
stage 90 bash -c 'ab 3 1 4096'
stage 130 bash -c 'ab 2 16 2048'
stage 120 bash -c 'python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site gpu-carry/wheels/*.whl;
    PYTHONPATH=/tmp/site python3 bench/peers/gpu_grpo.py --batch 16 --seq-len 2048 --vocab 151936 --dtype bf16 | tee $OUT/peers-b16-t2048.jsonl'
else
# Call 3 (the last 290 s of device time): B=16 as three runs, base fused against new fused and in place.
stage 40 bash bench/gpu/run.sh check
stage 50 bash -c 'ab 2 1 4096'
stage 125 bash -c 'variant base 16 2048 fused 1; variant new 16 2048 fused 1; variant new 16 2048 fused-inplace 1'
fi
} 2>&1 | tee "$OUT/session.log" | grep --line-buffered -E "^####|test result|FAILED|panicked|failed|error|passed|p50|phases|\"loss\"|impl"
tar -czf "$FINAL/gpu-run.tar.gz" -C "$OUT" .

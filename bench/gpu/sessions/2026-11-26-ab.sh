#!/usr/bin/env bash
# One GPU call (2026-11-26): the CUDA tests and gradchecks, then the host objective's time A/B:
# gpu-carry/flashgrpo-old (before: 2048 rows a task, glibc defaults), the same binary with glibc
# tunables equivalent to keep_freed_memory, and gpu-carry/flashgrpo (256 rows a task, and
# keep_freed_memory in the CUDA bench); then bench 1 4096 with the peers, linear, and 16x2048 ours.
set -u
FINAL=${OUT:-/tmp/gpu-out}; mkdir -p "$FINAL"
export OUT=/tmp/gpu-run; mkdir -p "$OUT"
TUN=glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=2147483647:glibc.malloc.arena_max=1
stage() { local limit=$1; shift; echo "#### $* (limit ${limit}s)"; local t0=$SECONDS
    timeout --kill-after=5 "$limit" "$@"; echo "#### rc=$? in $((SECONDS - t0)) s"; }
variant() { # variant NAME B T IMPL
    local fg=gpu-carry/flashgrpo tun=""
    case $1 in old) fg=gpu-carry/flashgrpo-old ;; old-tunables) fg=gpu-carry/flashgrpo-old; tun=$TUN ;; esac
    GLIBC_TUNABLES=$tun FLASHGRPO_CUDA_PHASES=1 $fg bench --config configs/bench-grpo-original.yaml --device cuda --json \
        --set batch=$2 --set seq_len=$3 --set impl=$4 --set warmup=3 --set steps=10 \
        > "$OUT/ab-$1-b$2-t$3-$4.json" 2> "$OUT/ab-$1-b$2-t$3-$4.txt"
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("%-13s %s p50 %.3f ms" % (sys.argv[2], sys.argv[3], r["bench/step_s_p50"]*1e3))' \
        "$OUT/ab-$1-b$2-t$3-$4.json" "$1" "b$2 t$3 $4"
    grep "cuda phases" "$OUT/ab-$1-b$2-t$3-$4.txt" | tail -2
}
ab() { for round in 1 2; do for v in old old-tunables new; do variant $v "$@"; done; done; }
export -f variant ab; export OUT TUN
{
stage 170 bash bench/gpu/run.sh check
stage 100 bash -c 'ab 1 4096 fused; ab 1 4096 fused-inplace'
stage 100 bash bench/gpu/run.sh bench 1 4096
stage 60 bash bench/gpu/run.sh linear
stage 110 bash -c 'for v in old new; do variant $v 16 2048 fused-inplace; done'
} 2>&1 | tee "$OUT/session.log" | grep --line-buffered -E "^####|test result|FAILED|panicked|failed|error|passed|p50|phases|\"loss\""
tar -czf "$FINAL/gpu-run.tar.gz" -C "$OUT" .

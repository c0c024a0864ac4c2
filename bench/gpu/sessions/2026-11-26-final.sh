#!/usr/bin/env bash
# Third GPU call (2026-11-26): the committed binary (gpu-carry/flashgrpo: 256 rows a task, glibc's
# defaults in the CUDA bench) against the one calls 1 and 2 ran (gpu-carry/flashgrpo-keep: the same
# plus keep_freed_memory in the CUDA bench), alternated, B=1 T=4096, fused and in place.
set -u
FINAL=${OUT:-/tmp/gpu-out}; mkdir -p "$FINAL"
export OUT=/tmp/gpu-run; mkdir -p "$OUT"
for round in 1 2 3; do for impl in fused fused-inplace; do for v in flashgrpo flashgrpo-keep; do
    FLASHGRPO_CUDA_PHASES=1 timeout 40 gpu-carry/$v bench --config configs/bench-grpo-original.yaml --device cuda --json \
        --set impl=$impl --set warmup=3 --set steps=10 > "$OUT/$v-$impl-$round.json" 2> "$OUT/$v-$impl-$round.txt"
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("%-15s %-13s p50 %.3f ms" % (sys.argv[2], sys.argv[3], r["bench/step_s_p50"]*1e3))' \
        "$OUT/$v-$impl-$round.json" $v $impl
    grep "cuda phases" "$OUT/$v-$impl-$round.txt" | tail -2 | sed 's/.*statistics/  statistics/'
done; done; done 2>&1 | tee "$OUT/final.log"
tar -czf "$FINAL/gpu-run3.tar.gz" -C "$OUT" .

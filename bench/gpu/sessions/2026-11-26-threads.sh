#!/usr/bin/env bash
# Second GPU call (2026-11-26): the host objective's phase at 1x4096 against rayon's thread count,
# then bench 16 2048 (ours and the peers in one run).
set -u
FINAL=${OUT:-/tmp/gpu-out}; mkdir -p "$FINAL"
export OUT=/tmp/gpu-run; mkdir -p "$OUT"
{
echo "#### threads"
for th in 1 4 16 1 4 16; do
    RAYON_NUM_THREADS=$th FLASHGRPO_CUDA_PHASES=1 timeout 40 gpu-carry/flashgrpo bench --config configs/bench-grpo-original.yaml \
        --device cuda --json --set impl=fused --set warmup=3 --set steps=10 > "$OUT/th$th.json" 2> "$OUT/th$th.txt"
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("threads %s p50 %.3f ms" % (sys.argv[2], r["bench/step_s_p50"]*1e3))' "$OUT/th$th.json" $th
    grep "cuda phases" "$OUT/th$th.txt" | tail -3 | sed 's/.*statistics/statistics/'
done
echo "#### bench 16 2048"
timeout --kill-after=5 360 bash bench/gpu/run.sh bench 16 2048
echo "#### rc=$?"
} 2>&1 | tee "$OUT/session2.log" | grep --line-buffered -E "^####|threads|phases|statistics|step_s_p50|peer"
tar -czf "$FINAL/gpu-run2.tar.gz" -C "$OUT" .

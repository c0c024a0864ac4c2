#!/usr/bin/env bash
# Fourth GPU session, third call (2026-11-27, an H200): fused-linear on CUDA with masked rows left
# out of the products (gathered chunks, `d hidden` scattered back). First the CUDA tests and every
# gradcheck with the new binary (gpu-carry/flashgrpo), then its fused-linear bench against the
# previous commit's (gpu-carry/flashgrpo-base: every row through the products), alternated, three
# rounds, bf16 and f32, B=1 T=2048 H=1536 V=151936 (10% of rows masked, the bench's default).
set -u
FINAL=${OUT:-/tmp/gpu-out}; mkdir -p "$FINAL"
export OUT=/tmp/gpu-run; mkdir -p "$OUT"
timeout 120 bash bench/gpu/run.sh check > "$OUT/check.log" 2>&1
grep -E "^test |test result|FAILED|panicked|gradcheck (passed|failed)|^error" "$OUT/check.log" | tail -20
site=$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))' 2>/dev/null || true)
libs=$(find "$site/nvidia" \( -name 'libnvrtc.so*' -o -name 'libcublas.so*' \) 2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${libs}${LD_LIBRARY_PATH:-}"
for round in 1 2 3; do for dtype in bf16 f32; do for v in flashgrpo-base flashgrpo; do
    timeout 40 gpu-carry/$v bench --config configs/bench-linear-original.yaml --device cuda --json --set dtype=$dtype \
        --set chunk_memory_mb=2048 --set warmup=2 --set steps=10 > "$OUT/linear-$v-$dtype-$round.json" 2>/dev/null
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))
print("round %s %-5s %-15s p50 %7.3f ms  %6.1f TFLOP/s counted  of cuBLAS %.3f  loss %.9f  above grads %d" % (sys.argv[2], sys.argv[3], sys.argv[4],
      r["bench/step_s_p50"]*1e3, r["bench/gflops"]/1e3, r["bench/gflops_over_matmul"], r["bench/loss"], r["mem/peak_above_grads_bytes"]))' \
        "$OUT/linear-$v-$dtype-$round.json" $round $dtype $v
done; done; done 2>&1 | tee "$OUT/ab.log"
tar -czf "$FINAL/gpu-run3.tar.gz" -C "$OUT" .

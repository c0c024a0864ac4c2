#!/usr/bin/env bash
# Fifth GPU session (2026-11-28, an H200), one call of at most 600 s: (1) `run.sh all` at the
# current commit (the fused-linear refactor and its CUDA test had not run on a GPU); (2) the
# statistics pass with its body loads issued 1 or 2 vectors ahead (rows.cu's FLASHGRPO_STATS_AHEAD)
# against the default, alternated, B=16 T=2048 and B=1 T=4096, in place and not; (3) the CUDA tests
# and the gradchecks under AHEAD=1 (the same bits are expected: same elements, same order). Stops
# starting runs at DEADLINE_S (default 540) seconds; every result line is written to $OUT at once.
# The switch gave nothing (docs/BENCHMARKS.md, "Fifth GPU session") and was removed after this call:
# run this script with a binary built at 4d20691, which has it.
set -u
FINAL=${OUT:-/tmp/gpu-out}; mkdir -p "$FINAL"
DEADLINE_S=${DEADLINE_S:-540}
RESULT="$FINAL" timeout 330 bash bench/gpu/run.sh all
site=$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))' 2>/dev/null || true)
libs=$(find "$site/nvidia" \( -name 'libnvrtc.so*' -o -name 'libcublas.so*' \) 2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${libs}${LD_LIBRARY_PATH:-}"
late() { [ $SECONDS -ge $DEADLINE_S ] && { echo "deadline at ${SECONDS}s: $*" | tee -a "$FINAL/ahead.txt"; return 0; }; return 1; }
bench() {  # round shape impl defines
    FLASHGRPO_CUDA_DEFINES="$4" timeout 60 gpu-carry/flashgrpo bench --config configs/bench-grpo-original.yaml \
        --device cuda --json --set batch=${2%x*} --set seq_len=${2#*x} --set impl=$3 --set warmup=3 \
        --set steps=20 > /tmp/ahead.json 2>> "$FINAL/ahead.err"
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); a=sys.argv
print("round %s %-7s %-13s %-24s p50 %7.3f ms  moved/copy %.3f  loss %.7f  at %ss" % (a[2], a[3], a[4], a[5] or "default",
      r["bench/step_s_p50"] * 1e3, r["bench/moved_over_copy"], r["bench/loss"], a[6]))' \
        /tmp/ahead.json "$@" $SECONDS | tee -a "$FINAL/ahead.txt"
}
forward=("" "FLASHGRPO_STATS_AHEAD=1" "FLASHGRPO_STATS_AHEAD=2")
backward=("FLASHGRPO_STATS_AHEAD=2" "FLASHGRPO_STATS_AHEAD=1" "")
for shape in 16x2048 1x4096; do for impl in fused-inplace fused; do for d in "${forward[@]}"; do
    late "round 1" && break 3; bench 1 $shape $impl "$d"
done; done; done
echo "== check under FLASHGRPO_STATS_AHEAD=1 at ${SECONDS}s" | tee -a "$FINAL/ahead-check.txt"
FLASHGRPO_CUDA_DEFINES=FLASHGRPO_STATS_AHEAD=1 timeout 60 gpu-carry/cuda-tests --test-threads 1 2>&1 \
    | grep -E "test result|FAILED|panicked" | tee -a "$FINAL/ahead-check.txt"
for config in configs/gradcheck-*.yaml; do
    FLASHGRPO_CUDA_DEFINES=FLASHGRPO_STATS_AHEAD=1 timeout 30 gpu-carry/flashgrpo gradcheck --config "$config" --device cuda 2>&1 \
        | grep -E "rel_norm|loss_rel|passed|failed|error" | sed "s#^#$(basename $config .yaml): #" >> "$FINAL/ahead-check.txt"
done
grep -cE "passed" "$FINAL/ahead-check.txt"; grep -E "failed|error|FAILED" "$FINAL/ahead-check.txt" | head
for shape in 16x2048 1x4096; do for impl in fused-inplace fused; do for d in "${backward[@]}"; do
    late "round 2" && break 3; bench 2 $shape $impl "$d"
done; done; done
echo "done at ${SECONDS}s"

#!/usr/bin/env bash
# Fourth GPU session, second call (2026-11-27, an H200): after `run.sh all` (every test and
# gradcheck, both shapes beside the peers, fused-linear with its new bf16 peers), the parts one run
# left open: (1) the fused-linear peers in f32, (2) the host-clock phases at B=16 (the validation
# made branch-free in 4741a6e, never timed on a GPU), (3) B=1 T=4096 ours (fused, in place) and
# Liger's triton_grpo_loss alternated, three rounds (one run had ours 1.16x faster fused).
set -u
FINAL=${OUT:-/tmp/gpu-out}; mkdir -p "$FINAL"
export OUT=/tmp/gpu-run; mkdir -p "$OUT"
site=$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))' 2>/dev/null || true)
libs=$(find "$site/nvidia" \( -name 'libnvrtc.so*' -o -name 'libcublas.so*' \) 2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${libs}${LD_LIBRARY_PATH:-}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site gpu-carry/wheels/*.whl
{
echo "== (1) fused-linear peers, f32"
PYTHONPATH=/tmp/site timeout 120 python3 bench/peers/gpu_linear_grpo.py --dtype f32 | tee "$OUT/peers-linear-f32.jsonl"
echo "== (2) phases B=16 T=2048"
for impl in fused fused-inplace; do timeout 60 bash bench/gpu/run.sh phases 16 2048 $impl | grep -v "^|\|^+\|NVIDIA-SMI\|^$"; done
echo "== (3) B=1 T=4096 alternated"
for round in 1 2 3; do
    for impl in fused fused-inplace; do
        timeout 40 gpu-carry/flashgrpo bench --config configs/bench-grpo-original.yaml --device cuda --json \
            --set impl=$impl --set warmup=3 --set steps=10 > "$OUT/b1-$impl-$round.json"
        python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("round %s %-13s p50 %.3f ms" % (sys.argv[2], sys.argv[3], r["bench/step_s_p50"]*1e3))' \
            "$OUT/b1-$impl-$round.json" $round $impl
    done
    PYTHONPATH=/tmp/site timeout 60 python3 bench/peers/gpu_grpo.py --batch 1 --seq-len 4096 --peers liger \
        | python3 -c 'import json,sys
for l in sys.stdin:
    r = json.loads(l)
    if "peer" in r: print("round %s liger         p50 %.3f ms" % (sys.argv[1], r["step_s_p50"] * 1e3))' $round
done
} 2>&1 | tee "$OUT/peers.log"
tar -czf "$FINAL/gpu-run2.tar.gz" -C "$OUT" .

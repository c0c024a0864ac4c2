#!/usr/bin/env bash
# Run ON THE GPU MACHINE, from the repository root, with gpu-carry/ from bench/gpu/prepare.sh:
#   bash bench/gpu/run.sh check   the CUDA kernel tests and every gradcheck config on CUDA
#   bash bench/gpu/run.sh bench B T   flashgrpo's bench and the peers (PyTorch eager, torch.compile,
#                                 Liger's triton_grpo_loss) at one shape, V=151936 bf16: one call
#                                 for B=1 T=4096, one for B=16 T=2048 (each well inside 10 minutes)
# Each stays inside the device tool's 10-minute call. Logs and JSON go to $OUT (default /tmp/gpu-out).
set -uo pipefail
stage=${1:-check}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# NVRTC and cuBLAS: the CUDA toolkit's first (one consistent set: NVRTC, its headers, cuBLAS and
# cuBLASLt of the driver's version), then the NVIDIA wheels of the machine's python (torch's).
site=$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))' 2>/dev/null || true)
libs=$( { [ -n "$site" ] && find "$site/nvidia" \( -name 'libnvrtc.so*' -o -name 'libcublas.so*' \) ; } 2>/dev/null \
    | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${libs}${LD_LIBRARY_PATH:-}"
FG=gpu-carry/flashgrpo
{ nvidia-smi; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; $FG cuda-check; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

case "$stage" in
check)
    gpu-carry/cuda-tests --test-threads 1 2>&1 | tee "$OUT/cuda-tests.log"
    # One file for all configs: the device tool returns at most 8 files from $OUT.
    for config in configs/gradcheck-*.yaml; do
        echo "== $config (cuda)" | tee -a "$OUT/gradcheck.cuda.txt"
        $FG gradcheck --config "$config" --device cuda 2>&1 | tee -a "$OUT/gradcheck.cuda.txt" \
            | grep -E "device|rel_norm|loss_rel|per_token_worst|passed|error|failed"
    done
    ;;
bench)
    b=${2:-1}
    t=${3:-4096}
    for impl in fused-inplace fused; do
        echo "== flashgrpo $impl B=$b T=$t"
        $FG bench --config configs/bench-grpo-original.yaml --device cuda --json \
            --set batch=$b --set seq_len=$t --set impl=$impl --set warmup=3 --set steps=10 \
            | tee "$OUT/flashgrpo-$impl-b$b-t$t.json"
    done
    pip_site=/tmp/site
    if [ ! -d "$pip_site/liger_kernel" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$pip_site" \
            gpu-carry/wheels/*.whl
    fi
    echo "== peers B=$b T=$t"
    PYTHONPATH="$pip_site" python3 bench/peers/gpu_grpo.py --batch "$b" --seq-len "$t" --vocab 151936 --dtype bf16 \
        2>&1 | tee "$OUT/peers-b$b-t$t.jsonl"
    ;;
linear)
    echo "== flashgrpo fused-linear (cuda)"
    for dtype in bf16 f32; do
        $FG bench --config configs/bench-linear-original.yaml --device cuda --json --set dtype=$dtype \
            --set chunk_memory_mb=2048 --set warmup=2 --set steps=10 | tee "$OUT/flashgrpo-linear-$dtype.json"
    done
    ;;
*)
    echo "usage: bash bench/gpu/run.sh check | bench B T | linear" >&2
    exit 2
    ;;
esac

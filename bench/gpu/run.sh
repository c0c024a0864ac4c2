#!/usr/bin/env bash
# Run ON THE GPU MACHINE, from the repository root, with gpu-carry/ from bench/gpu/prepare.sh:
#   bash bench/gpu/run.sh check   the CUDA kernel tests and every gradcheck config on CUDA
#   bash bench/gpu/run.sh bench B T   flashgrpo's bench and the peers (PyTorch eager, torch.compile,
#                                 Liger's triton_grpo_loss) at one shape, V=151936 bf16: one call
#                                 for B=1 T=4096, one for B=16 T=2048 (each well inside 10 minutes)
#   bash bench/gpu/run.sh linear   the fused-linear bench on CUDA, and its peers in bf16 (PyTorch
#                                 eager, torch.compile, Liger's LigerFusedLinearGRPOLoss)
#   bash bench/gpu/run.sh phases B T IMPL   a call's host-clock phases (FLASHGRPO_CUDA_PHASES=1)
#   bash bench/gpu/run.sh tune "DEFINES" ...   kernel variants (rows.cu's switches) timed, and profiled
#   bash bench/gpu/run.sh all      all of the above in one call, each stage under a time limit, the
#                                 logs packed into $OUT/gpu-run.tar.gz (one file back)
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
FG=${FG:-gpu-carry/flashgrpo}
{ nvidia-smi; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; $FG cuda-check; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

# The liger-kernel wheel carried from the build machine (pure Python), installed once a machine.
pip_site=/tmp/site
install_liger() {
    if [ ! -d "$pip_site/liger_kernel" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$pip_site" \
            gpu-carry/wheels/*.whl
    fi
}

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
    install_liger
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
    # The peers at the same shape, bf16 (in f32 ours already runs at cuBLAS's rate).
    install_liger
    echo "== fused-linear peers (bf16)"
    PYTHONPATH="$pip_site" python3 bench/peers/gpu_linear_grpo.py --batch 1 --seq-len 2048 --hidden 1536 \
        --vocab 151936 --dtype bf16 2>&1 | tee "$OUT/peers-linear-bf16.jsonl"
    ;;
phases)
    # `run.sh phases B T IMPL`: the bench with FLASHGRPO_CUDA_PHASES=1, each call's host-clock phases
    # (prepare, inputs, statistics, objective, gradient) of the last steps.
    b=${2:-1}; t=${3:-4096}; impl=${4:-fused}
    FLASHGRPO_CUDA_PHASES=1 $FG bench --config configs/bench-grpo-original.yaml --device cuda --json \
        --set batch=$b --set seq_len=$t --set impl=$impl --set warmup=2 --set steps=5 \
        > "$OUT/phases-b$b-t$t-$impl.json" 2> "$OUT/phases-b$b-t$t-$impl.txt"
    grep "cuda phases" "$OUT/phases-b$b-t$t-$impl.txt" | tail -3
    ;;
tune)
    # `run.sh tune "DEFINES" ...`: each variant of rows.cu (FLASHGRPO_CUDA_DEFINES, the switches at
    # its top; "" is the default) timed in place and not at two shapes, then Nsight Compute's view
    # of the two row kernels of the first two variants (duration, DRAM throughput, occupancy).
    shift
    shapes=${TUNE_SHAPES:-"1x4096 8x2048"}
    for defines in "$@"; do
        for shape in $shapes; do
            for impl in fused-inplace fused; do
                FLASHGRPO_CUDA_DEFINES="$defines" $FG bench --config configs/bench-grpo-original.yaml --device cuda \
                    --json --set batch=${shape%x*} --set seq_len=${shape#*x} --set impl=$impl --set warmup=3 \
                    --set steps=20 > "$OUT/tune.json" 2>> "$OUT/tune.err"
                python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); a=sys.argv
print("%-44r %-7s %-14s p50 %8.3f ms  moved/copy %.3f" % (a[2], a[3], a[4], r[a[5]] * 1e3, r[a[6]]))' \
                    "$OUT/tune.json" "$defines" "$shape" "$impl" bench/step_s_p50 bench/moved_over_copy | tee -a "$OUT/tune.txt"
            done
        done
    done
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    for defines in "${@:1:2}"; do
        echo "== ncu: '$defines'" | tee -a "$OUT/ncu.txt"
        FLASHGRPO_CUDA_DEFINES="$defines" timeout 120 "$ncu" --kernel-name regex:'row_(stats|gradient)' \
            --launch-skip 2 --launch-count 2 --section SpeedOfLight --section Occupancy --section LaunchStats \
            $FG bench --config configs/bench-grpo-original.yaml --device cuda --set batch=1 --set seq_len=4096 \
            --set impl=fused-inplace --set warmup=1 --set steps=1 >> "$OUT/ncu.txt" 2>&1
        grep -E "row_|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per" "$OUT/ncu.txt" | tail -20
    done
    ;;
all)
    # Every stage in one call (a machine's start costs minutes of the lease), each under its own
    # limit so that the archive is written whatever happens: one file back, $RESULT/gpu-run.tar.gz.
    RESULT=${RESULT:-$OUT}
    export OUT=/tmp/gpu-run
    mkdir -p "$OUT"
    me="$0"
    run_stage() { local limit=$1; shift; echo "#### stage $* (limit ${limit}s)"; local t0=$SECONDS
        timeout --kill-after=5 "$limit" bash "$me" "$@"; echo "#### stage $* rc=$? in $((SECONDS - t0)) s"; }
    run_stage "${CHECK_S:-170}" check 2>&1 | tee "$OUT/all.log" | grep --line-buffered -E "^####|test result|FAILED|panicked|failed|error|passed"
    run_stage "${BENCH1_S:-100}" bench 1 4096 >> "$OUT/all.log" 2>&1
    run_stage "${BENCH16_S:-150}" bench 16 2048 >> "$OUT/all.log" 2>&1
    run_stage "${LINEAR_S:-150}" linear >> "$OUT/all.log" 2>&1
    grep -E "^####" "$OUT/all.log"
    grep -hE '"(bench/step_s_p50|bench/moved_over_copy|bench/gflops_over_matmul|mem/peak_bytes)"' "$OUT"/flashgrpo-*.json 2>/dev/null | head -20
    grep -h '"bench/gflops_over_matmul"\|"bench/gflops"' "$OUT"/flashgrpo-linear-*.json 2>/dev/null
    cat "$OUT"/peers-*.jsonl 2>/dev/null | cut -c1-400
    tar -czf "$RESULT/gpu-run.tar.gz" -C "$OUT" .
    ;;
*)
    echo "usage: bash bench/gpu/run.sh check | bench B T | linear | phases B T IMPL | tune DEFINES... | all" >&2
    exit 2
    ;;
esac

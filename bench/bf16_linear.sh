#!/usr/bin/env bash
# bf16 fused-linear GRPO against its peers in one run, the arms alternated over ROUNDS rounds
# (this VM's speed drifts): flashgrpo f32; flashgrpo bf16 with the detected bf16 products (AMX
# where the CPU has it, else AVX512-BF16); the same with the logits' gradient rounded to bf16
# (FLASHGRPO_BF16_PRODUCTS=amx-rounded, or avx512-bf16-rounded on a CPU without AMX); flashgrpo bf16
# with the products widened to f32 (FLASHGRPO_BF16_PRODUCTS=widened, the path before issue 17);
# our PyTorch drop-in (`flashgrpo.torch.FusedLinearGRPOLoss`, its default way: rounded, as its
# gradients come back in bf16); PyTorch eager bf16 (TRL's loss on materialised logits) and
# Liger-Kernel's chunked loss in bf16.
# Prints each arm's per-round step time and their median, then the bf16 and f32 matrix-product
# rates of PyTorch (oneDNN) and of ours on the logits product's shape
# (bench/peers/bf16_matmul.py, `bench/matmul_bf16_gflops`).
# Usage: bench/bf16_linear.sh [ROUNDS] [SHAPE]; SHAPE `n1024` (N=1024, H=896, V=151936, the
# default) or `original` (the original system's fused shape scaled to fit: B=1, T=2048, H=1536).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
bin=target/release/flashgrpo
cargo build --release --quiet  # a no-op when up to date: every arm measures this checkout
python=$(bench/peers/setup.sh | tail -1)
# The PyTorch drop-in arm runs the wheel of this checkout (an incremental build once built).
crates/python/install.sh "$python" >/dev/null
case ${2:-n1024} in
  n1024) config=configs/bench-linear-grpo-n1024-f32.yaml shape=(--n 1024 --hidden 896) hidden=896 ;;
  original) config=configs/bench-linear-original.yaml shape=(--n 2048 --hidden 1536) hidden=1536 ;;
  *) echo "unknown shape ${2}: n1024 or original" >&2; exit 2 ;;
esac
# The rounded form of the packed products this CPU runs (the same way as the default arm's).
if grep -qw amx_bf16 /proc/cpuinfo; then rounded=amx-rounded; else rounded=avx512-bf16-rounded; fi
ours() { "$bin" bench --config "$config" "$@" | awk '$1 == "bench/step_s_p50" {print $2}'; }
peer() { "$python" bench/peers/peer_loss.py --framework "$1" "${shape[@]}" --dtype bf16 --steps 3 --warmup 1 |
  "$python" -c 'import json, sys; print(json.load(sys.stdin)["step_s_p50"])'; }
declare -A times
order=(flashgrpo-f32 flashgrpo-bf16 flashgrpo-bf16-rounded flashgrpo-bf16-widened flashgrpo-torch-bf16 torch-eager-bf16
  liger-bf16)
# Every other round runs the arms in reverse (A B ... B A): on the AMX host of 2026-11-29 the first
# of two back-to-back runs of one binary was ~10% slower, so a fixed order favours the later arms.
reversed=()
for ((i = ${#order[@]} - 1; i >= 0; i--)); do reversed+=("${order[i]}"); done
for r in $(seq "$rounds"); do
  if ((r % 2)); then arms=("${order[@]}"); else arms=("${reversed[@]}"); fi
  for arm in "${arms[@]}"; do
    case $arm in
      flashgrpo-f32) t=$(ours) ;;
      flashgrpo-bf16) t=$(ours --set dtype=bf16) ;;
      flashgrpo-bf16-rounded) t=$(FLASHGRPO_BF16_PRODUCTS=$rounded ours --set dtype=bf16) ;;
      flashgrpo-bf16-widened) t=$(FLASHGRPO_BF16_PRODUCTS=widened ours --set dtype=bf16) ;;
      flashgrpo-torch-bf16) t=$(peer flashgrpo-torch) ;;
      torch-eager-bf16) t=$(peer torch-eager) ;;
      liger-bf16) t=$(peer liger) ;;
    esac
    times[$arm]="${times[$arm]:-} $t"
    echo "round $r $arm $t" >&2
  done
done
for arm in "${order[@]}"; do
  # shellcheck disable=SC2086
  median=$(printf '%s\n' ${times[$arm]} | sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}')
  echo "$arm step_s median $median (rounds:${times[$arm]})"
done
"$python" bench/peers/bf16_matmul.py --rows 256 --hidden "$hidden"
"$bin" bench --config "$config" --set dtype=bf16 --set steps=1 --set warmup=0 | grep -E 'matmul(_bf16)?_gflops|bf16_products'

#!/usr/bin/env bash
# The `flashgrpo` wheel from Python against the same kernels from Rust (`flashgrpo bench`) and
# against the peers, in one run, the arms alternated over ROUNDS rounds (this VM's speed drifts).
# GRPO (dapo, beta 0.04, eps 0.2 / 0.28), forward + backward, N=1024 rows, V=151936, f32:
# - logits-level: Rust `fused` (gradient into a buffer reused by every step; and into a new
#   buffer every step, `fresh_gradient`, as XLA allocates its results) and `fused-inplace`; flashgrpo.torch's
#   `grpo_loss` with a gradient tensor and with `in_place=True`; flashgrpo.jax under
#   jit(value_and_grad), with a new gradient buffer and in place (logits donated);
#   flashgrpo.arrays on JAX arrays;
#   TRL's loss code in PyTorch eager and under torch.compile; jax.jit(value_and_grad) of the
#   reference;
# - fused-linear (H=896): Rust `fused-linear`; flashgrpo.torch.FusedLinearGRPOLoss; Liger-Kernel's
#   LigerFusedLinearGRPOLoss; TRL's loss on materialised logits in PyTorch eager.
# Prints each arm's per-round median step time and the median over rounds, then the Python
# boundary's cost: (Python arm / Rust arm - 1) for the three pairs.
# Usage: bench/python_boundary.sh [ROUNDS] (default 3)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
bin=target/release/flashgrpo
cargo build --release --quiet  # a no-op when up to date: every arm measures this checkout
python=$(bench/peers/setup.sh | tail -1)
crates/python/install.sh "$python" >/dev/null
ours() { "$bin" bench "$@" | awk '$1 == "bench/step_s_p50" {print $2}'; }
peer() { "$python" bench/peers/peer_loss.py "$@" | "$python" -c 'import json, sys; print(json.load(sys.stdin)["step_s_p50"])'; }
logits=(--config configs/bench-grpo-n1024-f32.yaml)
declare -A times
order=(rust-fused rust-fused-fresh python-torch rust-fused-inplace python-torch-inplace python-jax python-jax-inplace python-jax-arrays
       torch-eager torch-compile jax
       rust-fused-linear python-torch-fused-linear liger-fused-linear torch-eager-fused-linear)
for r in $(seq "$rounds"); do
  for arm in "${order[@]}"; do
    case $arm in
      rust-fused) t=$(ours "${logits[@]}" --set impl=fused) ;;
      rust-fused-fresh) t=$(ours "${logits[@]}" --set impl=fused --set fresh_gradient=true) ;;
      rust-fused-inplace) t=$(ours "${logits[@]}" --set impl=fused-inplace) ;;
      python-torch) t=$(peer --framework flashgrpo-torch --steps 10) ;;
      python-torch-inplace) t=$(peer --framework flashgrpo-torch-inplace --steps 10) ;;
      python-jax) t=$(peer --framework flashgrpo-jax --steps 10) ;;
      python-jax-inplace) t=$(peer --framework flashgrpo-jax-inplace --steps 10) ;;
      python-jax-arrays) t=$(peer --framework flashgrpo-jax-arrays --steps 10) ;;
      torch-eager) t=$(peer --framework torch-eager) ;;
      torch-compile) t=$(peer --framework torch-compile) ;;
      jax) t=$(peer --framework jax) ;;
      rust-fused-linear) t=$(ours --config configs/bench-linear-grpo-n1024-f32.yaml) ;;
      python-torch-fused-linear) t=$(peer --framework flashgrpo-torch --hidden 896 --warmup 1 --steps 3) ;;
      liger-fused-linear) t=$(peer --framework liger --hidden 896 --warmup 1 --steps 3) ;;
      torch-eager-fused-linear) t=$(peer --framework torch-eager --hidden 896 --warmup 1 --steps 3) ;;
    esac
    times[$arm]="${times[$arm]:-} $t"
    echo "round $r $arm $t" >&2
  done
done
declare -A median
for arm in "${order[@]}"; do
  # shellcheck disable=SC2086
  median[$arm]=$(printf '%s\n' ${times[$arm]} | sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}')
  echo "$arm step_s median ${median[$arm]} (rounds:${times[$arm]})"
done
for pair in "python-torch rust-fused" "python-torch-inplace rust-fused-inplace" \
            "python-jax rust-fused" "python-jax rust-fused-fresh" "python-jax-inplace rust-fused-inplace" "python-jax-arrays rust-fused" \
            "python-torch-fused-linear rust-fused-linear"; do
  set -- $pair
  awk -v a="${median[$1]}" -v b="${median[$2]}" -v n="$1 vs $2" 'BEGIN {printf "boundary %s: %+.1f%%\n", n, 100 * (a / b - 1)}'
done

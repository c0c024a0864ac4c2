#!/usr/bin/env bash
# The options of TRL 1.16 / verl beside dapo at the speed target shape (N = 1024, V = 151936):
# `flashgrpo bench` per arm, the arms alternated over ROUNDS rounds (this VM's speed drifts), the
# median of each arm's per-round p50 printed. Usage: bench/loss_options.sh [CONFIG] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-configs/bench-grpo-n1024-f32.yaml}
rounds=${2:-3}
bin=target/release/flashgrpo
cargo build --release --quiet  # a no-op when up to date: every arm measures this checkout
declare -A arms=(
  [dapo]=""
  [luspo]="--set loss_type=luspo"
  [vespo]="--set loss_type=vespo"
  [top_entropy_quantile=0.2]="--set top_entropy_quantile=0.2"
  [sequence_mask]="--set with_sampling_logp=true --set vllm_importance_sampling_mode=sequence_mask"
  [token_mask]="--set with_sampling_logp=true --set vllm_importance_sampling_mode=token_mask"
  [geo_mean]="--set loss_type=geo_mean"
  [kl_cov]="--set loss_type=kl_cov"
  [off_policy_mask]="--set with_sampling_logp=true --set off_policy_mask_threshold=0.5"
)
order=(dapo luspo vespo top_entropy_quantile=0.2 sequence_mask token_mask off_policy_mask geo_mean kl_cov)
declare -A times
for r in $(seq "$rounds"); do
  for arm in "${order[@]}"; do
    # shellcheck disable=SC2086
    t=$("$bin" bench --config "$config" ${arms[$arm]} | awk '$1 == "bench/step_s_p50" {print $2}')
    times[$arm]="${times[$arm]:-} $t"
  done
done
echo "config: $config, $rounds rounds, $(nproc) threads"
printf '%-26s %10s %8s   %s\n' arm p50_s vs_dapo per_round
base=$(echo ${times[dapo]} | tr ' ' '\n' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
for arm in "${order[@]}"; do
  med=$(echo ${times[$arm]} | tr ' ' '\n' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
  printf '%-26s %10.4f %8.3f  %s\n' "$arm" "$med" "$(echo "$med / $base" | bc -l)" "${times[$arm]}"
done

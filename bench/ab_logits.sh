#!/usr/bin/env bash
# A/B of two (or more) flashgrpo binaries on the logits-level GRPO shapes: each arm runs every
# binary in turn, round after round, so that this VM's drift hits both alike.
#   bench/ab_logits.sh ROUNDS BIN_A BIN_B [BIN ...]
# Prints `round|arm|binary|step p50 (s) x-the-floor copy-GB/s pass-floor (s) x-the-pass-floor` per run
# (`flashgrpo bench`; the pass floor: a pass with the step's own traffic, 0 where not measured).
# ARMS=REGEX runs only the arms whose name matches (e.g. ARMS=bf16; ARMS=extras: what
# `predicted_tokens` and class weights with label smoothing add to the step).
# Build the binaries first (e.g. `cargo build --release && cp target/release/flashgrpo /tmp/new`).
# Every other round runs the binaries in reverse (A B, B A): the first of two back-to-back runs was
# ~10% slower on the AMX host of 2026-11-29, so a fixed order favours the later binaries.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=$1
shift
arms=(
  "n1024-bf16 fused-inplace|--config configs/bench-grpo-n1024-bf16.yaml"
  "n1024-bf16 fused|--config configs/bench-grpo-n1024-bf16.yaml --set impl=fused"
  "n1024-f32 fused-inplace|--config configs/bench-grpo-n1024-f32.yaml"
  "n1024-f32 fused|--config configs/bench-grpo-n1024-f32.yaml --set impl=fused"
  "n1024-bf16 gspo fused-inplace|--config configs/bench-grpo-n1024-bf16.yaml --set importance_sampling_level=sequence --set loss_type=grpo"
  "n1024-bf16 gspo fused|--config configs/bench-grpo-n1024-bf16.yaml --set importance_sampling_level=sequence --set loss_type=grpo --set impl=fused"
  "original-bf16 fused-inplace|--config configs/bench-grpo-original.yaml"
  "original-bf16 fused|--config configs/bench-grpo-original.yaml --set impl=fused"
  "extras n1024-bf16 predicted fused-inplace|--config configs/bench-grpo-n1024-bf16.yaml --set predicted_tokens=true"
  "extras n1024-bf16 predicted fused|--config configs/bench-grpo-n1024-bf16.yaml --set predicted_tokens=true --set impl=fused"
  "extras n1024-f32 predicted fused-inplace|--config configs/bench-grpo-n1024-f32.yaml --set predicted_tokens=true"
  "extras original-bf16 predicted fused-inplace|--config configs/bench-grpo-original.yaml --set predicted_tokens=true"
  "extras n1024-bf16 ce-weighted-smoothed fused-inplace|--config configs/bench-grpo-n1024-bf16.yaml --set op=cross_entropy --set label_smoothing=0.1 --set with_class_weights=true"
  "extras n1024-bf16 ce-weighted-smoothed fused|--config configs/bench-grpo-n1024-bf16.yaml --set op=cross_entropy --set label_smoothing=0.1 --set with_class_weights=true --set impl=fused"
  "extras n1024-f32 ce-weighted-smoothed fused-inplace|--config configs/bench-grpo-n1024-f32.yaml --set op=cross_entropy --set label_smoothing=0.1 --set with_class_weights=true"
)
reversed=()
for ((i = $#; i >= 1; i--)); do reversed+=("${!i}"); done
for r in $(seq "$rounds"); do
  for arm in "${arms[@]}"; do
    name=${arm%%|*}
    [[ -n ${ARMS:-} && ! $name =~ ${ARMS} ]] && continue
    read -ra args <<<"${arm#*|}"
    if ((r % 2)); then bins=("$@"); else bins=("${reversed[@]}"); fi
    for bin in "${bins[@]}"; do
      v=$("$bin" bench "${args[@]}" 2>/dev/null |
        awk '/step_s_p50/{s=$2}/p50_over_floor/{f=$2}/copy_gbps/{c=$2}/pass_floor_s/{p=$2}/p50_over_pass_floor/{q=$2}
             END{printf "%.4f %.2f %.1f %.4f %.2f", s, f, c, p, q}')
      echo "$r|$name|$bin|$v"
    done
  done
done

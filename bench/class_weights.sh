#!/bin/bash
# The cost of cross-entropy's class weights (docs/BENCHMARKS.md, "Class weights for
# cross-entropy"): the logits-level CE step at N=1024, V=151936, bf16, with and without label
# smoothing and class weights, in place and into a new buffer; the four arms alternated,
# ROUNDS rounds (default 3). Run from the repository root after `cargo build --release`.
set -euo pipefail
ROUNDS=${1:-3}
BIN=./target/release/flashgrpo
CFG=configs/bench-grpo-n1024-bf16.yaml
for round in $(seq "$ROUNDS"); do
  for impl in fused-inplace fused; do
    for arm in "s0" "s0 w" "s01" "s01 w"; do
      sets=(--set op=cross_entropy --set impl="$impl" --set steps=7 --set warmup=2)
      case "$arm" in *s01*) sets+=(--set label_smoothing=0.1) ;; esac
      case "$arm" in *w) sets+=(--set with_class_weights=true) ;; esac
      out=$("$BIN" bench --config "$CFG" "${sets[@]}" 2>/dev/null)
      p50=$(echo "$out" | awk '/bench\/step_s_p50/ {print $2}')
      gb=$(echo "$out" | awk '/bench\/copy_gbps/ {print $2}')
      echo "round $round $impl [$arm] p50 $p50 copy $gb"
    done
  done
done

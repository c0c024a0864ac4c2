#!/usr/bin/env bash
# One command for the side-by-side table: builds flashgrpo (release), creates the peer venv on
# first use (PyTorch, torch.compile, JAX), and runs ours and the peers in the same run.
#   bench/compare.sh [--n 1024] [--vocab 151936] [--dtypes f32,bf16] [--ops grpo,cross_entropy,logprob] [--markdown OUT.md]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cargo build --release --quiet
python=$(bench/peers/setup.sh "${FLASHGRPO_PEERS_VENV:-$root/.venv-peers}" | tail -n 1)
exec "$python" bench/compare.py --bin "$root/target/release/flashgrpo" "$@"

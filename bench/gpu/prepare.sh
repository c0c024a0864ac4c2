#!/usr/bin/env bash
# Run HERE (the build machine) before a GPU run: builds what the GPU machine cannot (it has no Rust
# toolchain and no network) into gpu-carry/ (gitignored, < 64 MiB, what the device tool's `carry`
# takes): the stripped release binary, the stripped CUDA kernel tests, and the liger-kernel wheel
# for the peer script. Then: the device tool's run with carry ["gpu-carry"] and the command
# `bash bench/gpu/run.sh check` (then `bench`); see docs/GPU.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p flashgrpo-cli
tests=$(cargo test --release -p flashgrpo-kernels --features cuda --test cuda --no-run --message-format=json \
    | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cuda" and m.get("executable"):
        print(m["executable"])')
rm -rf gpu-carry && mkdir -p gpu-carry/wheels
cp target/release/flashgrpo gpu-carry/flashgrpo
cp "$tests" gpu-carry/cuda-tests
strip gpu-carry/flashgrpo gpu-carry/cuda-tests
# liger-kernel is pure Python (py3-none-any); torch and triton are on the GPU machine already.
PIP=.venv-peers/bin/pip
[ -x "$PIP" ] || PIP="python3 -m pip"
$PIP download --quiet --no-deps --only-binary=:all: -d gpu-carry/wheels "liger-kernel==0.8.5"
du -sh gpu-carry
ls -l gpu-carry gpu-carry/wheels

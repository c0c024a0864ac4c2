#!/usr/bin/env bash
# Builds the `flashgrpo` wheel (crates/python, maturin) and installs it into a Python environment.
# Usage: crates/python/install.sh [PYTHON]   (default: the peers' venv, created by bench/peers/setup.sh)
# The Rust build goes to target/python, so that it never waits on a cargo build of the workspace.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
python=${1:-$(bash "$root/bench/peers/setup.sh" | tail -1)}
# Absolute (not resolved: a venv's python is a link to the base interpreter), so that pip's build
# subprocess, in another directory, finds the venv's maturin on PATH.
python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")"
if ! "$python" -c "import maturin" 2>/dev/null; then
  "$python" -m pip install -q --disable-pip-version-check "maturin>=1.9,<2" >&2
fi
echo "building and installing the flashgrpo wheel into $python (release build, a few minutes the first time)" >&2
PATH="$(dirname "$python"):$PATH" CARGO_TARGET_DIR="$root/target/python" "$python" -m pip install -q --disable-pip-version-check \
  --no-build-isolation --no-deps --force-reinstall "$here" >&2
"$python" -c "import flashgrpo, flashgrpo._native as n; print(flashgrpo.__file__)"

#!/usr/bin/env bash
# Creates (once) the Python virtual environment with the peers: PyTorch, Liger-Kernel, safetensors.
# Usage: bench/peers/setup.sh [VENV_DIR]   (default: .venv-peers at the repository root)
# Prints the venv's python path on the last line. Safe to run concurrently (flock).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=${1:-$root/.venv-peers}
req="$here/requirements.txt"
stamp="$venv/.flashgrpo-requirements"
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && cmp -s "$req" "$stamp"; then
  echo "$venv/bin/python"
  exit 0
fi
echo "setting up the peer venv in $venv (PyTorch, Liger-Kernel; a few GB, about 2 minutes, once)" >&2
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check --upgrade pip >&2
"$venv/bin/pip" install -q --disable-pip-version-check -r "$req" >&2
cp "$req" "$stamp"
echo "$venv/bin/python"

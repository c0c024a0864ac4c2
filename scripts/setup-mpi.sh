#!/usr/bin/env bash
# Installs what multi-process flashgrpo needs to build and run with `--features mpi`: Open MPI
# (runtime and headers), libclang (the `mpi` crate's bindgen) and pkg-config, from Debian's
# packages. Does nothing when they are already there. Called by the MPI tests of the README's
# test command (crates/cli/tests/mpi.rs), so a fresh machine needs no manual step.
# Prints the path of mpirun on its last line.
set -euo pipefail

have_all() {
    command -v mpirun >/dev/null && command -v mpicc >/dev/null && command -v pkg-config >/dev/null \
        && ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1
}

if ! have_all; then
    packages=(openmpi-bin libopenmpi-dev libclang-dev pkgconf)
    if [ "$(id -u)" = 0 ]; then
        sudo=()
    elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        sudo=(sudo -n)
    else
        echo "setup-mpi: Open MPI is missing and this user cannot install packages;" >&2
        echo "  run as root: apt-get install -y ${packages[*]}" >&2
        exit 1
    fi
    if ! command -v apt-get >/dev/null; then
        echo "setup-mpi: no apt-get here; install Open MPI (mpirun, mpicc), libclang and pkg-config" >&2
        exit 1
    fi
    echo "setup-mpi: installing ${packages[*]}" >&2
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >&2
fi
have_all || { echo "setup-mpi: installation incomplete (mpirun, mpicc, pkg-config, libclang)" >&2; exit 1; }
command -v mpirun

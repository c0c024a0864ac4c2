"""Compiles every CUDA source of flashgrpo to PTX for sm_80 and sm_90 with NVRTC, on a machine with
no GPU and no CUDA toolkit: libnvrtc and the CUDA headers come from the `nvidia-cuda-nvrtc` /
`nvidia-cuda-runtime` wheels of the peer venv (bench/peers/requirements.txt). A source that does not
compile fails with NVRTC's log. Prints "N sources x M architectures compiled, 0 failures".

Usage: python tests/cuda/nvrtc_compile.py [SOURCE.cu ...]   (default: crates/kernels/src/cuda/*.cu)
"""

import ctypes
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARCHS = ["compute_80", "compute_90"]


def cuda_dirs():
    """The wheel's lib and include directories (CUDA 13 wheels: nvidia/cu13; older: per package)."""
    import nvidia  # namespace package of the NVIDIA wheels

    for base in nvidia.__path__:
        for lib in glob.glob(os.path.join(base, "**", "libnvrtc.so*"), recursive=True):
            if "builtins" in os.path.basename(lib):
                continue
            lib_dir = os.path.dirname(lib)
            includes = [d for d in glob.glob(os.path.join(base, "**", "include"), recursive=True)
                        if os.path.exists(os.path.join(d, "cuda_fp16.h"))]
            return lib, lib_dir, includes
    raise SystemExit("no libnvrtc.so in the venv's nvidia wheels: pip install nvidia-cuda-nvrtc")


# rows.cu's tuning switches (FLASHGRPO_CUDA_DEFINES): the variants docs/BENCHMARKS.md timed must
# still compile, for sm_90, beside the defaults.
VARIANTS = [
    [],
    ["FLASHGRPO_FAST_EXP=0", "FLASHGRPO_STATS_BYTES=32", "FLASHGRPO_GRAD_BYTES=32"],
    ["FLASHGRPO_STATS_BYTES=64", "FLASHGRPO_GRAD_BYTES=64"],
]


def compile_ptx(nvrtc, source_path, arch, includes, defines=()):
    src = open(source_path, "rb").read()
    prog = ctypes.c_void_p()
    check = lambda r, what: r == 0 or (_ for _ in ()).throw(RuntimeError(f"{what} returned {r}"))
    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, os.path.basename(source_path).encode(), 0, None, None),
          "nvrtcCreateProgram")
    opts = [f"--gpu-architecture={arch}", "--std=c++17", "-default-device"] + [f"-I{d}" for d in includes]
    opts += [f"--define-macro={d}" for d in defines]
    c_opts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    result = nvrtc.nvrtcCompileProgram(prog, len(opts), c_opts)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    ptx_len = 0
    if result == 0:
        nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetPTX(prog, ptx)
        ptx_len = size.value
        if b".entry" not in ptx.raw:
            result, log = -1, ctypes.create_string_buffer(b"PTX has no kernel entry")
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return result, log.value.decode(errors="replace"), ptx_len


def main():
    sources = sys.argv[1:] or sorted(glob.glob(os.path.join(ROOT, "crates", "kernels", "src", "cuda", "*.cu")))
    if not sources:
        raise SystemExit("no CUDA sources found")
    lib, lib_dir, includes = cuda_dirs()
    # libnvrtc loads its builtins library from the same directory.
    os.environ["LD_LIBRARY_PATH"] = lib_dir + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")
    for builtins in glob.glob(os.path.join(lib_dir, "libnvrtc-builtins.so*")):
        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
    nvrtc = ctypes.CDLL(lib)
    failures = 0
    for source in sources:
        builds = [(arch, []) for arch in ARCHS]
        if os.path.basename(source) == "rows.cu":
            builds += [("compute_90", v) for v in VARIANTS if v]
        for arch, defines in builds:
            result, log, size = compile_ptx(nvrtc, source, arch, includes, defines)
            name = os.path.relpath(source, ROOT) + (f" [{' '.join(defines)}]" if defines else "")
            if result != 0:
                failures += 1
                print(f"FAIL {name} for {arch}:\n{log}")
            else:
                print(f"ok   {name} for {arch}: {size} bytes of PTX")
    print(f"{len(sources)} sources x {len(ARCHS)} architectures (and rows.cu's tuning variants) compiled, {failures} failures")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

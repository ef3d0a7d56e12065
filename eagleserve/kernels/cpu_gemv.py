"""Blocked 4-/8-bit GEMV/GEMM for x86 CPUs with AVX2 + FMA (`cpu_gemv.cpp`), built on first use.

Activations are quantized to int8 per 32-block, as llama.cpp does for these weight types.

The C++ source is compiled once per (source, torch version, compiler flags) into the eagleserve
cache with the system C++ compiler and loaded as the torch ops `eagleserve_cpu::q4_matmul` and
`eagleserve_cpu::q8_matmul`. Where the CPU lacks AVX2/FMA or no compiler is found, `load()`
returns False and the caller keeps torch's own int4 kernel.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import torch

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_gemv.cpp")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", "-std=c++17"]
_lock = threading.Lock()
_loaded: bool | None = None


def cpu_supported() -> bool:
    """AVX2 + FMA on an x86-64 Linux host (what the kernel is written for)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


def _cache_dir() -> str:
    root = os.environ.get("EAGLESERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache"))
    base = root if "EAGLESERVE_CACHE" in os.environ else os.path.join(root, "eagleserve")
    return os.path.join(base, "kernels")


def _build(out: str) -> None:
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++/g++) found")
    inc = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out)) as tmp:
        tmp_out = os.path.join(tmp, "lib.so")
        cmd = [cxx, *_FLAGS, abi, *inc, _SOURCE, "-o", tmp_out, *libs, "-lc10", "-ltorch_cpu"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {_SOURCE} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp_out, out)  # atomic: a concurrent process sees all of it or nothing


def load() -> bool:
    """Builds (once) and loads the kernel; False where it cannot run here (logged once)."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        _loaded = False
        if not cpu_supported():
            return False
        with open(_SOURCE, "rb") as f:
            key = hashlib.sha256(f.read() + " ".join(_FLAGS).encode() + torch.__version__.encode())
        out = os.path.join(_cache_dir(), f"cpu_gemv_{key.hexdigest()[:16]}.so")
        try:
            if not os.path.exists(out):
                os.makedirs(os.path.dirname(out), exist_ok=True)
                logger.info("building the AVX2 int4/int8 CPU kernel (once): %s", out)
                _build(out)
            torch.ops.load_library(out)
            _loaded = True
        except (RuntimeError, OSError) as e:
            logger.warning("AVX2 CPU kernel unavailable, using torch's int4 kernel: %s", e)
        return _loaded


def q4_matmul(x: torch.Tensor, w: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 (int8 per block inside) @ W.T, W from nibbles w [N, K/2] (ggml block
    layout), w = d*q + m."""
    return torch.ops.eagleserve_cpu.q4_matmul(x, w, d, m)


def q8_matmul(x: torch.Tensor, w: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 (int8 per block inside) @ W.T, W int8 [N, K] with one scale per 32-block,
    w = d*q."""
    return torch.ops.eagleserve_cpu.q8_matmul(x, w, d)

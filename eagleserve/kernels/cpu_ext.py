"""eagleserve's CPU kernels for x86 with AVX2, FMA and F16C, built on first use:

- `cpu_gemv.cpp`: blocked 4-/8-bit GEMV/GEMM (`q4_matmul`, `q8_matmul`) over weights in column
  tiles (`pack_q4`, `pack_q8`), with `cpu_gemv_avx512.cpp` where the CPU has AVX-512 VNNI
  and `cpu_gemm_amx.cpp` for each 16 rows of a call where it has AMX-INT8 too; activations
  are quantized to int8 per 32-block, as llama.cpp does for these weight types;
- `cpu_attention.cpp`: paged attention for decode/verify rows (`paged_attention`), fp32, with
  `cpu_attention_avx512.cpp`'s scores and weighted sums for a prefill's rows where the CPU has
  AVX-512 (the same bits);
- `cpu_norm.cpp`: RMSNorm of fp32 rows in one call (`rms_norm`);
- `cpu_pointwise.cpp`: rotary of the fused q/k heads in place (`rope_`) and `silu_mul`;
- `cpu_layers.cpp`: a packed target's decoder layers in one call (`decoder_layers`), an
  EAGLE-3 head's layer and lm_head in another (`eagle3_layer`), the kernels above in the
  order the modules call them;
- `cpu_argmax.cpp`: argmax over the last dim of fp32 rows (`argmax_rows`), torch.argmax's
  answer in one vectorized pass per row, a chain verify's greedy walk over them
  (`greedy_chain_walk`) and a chain draft's top-1 and its probability (`top1_rows`);
- `cpu_sample.cpp`: a sampled row's token from its logits (`sample_rows`): temperature, top-k,
  top-p, min-p and the seeded exponential race, without sorting the vocabulary.

All keep a row's result independent of the rows beside it (what makes a verify reproduce the
decodes bit for bit). The sources are compiled once per (sources, torch version, flags) into
the eagleserve cache with the system C++ compiler and loaded as `torch.ops.eagleserve_cpu`.
Where the CPU lacks AVX2/FMA/F16C or no compiler is found, `load()` returns False and callers keep
torch's own kernels.
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
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_SOURCES = [
    os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    for name in (
        "cpu_gemv.cpp", "cpu_gemv_avx512.cpp", "cpu_gemm_amx.cpp", "cpu_attention.cpp",
        "cpu_attention_avx512.cpp", "cpu_norm.cpp", "cpu_pointwise.cpp", "cpu_layers.cpp",
        "cpu_argmax.cpp", "cpu_sample.cpp",
    )
]  # fmt: skip
_HEADERS = [
    os.path.join(os.path.dirname(_SOURCES[0]), n)
    for n in ("cpu_simd.h", "cpu_kernels.h", "cpu_attention_keys.h", "cpu_attention_query.h")
]
# -ffp-contract=off: g++ would otherwise fuse a written mul + add into one fma where it sees
# fit (intrinsics included); the kernels' op order is their row-invariance contract.
_FLAGS = [
    "-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-std=c++17",
]  # fmt: skip
_lock = threading.Lock()
_loaded: bool | None = None


def cpu_supported() -> bool:
    """AVX2, FMA and F16C on an x86-64 Linux host (what the kernels are written for)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags and "f16c" in flags


def _cache_dir() -> str:
    root = os.environ.get("EAGLESERVE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "eagleserve"
    )  # the model cache's root (models/loader.py)
    return os.path.join(root, "kernels")


def _build(out: str) -> None:
    """One compiler process per source, as many at once as the host has cores (the sources
    include ATen's headers, most of each one's compile time), then one link."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++/g++) found")
    inc = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out)) as tmp:

        def run(cmd: list[str]) -> None:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"compiling the CPU kernels failed:\n{proc.stderr[-2000:]}")

        objects = [os.path.join(tmp, f"{i}.o") for i in range(len(_SOURCES))]
        compiles = [[cxx, *_FLAGS, abi, *inc, "-c", src, "-o", obj]
                    for src, obj in zip(_SOURCES, objects, strict=True)]  # fmt: skip
        with ThreadPoolExecutor(min(len(compiles), os.cpu_count() or 1)) as pool:
            list(pool.map(run, compiles))
        tmp_out = os.path.join(tmp, "lib.so")
        run([cxx, *_FLAGS, "-shared", *objects, "-o", tmp_out, *libs, "-lc10", "-ltorch_cpu"])
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
        key = hashlib.sha256(" ".join(_FLAGS).encode() + torch.__version__.encode())
        for path in _SOURCES + _HEADERS:
            with open(path, "rb") as f:
                key.update(f.read())
        out = os.path.join(_cache_dir(), f"cpu_kernels_{key.hexdigest()[:16]}.so")
        try:
            if not os.path.exists(out):
                os.makedirs(os.path.dirname(out), exist_ok=True)
                logger.info("building the AVX2 CPU kernels (once): %s", out)
                _build(out)
            torch.ops.load_library(out)
            _loaded = True
        except (RuntimeError, OSError) as e:
            logger.warning("AVX2 CPU kernels unavailable, using torch's: %s", e)
        return _loaded


def loaded() -> bool:
    """Whether the kernels are loaded in this process (never builds them: for callers with a
    torch fallback that should not pay for a build, such as sampling)."""
    return _loaded is True


def pack_q4(nibbles: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Column tiles of a 4-bit weight (cpu_gemv.cpp's layout) from ggml's nibbles
    uint8 [N, K/2], w = d*q + m with d, m [N, K/32] fp16 values (ggml's): (weights, d, m as
    fp16 tiles), N padded to 16."""
    n, g = d.shape
    pad = -n % 16
    t = (n + pad) // 16
    w = F.pad(nibbles, (0, 0, 0, pad)).view(t, 16, g, 4, 4).permute(0, 2, 3, 1, 4)
    d16, m16 = _exact_half(d, "d"), _exact_half(m, "m")
    return w.contiguous(), _scale_tiles(d16, pad), _scale_tiles(m16, pad)


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Column tiles of an 8-bit weight, q int8 [N, K], w = d*q with d [N, K/32] fp16 values:
    (weights, d as fp16 tiles, 128 * each block's weight sum as int32), N padded to 16."""
    n, g = d.shape
    pad = -n % 16
    t = (n + pad) // 16
    w = F.pad(q, (0, 0, 0, pad)).view(t, 16, g, 8, 4).permute(0, 2, 3, 1, 4)
    wsum = 128 * q.view(n, g, 32).sum(-1, dtype=torch.int32)
    return w.contiguous(), _scale_tiles(_exact_half(d, "d"), pad), _scale_tiles(wsum, pad)


def _exact_half(s: torch.Tensor, name: str) -> torch.Tensor:
    """s as fp16, which the kernels read (half the scale bytes of fp32); GGUF blocks store
    their scales so, and so does gguf_weights.quantize_q4_1: anything else is refused, not
    rounded."""
    half = s.half()
    if not torch.equal(half.float(), s.float()):
        raise ValueError(f"block scales ({name}) must be fp16 values, as ggml stores them")
    return half


def _scale_tiles(s: torch.Tensor, pad: int) -> torch.Tensor:
    """[N, G] per-block values -> [T, G, 16], a tile's 16 columns side by side."""
    g = s.shape[1]
    return F.pad(s, (0, 0, 0, pad)).view(-1, 16, g).transpose(1, 2).contiguous()


def q4_matmul(
    x: torch.Tensor, w: torch.Tensor, d: torch.Tensor, m: torch.Tensor, n: int
) -> torch.Tensor:
    """x [M, K] fp32 (int8 per block inside) @ W.T [K, n], W as pack_q4's tiles."""
    return torch.ops.eagleserve_cpu.q4_matmul(x, w, d, m, n)


def q8_matmul(
    x: torch.Tensor, w: torch.Tensor, d: torch.Tensor, wsum: torch.Tensor, n: int
) -> torch.Tensor:
    """x [M, K] fp32 (int8 per block inside) @ W.T [K, n], W as pack_q8's tiles."""
    return torch.ops.eagleserve_cpu.q8_matmul(x, w, d, wsum, n)


def gemv_isa(isa: str = "") -> str:
    """The instructions `q4_matmul`/`q8_matmul` run: "avx2", "avx512_vnni", or "amx" (AVX-512
    VNNI, and AMX-INT8 tile multiplies for each 16 rows of a call); the best the CPU has,
    chosen at load; all give the same bits. Pass one of those, or "auto", to switch for every
    later call (tests and A/B benchmarks)."""
    return str(torch.ops.eagleserve_cpu.gemv_isa(isa))


def attention_isa(isa: str = "") -> str:
    """The instructions `paged_attention` (and the one-call layers' attention) runs: "avx2", or
    "avx512" where the CPU has it (chosen at load), which takes the AVX-512 kernels for units of
    5 or more rows on one slot list (a prefill chunk's, a long chain verify's) and AVX2's for
    the rest; both give the same bits. Pass one of those, or "auto", to switch for every later
    call (tests and A/B benchmarks)."""
    return str(torch.ops.eagleserve_cpu.attention_isa(isa))


def store_kv_(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k_buffer[loc] = k and v_buffer[loc] = v in one call (an fp32 or fp16 pool, fp16 rounded to
    nearest even as `.half()`; k, v fp32 [T, Hkv, D] with each row's heads contiguous)."""
    torch.ops.eagleserve_cpu.store_kv_(k_buffer, v_buffer, loc, k, v)


def paged_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    tree_mask: torch.Tensor | None,
    sm_scale: float,
) -> torch.Tensor:
    """q [T, H, D] fp32 (each row's heads contiguous) over the paged fp32 or fp16 K/V
    (kernels/torch_attention.py's layout) -> [T, H, D] fp32."""
    return torch.ops.eagleserve_cpu.paged_attention(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens,
        kv_lens, tree_mask, sm_scale,
    )  # fmt: skip


def rope_(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int) -> None:
    """Rotates heads [0, heads) of qkv [T, H, D] in place (BoundRotary.apply's bits)."""
    torch.ops.eagleserve_cpu.rope_(qkv, cos, signed_sin, heads)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for fp32 gate_up [..., 2I] = [gate | up] -> [..., I]."""
    return torch.ops.eagleserve_cpu.silu_mul(gate_up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2, -1) + eps)) for fp32 x [..., K]."""
    return torch.ops.eagleserve_cpu.rms_norm(x, weight, eps)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) for fp32 logits [..., V], the same indices (ties: the first; NaN:
    the first NaN)."""
    return torch.ops.eagleserve_cpu.argmax_rows(logits)


def greedy_chain_walk(tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The greedy acceptance of a chain verify, tokens [bs, n] against the argmax of logits
    [bs * n, V] fp32 (cpu_argmax.cpp), packed as spec/accept.py's packed_walk packs it."""
    return torch.ops.eagleserve_cpu.greedy_chain_walk(tokens, logits)


def top1_rows(
    logits: torch.Tensor, id_map: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax of head logits [R, V] fp32, mapped through id_map [V] where given,
    and its softmax probability: (p [R, 1] fp32, ids [R, 1] int64) (cpu_argmax.cpp)."""
    return torch.ops.eagleserve_cpu.top1_rows(logits, id_map)


def sample_rows(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    columns: torch.Tensor | None = None,
) -> torch.Tensor:
    """Column indices [m] of fp32 logits [m, V], each row drawn from its temperature / top-k /
    top-p / min-p distribution by the race on the noise of (its seed, its position):
    sampler.py's rule. `columns` [V]: the token id of each column, which keys its noise
    (default: the column's index)."""
    return torch.ops.eagleserve_cpu.sample_rows(
        logits, temperatures, top_ks, top_ps, min_ps, seeds, positions, columns
    )


def decoder_layers(
    h: torch.Tensor,
    weights: list[torch.Tensor],
    out_features: list[int],
    shape: tuple[float, int, int],
    rotary: tuple[torch.Tensor, torch.Tensor],
    kv: tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor],
    rows: tuple[torch.Tensor, ...],
    sm_scale: float,
    aux_layers: list[int],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every decoder layer of a packed target over h [T, hidden] fp32 (cpu_layers.cpp):
    weights 14 per layer, out_features 4 per layer (models/cpu_layers.py builds both);
    shape (rms eps, heads, kv heads); rotary (cos, signed sin); kv (K buffers, V buffers, the
    new tokens' slots); rows (req_to_token, req_pool_indices, prefix_lens, extend_lens,
    kv_lens, tree_mask or None) as `paged_attention` takes them. Returns the last layer's
    output and the hidden states entering `aux_layers`, side by side [T, len * hidden] (None
    without aux layers)."""
    eps, heads, kv_heads = shape
    out, aux = torch.ops.eagleserve_cpu.decoder_layers(
        h, weights, out_features, eps, heads, kv_heads, *rotary, *kv, *rows, sm_scale, aux_layers
    )
    return out, aux if aux_layers else None


def eagle3_layer(
    input_ids: torch.Tensor,
    features: torch.Tensor,
    inputs: tuple[torch.Tensor, list[torch.Tensor]],
    weights: list[torch.Tensor],
    out_features: list[int],
    shape: tuple[float, int, int],
    rotary: tuple[torch.Tensor, torch.Tensor],
    kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rows: tuple[torch.Tensor | None, ...],
    sm_scale: float,
    last_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An EAGLE-3 head's layer and lm_head (cpu_layers.cpp) over the tokens input_ids [T] and
    the features [T, F] fp32 they continue from: a draft step's (F = hidden) or the target's,
    fused by the fc tiles; inputs (the target's embedding table, the fc tiles or []), weights
    19 and out_features 5 (models/cpu_layers.py, CpuHeadLayer builds them); shape, rotary and
    rows as `decoder_layers` takes them; kv (K buffer, V buffer, the new tokens' slots).
    Returns (logits [T, draft vocab], the layer's output); with `last_rows` (each request's
    last row of a causal extend) every row's K/V is written and the two outputs are of those
    rows alone."""
    eps, heads, kv_heads = shape
    args = (input_ids, features, *inputs, weights, out_features, eps, heads, kv_heads, *rotary,
            *kv, *rows, sm_scale)  # fmt: skip
    return torch.ops.eagleserve_cpu.eagle3_layer(*args, last_rows)


def phase_times(on: bool) -> dict[str, tuple[float, int]]:
    """The one-call layers' phase timers (`decoder_layers::qkv_proj`, `eagle3_layer::mlp`, ...):
    turns them on or off and returns {phase: (seconds, calls)} since the last call. Off by
    default; a benchmark's tool (bench/forward_phases_cpu.py), not the server's."""
    names, seconds, calls = torch.ops.eagleserve_cpu.phase_times(on)
    return {n: (s, c) for n, s, c in zip(names, seconds, calls)}

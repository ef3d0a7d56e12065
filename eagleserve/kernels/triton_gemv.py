"""Small-batch (GEMV-shaped) Triton kernels that fold a decoder layer's pointwise ops into its
GEMMs, so a decode layer is four launches besides attention, one more for each split K
(models/fused_forward.py):

- `norm_qkv_rope_store_kv` (kernels/triton_qkv_rope.py): residual add + RMSNorm, the qkv
  projection, neox rotary of q and k and the K/V write to their KV-pool slots.
- `norm_gemm`: residual add + RMSNorm and a projection (gate_up); `gemm`, the same kernel
  without the norm: a plain projection (o_proj).
- `silu_mul_gemm`: SiLU(gate) * up of a gate_up output and a projection (down).

Each is one launch, or two with split_k > 1: its K range is cut into split_k ranges run by
programs of their own (a projection with few column blocks, such as the down projection or a
GQA qkv, leaves most of a large GPU idle otherwise), and a second launch sums their fp32
partials in split order. The column block, K step, split and warps of each launch come from
kernels/gemv_config.py: per weight shape and device, tuned by bench/tune_gemv.py, the same for
any number of rows.

Where a launch's K step covers all of K and it is not split (`one_tile`), the qkv and norm_gemm
kernels have no K loop: the row, its residual and the weight tile are loaded at once, and the
row's RMS comes from the same registers, where the loop reads the row twice (its RMS first)
and the weight only after. A small model's projections are a few microseconds of latency each,
not of bandwidth: one round trip to memory instead of several is the saving. The bits are the
loop's with the same setting.

Every value is rounded to the model dtype where the unfused kernels of kernels/triton_fused.py
(and the torch path of models/llama.py) round it: the sum x + residual, the normed row before
and after the weight, each projection output (bias added first), silu(gate), the product, the
rotated q/k. Only each dot product's summation order differs from cuBLAS's. The RMS of a row is
recomputed by every program over the whole row (the row is small and re-read from cache), and
the new residual is written by the programs of the first column block only, each split its own
K range, once per row.

Batch-invariant: the tiles, the K order and the compiled kernel are the same for any number of
rows (T is not specialized; the settings are keyed by the weight, not the rows), so a row's
result does not depend on the rows around it; the batch-invariant mode runs these kernels at
every size (models/fused_forward.py). The row block is grid axis 0, so the programs sharing a
weight tile run side by side and read it once from memory when a forward has many row blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagleserve.kernels import (
    pdl,
    triton_interpreter,  # noqa: F401  (before any launch)
)
from eagleserve.kernels.gemv_config import GemvConfig, config_for
from eagleserve.kernels.triton_common import _dot, _ieee_dot, wait_previous

BLOCK_M = 16  # rows per program: tl.dot's least M; a batch of at most this many is one block
# The fp32 partials of one split launch hold at most this many values; a longer batch (a
# batch-invariant prefill) runs in chunks of whole row blocks, which gives each row the same bits.
_MAX_PARTIALS = 1 << 24


@triton.jit
def _row_rstd(X, Res, stride_x, stride_r, rows, row_ok, K, eps,
              HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """1 / rms of each row of (x + residual rounded to the dtype), [BLOCK_M] fp32."""
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (offs_k < K)[None, :]
        x = tl.load(X + rows[:, None] * stride_x + offs_k[None, :], mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(Res + rows[:, None] * stride_r + offs_k[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        xf = x.to(tl.float32)
        sq += tl.sum(xf * xf, 1)
    return 1.0 / tl.sqrt(sq / K + eps)


@triton.jit
def _summed_tile(X, Res, ResOut, stride_x, stride_r, stride_ro, rows, row_ok, offs_k, K,
                 write_res, HAS_RES: tl.constexpr):  # fmt: skip
    """(x + residual)[rows, offs_k] rounded to the model dtype (x alone without a residual);
    where write_res (a program of the first column block), also stored: the new residual."""
    mask = row_ok[:, None] & (offs_k < K)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + offs_k[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(Res + rows[:, None] * stride_r + offs_k[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(ResOut + rows[:, None] * stride_ro + offs_k[None, :], x, mask=mask & write_res)
    return x


@triton.jit
def _scaled_tile(x, rstd, NormW, offs_k, K):
    """RMSNorm of a summed tile given its rows' 1 / rms, rounded as add_rms_norm rounds."""
    normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(NormW + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    return (normed * w[None, :]).to(x.dtype)


@triton.jit
def _normed_tile(X, Res, NormW, ResOut, stride_x, stride_r, stride_ro, rows, row_ok, offs_k,
                 K, rstd, write_res, HAS_RES: tl.constexpr):  # fmt: skip
    """RMSNorm(x + residual)[rows, offs_k] in the model dtype (the rows' rstd from
    _row_rstd); where write_res, the new residual stored too."""
    x = _summed_tile(X, Res, ResOut, stride_x, stride_r, stride_ro, rows, row_ok, offs_k, K,
                     write_res, HAS_RES)  # fmt: skip
    return _scaled_tile(x, rstd, NormW, offs_k, K)


@triton.jit
def _normed_row(X, Res, NormW, ResOut, stride_x, stride_r, stride_ro, rows, row_ok, K, eps,
                write_res, HAS_RES: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """_normed_tile of a whole row (K <= BLOCK_K) with its rstd from the same registers: the
    bits of _row_rstd's one step and _normed_tile, one read of the row instead of two."""
    offs_k = tl.arange(0, BLOCK_K)
    x = _summed_tile(X, Res, ResOut, stride_x, stride_r, stride_ro, rows, row_ok, offs_k, K,
                     write_res, HAS_RES)  # fmt: skip
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt((0.0 + tl.sum(xf * xf, 1)) / K + eps)
    return _scaled_tile(x, rstd, NormW, offs_k, K)


@triton.jit(do_not_specialize=["T"])
def _norm_gemm_kernel(
    X, Res, NormW, W, Out, ResOut,  # x, res [T, K]; W [N, K]; Out [S, T, N]: split s's sums
    T, N, K, K_PER, eps,  # K_PER: the K range of a split, a multiple of BLOCK_K
    stride_x, stride_r, stride_w, stride_os, stride_o, stride_ro,
    HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, IEEE: tl.constexpr,
    ONE_TILE: tl.constexpr,  # K <= BLOCK_K, unsplit: the row and the weight tile read at once
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    row_ok = rows < T
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if ONE_TILE:  # no loop: the weight tile's load is not held behind the row's norm
        offs_k = tl.arange(0, BLOCK_K)
        # No kernel writes a weight: with PDL its load overlaps the previous kernel's tail.
        w = tl.load(W + offs_n[None, :] * stride_w + offs_k[:, None],
                    mask=(offs_k < K)[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
        wait_previous(PDL)
        if HAS_NORM:
            a = _normed_row(X, Res, NormW, ResOut, stride_x, stride_r, stride_ro, rows, row_ok,
                            K, eps, pid_n == 0, HAS_RES, BLOCK_K)  # fmt: skip
        else:
            a = tl.load(X + rows[:, None] * stride_x + offs_k[None, :],
                        mask=row_ok[:, None] & (offs_k < K)[None, :], other=0.0)  # fmt: skip
        acc = 0.0 + _dot(a, w, IEEE)
    else:
        wait_previous(PDL)
        if HAS_NORM:
            rstd = _row_rstd(X, Res, stride_x, stride_r, rows, row_ok, K, eps,
                             HAS_RES, BLOCK_M, BLOCK_K)  # fmt: skip
        else:
            rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = split * K_PER
        for k0 in range(k_start, tl.minimum(k_start + K_PER, K), BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if HAS_NORM:
                a = _normed_tile(X, Res, NormW, ResOut, stride_x, stride_r, stride_ro, rows,
                                 row_ok, offs_k, K, rstd, pid_n == 0, HAS_RES)  # fmt: skip
            else:  # a plain GEMM (o_proj): the rows as they are
                a = tl.load(X + rows[:, None] * stride_x + offs_k[None, :],
                            mask=row_ok[:, None] & (offs_k < K)[None, :], other=0.0)  # fmt: skip
            w = tl.load(W + offs_n[None, :] * stride_w + offs_k[:, None],
                        mask=(offs_k < K)[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
            acc += _dot(a, w, IEEE)
    out = Out + split * stride_os + rows[:, None] * stride_o + offs_n[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["T"])
def _silu_mul_gemm_kernel(
    GateUp, W, Out,  # GateUp [T, 2K]; W [N, K]; Out [S, T, N]: split s's sums (S = 1: the output)
    T, N, K, K_PER,  # K_PER: the K range of a split, a multiple of BLOCK_K
    stride_g, stride_w, stride_os, stride_o,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_previous(PDL)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    row_ok = rows < T
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = split * K_PER
    for k0 in range(k_start, tl.minimum(k_start + K_PER, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (offs_k < K)[None, :]
        ptr = GateUp + rows[:, None] * stride_g + offs_k[None, :]
        gate = tl.load(ptr, mask=mask, other=0.0)
        up = tl.load(ptr + K, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        # silu(gate) rounded to the dtype before the product, the product rounded: as silu_mul.
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        a = (act * up.to(tl.float32)).to(gate.dtype)
        w = tl.load(W + offs_n[None, :] * stride_w + offs_k[:, None],
                    mask=(offs_k < K)[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
        acc += _dot(a, w, IEEE)
    out = Out + split * stride_os + rows[:, None] * stride_o + offs_n[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def summed_partials(part, stride_ps, mask, SPLITS: tl.constexpr):
    """The fp32 sum over S of part [S, ...] (the pointers of split 0; split s at s * stride_ps),
    in split order whatever order the splits ran in."""
    acc = tl.load(part, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part + s * stride_ps, mask=mask, other=0.0)
    return acc


@triton.jit(do_not_specialize=["T"])
def _sum_splits_kernel(
    Part, Out,  # Part [S, T, N] fp32; Out [T, N]
    T, N, stride_ps, stride_pt, stride_o,
    SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_previous(PDL)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < T)[:, None] & (offs_n < N)[None, :]
    acc = summed_partials(Part + rows[:, None] * stride_pt + offs_n[None, :], stride_ps, mask,
                          SPLITS)  # fmt: skip
    tl.store(Out + rows[:, None] * stride_o + offs_n[None, :], acc.to(Out.dtype.element_ty),
             mask=mask)  # fmt: skip


def _check_rows(x: torch.Tensor, residual: torch.Tensor | None) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1


def _new_residual(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return x if residual is None else torch.empty_like(x)


def split_k_range(k_dim: int, cfg: GemvConfig) -> tuple[int, int]:
    """(splits, the K range of each, a multiple of block_k) of a K dimension under `cfg`:
    every split gets at least one K step, and the last one may be shorter."""
    steps = triton.cdiv(k_dim, cfg.block_k)
    k_per = triton.cdiv(steps, min(cfg.split_k, steps)) * cfg.block_k
    return triton.cdiv(k_dim, k_per), k_per


def one_tile(k_dim: int, cfg: GemvConfig, splits: int) -> bool:
    """Whether a launch reads its whole K in one tile (no K loop): unsplit, block_k >= K."""
    return splits == 1 and cfg.block_k >= k_dim


def row_chunks(t: int, splits: int, n: int) -> list[slice]:
    """The row ranges a launch of `splits` splits over [t, n] outputs runs one after another:
    all rows unsplit; split, as many whole row blocks as keep the partials within
    _MAX_PARTIALS."""
    if splits == 1:
        return [slice(0, t)]
    step = max(BLOCK_M, _MAX_PARTIALS // (splits * n) // BLOCK_M * BLOCK_M)
    return [slice(r, min(r + step, t)) for r in range(0, t, step)]


def partials(out: torch.Tensor, splits: int) -> tuple[torch.Tensor, int, int]:
    """Where a launch's programs store their sums, with its split and row strides: `out` [T, N]
    itself unsplit, else fp32 [S, T, N]."""
    if splits == 1:
        return out, 0, out.stride(0)
    part = out.new_empty((splits, *out.shape), dtype=torch.float32)
    return part, part.stride(0), part.stride(1)


def sum_splits(part: torch.Tensor, out: torch.Tensor, block_n: int) -> None:
    """out [T, N] = the sum of part [S, T, N] over S in split order, rounded once (S > 1)."""
    t, n = out.shape
    _sum_splits_kernel[(triton.cdiv(t, BLOCK_M), triton.cdiv(n, block_n))](
        part, out, t, n, part.stride(0), part.stride(1), out.stride(0),
        SPLITS=part.shape[0], BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        **pdl.launch_options(out.device),
    )  # fmt: skip


def norm_gemm(
    x: torch.Tensor,  # [T, K]
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,  # [N, K], no bias
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) @ weight.T [T, N], x + residual)."""
    _check_rows(x, residual)
    t, k_dim = x.shape
    n = weight.shape[0]
    assert weight.shape == (n, k_dim) and weight.stride(1) == 1, weight.shape
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    res_out = _new_residual(x, residual)
    if t == 0:
        return out, res_out
    res = residual if residual is not None else x
    _launch_norm_gemm("norm_gemm", x, res, norm_weight, weight, out, res_out, eps,
                      has_norm=True, has_res=residual is not None)  # fmt: skip
    return out, res_out


def gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T -> [T, N] (o_proj); rounded once to the dtype, as a Linear."""
    _check_rows(x, None)
    t, k_dim = x.shape
    n = weight.shape[0]
    assert weight.shape == (n, k_dim) and weight.stride(1) == 1, weight.shape
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    # No norm weight, residual or new residual: those arguments are never read.
    _launch_norm_gemm("gemm", x, x, weight, weight, out, out, 0.0, has_norm=False, has_res=False)
    return out


def _launch_norm_gemm(
    kernel: str,
    x: torch.Tensor,
    res: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    res_out: torch.Tensor,
    eps: float,
    has_norm: bool,
    has_res: bool,
) -> None:
    """`_norm_gemm_kernel` over x's rows with the tuned settings of `kernel` for this weight."""
    k_dim = x.shape[1]
    n = weight.shape[0]
    cfg = config_for(kernel, n, k_dim, weight.dtype, x.device)
    splits, k_per = split_k_range(k_dim, cfg)
    for r in row_chunks(x.shape[0], splits, n):
        t, (part, stride_ps, stride_pt) = x[r].shape[0], partials(out[r], splits)
        _norm_gemm_kernel[(triton.cdiv(t, BLOCK_M), triton.cdiv(n, cfg.block_n), splits)](
            x[r], res[r], norm_weight, weight, part, res_out[r],
            t, n, k_dim, k_per, eps,
            x.stride(0), res.stride(0), weight.stride(0), stride_ps, stride_pt, res_out.stride(0),
            HAS_NORM=has_norm, HAS_RES=has_res, IEEE=_ieee_dot(x),
            ONE_TILE=one_tile(k_dim, cfg, splits),
            BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **cfg.launch_options(),
            **pdl.launch_options(x.device),
        )  # fmt: skip
        if splits > 1:
            sum_splits(part, out[r], cfg.block_n)


def silu_mul_gemm(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(SiLU(gate_up[:, :I]) * gate_up[:, I:]) @ weight.T -> [T, N]."""
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
    inter = gate_up.shape[1] // 2
    n = weight.shape[0]
    assert weight.shape == (n, inter) and weight.stride(1) == 1, weight.shape
    out = torch.empty((gate_up.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0] == 0:
        return out
    cfg = config_for("silu_mul_gemm", n, inter, weight.dtype, gate_up.device)
    splits, k_per = split_k_range(inter, cfg)
    for r in row_chunks(gate_up.shape[0], splits, n):
        t, (part, stride_ps, stride_pt) = gate_up[r].shape[0], partials(out[r], splits)
        _silu_mul_gemm_kernel[(triton.cdiv(t, BLOCK_M), triton.cdiv(n, cfg.block_n), splits)](
            gate_up[r], weight, part, t, n, inter, k_per,
            gate_up.stride(0), weight.stride(0), stride_ps, stride_pt,
            IEEE=_ieee_dot(gate_up),
            BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **cfg.launch_options(),
            **pdl.launch_options(gate_up.device),
        )  # fmt: skip
        if splits > 1:
            sum_splits(part, out[r], cfg.block_n)
    return out

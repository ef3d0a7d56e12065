"""Small-batch (GEMV-shaped) Triton kernels that fold a decoder layer's pointwise ops into its
GEMMs, so a decode layer is five or six launches (models/fused_forward.py):

- `norm_qkv_rope_store_kv`: residual add + RMSNorm, the qkv projection, neox rotary of q and k
  and the K/V write to their KV-pool slots, one launch. A program owns BLOCK_C columns of each
  rotary half of one head (c and c + D/2) for BLOCK_M rows and accumulates the two halves
  apart, so the rotation pairs them in registers; a head's halves split into D/2 / BLOCK_C
  programs keep a large model's GPU busy.
- `norm_gemm`: residual add + RMSNorm and a projection (gate_up), one launch; `gemm`, the
  same kernel without the norm: a plain projection (o_proj).
- `silu_mul_gemm`: SiLU(gate) * up of a gate_up output and a projection (down), one launch;
  with split_k > 1, its K range is cut into split_k ranges run by programs of their own (the
  down projection has few output columns, so few programs walk a long K range), and a second
  launch sums their fp32 partials in split order.

The column block, K step, split and warps of each launch come from kernels/gemv_config.py: per
weight shape and device, tuned by bench/tune_gemv.py, the same for any number of rows.

Every value is rounded to the model dtype where the unfused kernels of kernels/triton_fused.py
(and the torch path of models/llama.py) round it: the sum x + residual, the normed row before
and after the weight, each projection output (bias added first), silu(gate), the product, the
rotated q/k. Only each dot product's summation order differs from cuBLAS's. The RMS of a row is
recomputed by every program (the row is small and re-read from cache), and the new residual is
written by the programs of the first column block only, once per row.

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

from eagleserve.kernels import triton_interpreter  # noqa: F401  (before any launch)
from eagleserve.kernels.gemv_config import config_for
from eagleserve.kernels.triton_common import _dot, _ieee_dot

BLOCK_M = 16  # rows per program: tl.dot's least M; a batch of at most this many is one block


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
def _normed_tile(X, Res, NormW, ResOut, stride_x, stride_r, stride_ro, rows, row_ok, offs_k,
                 K, rstd, write_res, HAS_RES: tl.constexpr):  # fmt: skip
    """RMSNorm(x + residual)[rows, offs_k] in the model dtype, rounded as add_rms_norm rounds;
    where write_res (a program of the first column block), also stores the rounded sum (the
    new residual)."""
    mask = row_ok[:, None] & (offs_k < K)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + offs_k[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(Res + rows[:, None] * stride_r + offs_k[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(ResOut + rows[:, None] * stride_ro + offs_k[None, :], x, mask=mask & write_res)
    normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(NormW + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    return (normed * w[None, :]).to(x.dtype)


# T is never specialized (Triton compiles T == 1 apart otherwise): every batch size runs one
# compiled kernel, so a row's bits do not depend on the batch (the batch-invariant mode).
@triton.jit(do_not_specialize=["T"])
def _norm_qkv_rope_kernel(
    X, Res, NormW, W, Bias, Cos, SignedSin,  # x, res [T, K]; W [(H + 2Hkv) * D, K]; cos [T, D]
    QKV, ResOut, KBuf, VBuf, Loc,  # QKV [T, H + 2Hkv, D]; KBuf, VBuf [S, Hkv, D]; Loc [T]
    T, K, eps,
    stride_x, stride_r, stride_w, stride_cos, stride_sin, stride_qt, stride_qh, stride_ro,
    stride_ks, stride_kh, stride_vs, stride_vh, stride_loc,
    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    head = tl.program_id(1)
    pid_c = tl.program_id(2)
    row_ok = rows < T
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < HALF
    lo_cols = head * HEAD_DIM + offs_c  # weight rows of the head's first half
    rstd = _row_rstd(X, Res, stride_x, stride_r, rows, row_ok, K, eps,
                     HAS_RES, BLOCK_M, BLOCK_K)  # fmt: skip
    acc_lo = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = _normed_tile(X, Res, NormW, ResOut, stride_x, stride_r, stride_ro, rows, row_ok,
                         offs_k, K, rstd, (head == 0) & (pid_c == 0), HAS_RES)  # fmt: skip
        w_mask = (offs_k < K)[:, None] & c_ok[None, :]
        w_lo = tl.load(W + lo_cols[None, :] * stride_w + offs_k[:, None], mask=w_mask, other=0.0)
        w_hi = tl.load(W + (lo_cols + HALF)[None, :] * stride_w + offs_k[:, None], mask=w_mask,
                       other=0.0)  # fmt: skip
        acc_lo += _dot(a, w_lo, IEEE)  # IEEE: fp32 as cuBLAS computes it (no TF32)
        acc_hi += _dot(a, w_hi, IEEE)
    if HAS_BIAS:
        acc_lo += tl.load(Bias + lo_cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        acc_hi += tl.load(Bias + lo_cols + HALF, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    dtype = QKV.dtype.element_ty
    # The projection's output, rounded as the qkv GEMM's is.
    lo = acc_lo.to(dtype)
    hi = acc_hi.to(dtype)
    mask = row_ok[:, None] & c_ok[None, :]
    out = QKV + rows[:, None] * stride_qt + head * stride_qh + offs_c[None, :]
    # q and k heads: x*cos + rotate_half(x)*sin in fp32, rounded once (as rope_store_kv_):
    # rotate_half pairs c with c + D/2, and SignedSin carries the first half's minus sign.
    rotate = head < NUM_Q + NUM_KV
    cos_p = Cos + rows[:, None] * stride_cos + offs_c[None, :]
    sin_p = SignedSin + rows[:, None] * stride_sin + offs_c[None, :]
    cos_lo = tl.load(cos_p, mask=mask, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_p + HALF, mask=mask, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_p, mask=mask, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_p + HALF, mask=mask, other=0.0).to(tl.float32)
    lo_f, hi_f = lo.to(tl.float32), hi.to(tl.float32)
    lo = tl.where(rotate, (lo_f * cos_lo + hi_f * sin_lo).to(dtype), lo)
    hi = tl.where(rotate, (hi_f * cos_hi + lo_f * sin_hi).to(dtype), hi)
    tl.store(out, lo, mask=mask)
    tl.store(out + HALF, hi, mask=mask)
    # k and v heads: also to their KV-pool slots.
    is_k = (head >= NUM_Q) & rotate
    is_v = head >= NUM_Q + NUM_KV
    slot = tl.load(Loc + rows * stride_loc, mask=row_ok & (head >= NUM_Q), other=0)
    k_dst = KBuf + slot[:, None] * stride_ks + (head - NUM_Q) * stride_kh + offs_c[None, :]
    tl.store(k_dst, lo.to(KBuf.dtype.element_ty), mask=mask & is_k)
    tl.store(k_dst + HALF, hi.to(KBuf.dtype.element_ty), mask=mask & is_k)
    v_dst = VBuf + slot[:, None] * stride_vs + (head - NUM_Q - NUM_KV) * stride_vh + offs_c[None, :]
    tl.store(v_dst, lo.to(VBuf.dtype.element_ty), mask=mask & is_v)
    tl.store(v_dst + HALF, hi.to(VBuf.dtype.element_ty), mask=mask & is_v)


@triton.jit(do_not_specialize=["T"])
def _norm_gemm_kernel(
    X, Res, NormW, W, Out, ResOut,  # x, res [T, K]; W [N, K]; Out [T, N]
    T, N, K, eps,
    stride_x, stride_r, stride_w, stride_o, stride_ro,
    HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pid_n = tl.program_id(1)
    row_ok = rows < T
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if HAS_NORM:
        rstd = _row_rstd(X, Res, stride_x, stride_r, rows, row_ok, K, eps,
                         HAS_RES, BLOCK_M, BLOCK_K)  # fmt: skip
    else:
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if HAS_NORM:
            a = _normed_tile(X, Res, NormW, ResOut, stride_x, stride_r, stride_ro, rows, row_ok,
                             offs_k, K, rstd, pid_n == 0, HAS_RES)  # fmt: skip
        else:  # a plain GEMM (o_proj): the rows as they are
            a = tl.load(X + rows[:, None] * stride_x + offs_k[None, :],
                        mask=row_ok[:, None] & (offs_k < K)[None, :], other=0.0)  # fmt: skip
        w = tl.load(W + offs_n[None, :] * stride_w + offs_k[:, None],
                    mask=(offs_k < K)[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
        acc += _dot(a, w, IEEE)
    tl.store(Out + rows[:, None] * stride_o + offs_n[None, :], acc.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])  # fmt: skip


@triton.jit(do_not_specialize=["T"])
def _silu_mul_gemm_kernel(
    GateUp, W, Out,  # GateUp [T, 2K]; W [N, K]; Out [S, T, N]: split s's sums (S = 1: the output)
    T, N, K, K_PER,  # K_PER: the K range of a split, a multiple of BLOCK_K
    stride_g, stride_w, stride_os, stride_o,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
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


@triton.jit(do_not_specialize=["T"])
def _sum_splits_kernel(
    Part, Out,  # Part [S, T, N] fp32; Out [T, N]
    T, N, stride_ps, stride_pt, stride_o,
    SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < T)[:, None] & (offs_n < N)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLITS):  # in split order, whatever order the splits ran in
        part = Part + s * stride_ps + rows[:, None] * stride_pt + offs_n[None, :]
        acc += tl.load(part, mask=mask, other=0.0)
    tl.store(Out + rows[:, None] * stride_o + offs_n[None, :], acc.to(Out.dtype.element_ty),
             mask=mask)  # fmt: skip


def _check_rows(x: torch.Tensor, residual: torch.Tensor | None) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1


def _new_residual(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return x if residual is None else torch.empty_like(x)


def norm_qkv_rope_store_kv(
    x: torch.Tensor,  # [T, K]: the previous layer's output (or the embeddings)
    residual: torch.Tensor | None,  # [T, K] or None (the first layer: x is the stream)
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [(H + 2*Hkv) * D, K]: q, k, v rows stacked (merge_projections)
    bias: torch.Tensor | None,
    num_q_heads: int,
    cos: torch.Tensor,  # [T, 1, D] or [T, D]
    signed_sin: torch.Tensor,  # same shape: sin, negated on the first half
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,  # [T] int64, any stride
) -> tuple[torch.Tensor, torch.Tensor]:
    """(qkv [T, H + 2Hkv, D] with q and k rotated, new residual x + residual), one launch; k and
    v also written to their slots. Equals add_rms_norm, the qkv Linear and rope_store_kv_."""
    _check_rows(x, residual)
    t, k_dim = x.shape
    kv, d = k_buffer.shape[1], k_buffer.shape[2]
    heads = num_q_heads + 2 * kv
    assert weight.shape == (heads * d, k_dim) and weight.stride(1) == 1, weight.shape
    assert d % 2 == 0 and k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1
    assert out_cache_loc.dtype == torch.int64 and out_cache_loc.shape == (t,)
    cos2, sin2 = cos.reshape(t, d), signed_sin.reshape(t, d)
    assert cos2.stride(1) == 1 and sin2.stride(1) == 1
    qkv = torch.empty((t, heads, d), dtype=x.dtype, device=x.device)
    res_out = _new_residual(x, residual)
    if t == 0:
        return qkv, res_out
    res = residual if residual is not None else x
    cfg = config_for("norm_qkv_rope", heads * d, k_dim, weight.dtype, x.device)
    _norm_qkv_rope_kernel[(triton.cdiv(t, BLOCK_M), heads, triton.cdiv(d // 2, cfg.block_n))](
        x, res, norm_weight, weight, bias if bias is not None else weight, cos2, sin2,
        qkv, res_out, k_buffer, v_buffer, out_cache_loc,
        t, k_dim, eps,
        x.stride(0), res.stride(0), weight.stride(0), cos2.stride(0), sin2.stride(0),
        qkv.stride(0), qkv.stride(1), res_out.stride(0),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        out_cache_loc.stride(0),
        NUM_Q=num_q_heads, NUM_KV=kv, HEAD_DIM=d,
        HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        IEEE=_ieee_dot(x),
        BLOCK_M=BLOCK_M, BLOCK_K=cfg.block_k, BLOCK_C=cfg.block_n,
        **cfg.launch_options(),
    )  # fmt: skip
    return qkv, res_out


def norm_gemm(
    x: torch.Tensor,  # [T, K]
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,  # [N, K], no bias
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) @ weight.T [T, N], x + residual), one launch."""
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
    """x @ weight.T -> [T, N] (o_proj), one launch; rounded once to the dtype, as a Linear."""
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
    t, k_dim = x.shape
    n = weight.shape[0]
    cfg = config_for(kernel, n, k_dim, weight.dtype, x.device)
    _norm_gemm_kernel[(triton.cdiv(t, BLOCK_M), triton.cdiv(n, cfg.block_n))](
        x, res, norm_weight, weight, out, res_out,
        t, n, k_dim, eps,
        x.stride(0), res.stride(0), weight.stride(0), out.stride(0), res_out.stride(0),
        HAS_NORM=has_norm, HAS_RES=has_res, IEEE=_ieee_dot(x),
        BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **cfg.launch_options(),
    )  # fmt: skip


def silu_mul_gemm(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(SiLU(gate_up[:, :I]) * gate_up[:, I:]) @ weight.T -> [T, N], one launch."""
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    n = weight.shape[0]
    assert weight.shape == (n, inter) and weight.stride(1) == 1, weight.shape
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    cfg = config_for("silu_mul_gemm", n, inter, weight.dtype, gate_up.device)
    block_n, block_k = cfg.block_n, cfg.block_k
    steps = triton.cdiv(inter, block_k)
    splits = min(cfg.split_k, steps)  # every split gets at least one K step
    k_per = triton.cdiv(steps, splits) * block_k
    splits = triton.cdiv(inter, k_per)
    part = out if splits == 1 else out.new_empty((splits, t, n), dtype=torch.float32)
    grid = (triton.cdiv(t, BLOCK_M), triton.cdiv(n, block_n))
    _silu_mul_gemm_kernel[(*grid, splits)](
        gate_up, weight, part, t, n, inter, k_per,
        gate_up.stride(0), weight.stride(0), 0 if splits == 1 else part.stride(0), part.stride(-2),
        IEEE=_ieee_dot(gate_up),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, **cfg.launch_options(),
    )  # fmt: skip
    if splits > 1:
        _sum_splits_kernel[grid](
            part, out, t, n, part.stride(0), part.stride(1), out.stride(0),
            SPLITS=splits, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        )  # fmt: skip
    return out

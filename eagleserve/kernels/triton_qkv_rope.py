"""The qkv projection of a decode layer as one GEMV kernel (or two with a split K): residual
add + RMSNorm, the projection, neox rotary of q and k, and the K/V write to their KV-pool
slots (the layer's other kernels and the rounding and batch-invariance rules they share are in
kernels/triton_gemv.py).

A program owns BLOCK_C columns of each rotary half of one head (c and c + D/2) for BLOCK_M rows
and accumulates the two halves apart, so the rotation pairs them in registers; a head's halves
split into D/2 / BLOCK_C programs. A GQA model has few heads, so a large GPU may still have idle
SMs: with split_k > 1 the programs of each K range store fp32 partials, and a second launch sums
them in split order and runs the epilogue (bias, rounding, rotary, stores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagleserve.kernels import (
    pdl,
    triton_interpreter,  # noqa: F401  (before any launch)
)
from eagleserve.kernels.gemv_config import config_for
from eagleserve.kernels.triton_common import _dot, _ieee_dot, wait_previous
from eagleserve.kernels.triton_gemv import (
    BLOCK_M,
    _check_rows,
    _new_residual,
    _normed_row,
    _normed_tile,
    _row_rstd,
    one_tile,
    partials,
    row_chunks,
    split_k_range,
    summed_partials,
)


@triton.jit
def _rope_store(
    acc_lo, acc_hi,  # [BLOCK_M, BLOCK_C] fp32: the projection's sums of each rotary half
    Bias, Cos, SignedSin, Pos, QKV, KBuf, VBuf, Loc, rows, row_ok, head, offs_c, c_ok,
    stride_cos, stride_sin, stride_pos, stride_qt, stride_qh, stride_ks, stride_kh, stride_vs,
    stride_vh, stride_loc,
    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_POS: tl.constexpr,
):  # fmt: skip
    """Bias, the projection's rounding, rotary of q and k heads, the qkv store and the K/V
    writes of one program's columns."""
    HALF: tl.constexpr = HEAD_DIM // 2
    lo_cols = head * HEAD_DIM + offs_c
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
    # The tables' row of each row: its position (HAS_POS), else the row itself.
    if HAS_POS:
        at = tl.load(Pos + rows * stride_pos, mask=row_ok, other=0).to(tl.int64)
    else:
        at = rows
    cos_p = Cos + at[:, None] * stride_cos + offs_c[None, :]
    sin_p = SignedSin + at[:, None] * stride_sin + offs_c[None, :]
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


# T is never specialized (Triton compiles T == 1 apart otherwise): every batch size runs one
# compiled kernel, so a row's bits do not depend on the batch (the batch-invariant mode).
@triton.jit(do_not_specialize=["T"])
def _norm_qkv_rope_kernel(
    X, Res, NormW, W, Bias,  # x, res [T, K]; W [(H + 2Hkv) * D, K]
    Cos, SignedSin, Pos,  # cos [P, D] at row Pos[t] (HAS_POS) or t; Pos [T]
    QKV, ResOut, KBuf, VBuf, Loc,  # QKV [T, H + 2Hkv, D]; KBuf, VBuf [S, Hkv, D]; Loc [T]
    Part,  # [S, T, (H + 2Hkv) * D] fp32: split s's sums (PARTIAL only)
    T, K, K_PER, eps,  # K_PER: the K range of a split, a multiple of BLOCK_K
    stride_x, stride_r, stride_w, stride_cos, stride_sin, stride_pos, stride_qt, stride_qh,
    stride_ro, stride_ks, stride_kh, stride_vs, stride_vh, stride_loc, stride_ps, stride_pt,
    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr, IEEE: tl.constexpr,
    PARTIAL: tl.constexpr,
    ONE_TILE: tl.constexpr,  # K <= BLOCK_K, unsplit: the row and the weight tiles read at once
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    head = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    C_BLOCKS: tl.constexpr = (HALF + BLOCK_C - 1) // BLOCK_C
    pid_c = tl.program_id(2) % C_BLOCKS  # axis 2: the column blocks of each split in turn
    split = tl.program_id(2) // C_BLOCKS
    row_ok = rows < T
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < HALF
    lo_cols = head * HEAD_DIM + offs_c  # weight rows of the head's first half
    write_res = (head == 0) & (pid_c == 0)
    if ONE_TILE:  # no loop: the weight tiles' loads are not held behind the row's norm
        offs_k = tl.arange(0, BLOCK_K)
        w_mask = (offs_k < K)[:, None] & c_ok[None, :]
        w_lo = tl.load(W + lo_cols[None, :] * stride_w + offs_k[:, None], mask=w_mask, other=0.0)
        w_hi = tl.load(W + (lo_cols + HALF)[None, :] * stride_w + offs_k[:, None], mask=w_mask,
                       other=0.0)  # fmt: skip
        wait_previous(PDL)  # the weight tiles (no kernel writes them) were loaded before it
        a = _normed_row(X, Res, NormW, ResOut, stride_x, stride_r, stride_ro, rows, row_ok, K,
                        eps, write_res, HAS_RES, BLOCK_K)  # fmt: skip
        acc_lo = 0.0 + _dot(a, w_lo, IEEE)
        acc_hi = 0.0 + _dot(a, w_hi, IEEE)
    else:
        wait_previous(PDL)
        rstd = _row_rstd(X, Res, stride_x, stride_r, rows, row_ok, K, eps,
                         HAS_RES, BLOCK_M, BLOCK_K)  # fmt: skip
        acc_lo = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
        acc_hi = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
        k_start = split * K_PER
        for k0 in range(k_start, tl.minimum(k_start + K_PER, K), BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = _normed_tile(X, Res, NormW, ResOut, stride_x, stride_r, stride_ro, rows, row_ok,
                             offs_k, K, rstd, write_res, HAS_RES)  # fmt: skip
            w_mask = (offs_k < K)[:, None] & c_ok[None, :]
            w_lo = tl.load(W + lo_cols[None, :] * stride_w + offs_k[:, None], mask=w_mask,
                           other=0.0)  # fmt: skip
            w_hi = tl.load(W + (lo_cols + HALF)[None, :] * stride_w + offs_k[:, None],
                           mask=w_mask, other=0.0)  # fmt: skip
            acc_lo += _dot(a, w_lo, IEEE)  # IEEE: fp32 as cuBLAS computes it (no TF32)
            acc_hi += _dot(a, w_hi, IEEE)
    if PARTIAL:
        part = Part + split * stride_ps + rows[:, None] * stride_pt + lo_cols[None, :]
        mask = row_ok[:, None] & c_ok[None, :]
        tl.store(part, acc_lo, mask=mask)
        tl.store(part + HALF, acc_hi, mask=mask)
    else:
        _rope_store(acc_lo, acc_hi, Bias, Cos, SignedSin, Pos, QKV, KBuf, VBuf, Loc, rows,
                    row_ok, head, offs_c, c_ok, stride_cos, stride_sin, stride_pos, stride_qt,
                    stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_loc,
                    NUM_Q, NUM_KV, HEAD_DIM, HAS_BIAS, HAS_POS)  # fmt: skip


@triton.jit(do_not_specialize=["T"])
def _sum_rope_store_kernel(
    Part, Bias, Cos, SignedSin, Pos, QKV, KBuf, VBuf, Loc,
    T, stride_ps, stride_pt, stride_cos, stride_sin, stride_pos, stride_qt, stride_qh,
    stride_ks, stride_kh, stride_vs, stride_vh, stride_loc,
    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_POS: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """A split launch's epilogue: the partials summed in split order, then as unsplit."""
    wait_previous(PDL)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    head = tl.program_id(1)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < T
    c_ok = offs_c < HEAD_DIM // 2
    mask = row_ok[:, None] & c_ok[None, :]
    part = Part + rows[:, None] * stride_pt + (head * HEAD_DIM + offs_c)[None, :]
    acc_lo = summed_partials(part, stride_ps, mask, SPLITS)
    acc_hi = summed_partials(part + HEAD_DIM // 2, stride_ps, mask, SPLITS)
    _rope_store(acc_lo, acc_hi, Bias, Cos, SignedSin, Pos, QKV, KBuf, VBuf, Loc, rows, row_ok,
                head, offs_c, c_ok, stride_cos, stride_sin, stride_pos, stride_qt, stride_qh,
                stride_ks, stride_kh, stride_vs, stride_vh, stride_loc,
                NUM_Q, NUM_KV, HEAD_DIM, HAS_BIAS, HAS_POS)  # fmt: skip


def norm_qkv_rope_store_kv(
    x: torch.Tensor,  # [T, K]: the previous layer's output (or the embeddings)
    residual: torch.Tensor | None,  # [T, K] or None (the first layer: x is the stream)
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [(H + 2*Hkv) * D, K]: q, k, v rows stacked (merge_projections)
    bias: torch.Tensor | None,
    num_q_heads: int,
    cos: torch.Tensor,  # [P, 1, D] or [P, D]: by position, or [T, ...] by row
    signed_sin: torch.Tensor,  # same shape: sin, negated on the first half
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,  # [T] int64, any stride
    positions: torch.Tensor | None = None,  # [T]: each row's row of cos / signed_sin
) -> tuple[torch.Tensor, torch.Tensor]:
    """(qkv [T, H + 2Hkv, D] with q and k rotated, new residual x + residual); k and v also
    written to their slots. Equals add_rms_norm, the qkv Linear and rope_store_kv_. With
    `positions`, cos and signed_sin are tables the kernel reads at them (no gather before)."""
    _check_rows(x, residual)
    t, k_dim = x.shape
    kv, d = k_buffer.shape[1], k_buffer.shape[2]
    heads = num_q_heads + 2 * kv
    assert weight.shape == (heads * d, k_dim) and weight.stride(1) == 1, weight.shape
    assert d % 2 == 0 and k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1
    assert out_cache_loc.dtype == torch.int64 and out_cache_loc.shape == (t,)
    cos2, sin2 = cos.reshape(-1, d), signed_sin.reshape(-1, d)
    assert cos2.stride(1) == 1 and sin2.stride(1) == 1
    assert positions is not None or cos2.shape[0] == t, "per-row cos / sin need a row each"
    pos = out_cache_loc if positions is None else positions  # any pointer without HAS_POS
    qkv = torch.empty((t, heads, d), dtype=x.dtype, device=x.device)
    res_out = _new_residual(x, residual)
    if t == 0:
        return qkv, res_out
    res = residual if residual is not None else x
    bias_arg = bias if bias is not None else weight  # never read without HAS_BIAS
    cfg = config_for("norm_qkv_rope", heads * d, k_dim, weight.dtype, x.device)
    splits, k_per = split_k_range(k_dim, cfg)
    col_blocks = triton.cdiv(d // 2, cfg.block_n)
    kv_strides = (k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1))
    heads_const = {"NUM_Q": num_q_heads, "NUM_KV": kv, "HEAD_DIM": d,
                   "HAS_BIAS": bias is not None, "HAS_POS": positions is not None}  # fmt: skip
    for r in row_chunks(t, splits, heads * d):
        rows, loc, at = x[r].shape[0], out_cache_loc[r], pos[r]
        # Per-row tables start at the chunk's first row; position tables are whole.
        cos_r, sin_r = (cos2, sin2) if positions is not None else (cos2[r], sin2[r])
        part, stride_ps, stride_pt = partials(qkv[r].view(rows, heads * d), splits)
        grid = (triton.cdiv(rows, BLOCK_M), heads, col_blocks)
        _norm_qkv_rope_kernel[(*grid[:2], col_blocks * splits)](
            x[r], res[r], norm_weight, weight, bias_arg, cos_r, sin_r, at,
            qkv[r], res_out[r], k_buffer, v_buffer, loc, part,
            rows, k_dim, k_per, eps,
            x.stride(0), res.stride(0), weight.stride(0), cos2.stride(0), sin2.stride(0),
            at.stride(0), qkv.stride(0), qkv.stride(1), res_out.stride(0), *kv_strides,
            loc.stride(0),
            stride_ps, stride_pt,
            HAS_RES=residual is not None, IEEE=_ieee_dot(x), PARTIAL=splits > 1,
            ONE_TILE=one_tile(k_dim, cfg, splits),
            BLOCK_M=BLOCK_M, BLOCK_K=cfg.block_k, BLOCK_C=cfg.block_n,
            **heads_const, **cfg.launch_options(),
            **pdl.launch_options(x.device),
        )  # fmt: skip
        if splits > 1:
            _sum_rope_store_kernel[grid](
                part, bias_arg, cos_r, sin_r, at, qkv[r], k_buffer, v_buffer, loc,
                rows, stride_ps, stride_pt, cos2.stride(0), sin2.stride(0), at.stride(0),
                qkv.stride(0), qkv.stride(1), *kv_strides, loc.stride(0),
                SPLITS=splits, BLOCK_M=BLOCK_M, BLOCK_C=cfg.block_n, **heads_const,
                **pdl.launch_options(x.device),
            )  # fmt: skip
    return qkv, res_out

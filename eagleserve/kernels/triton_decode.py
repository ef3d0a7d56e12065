"""Triton split-KV decode attention (flash-decoding, two stages); see triton_attention.py."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from eagleserve.kernels import pdl
from eagleserve.kernels.triton_common import (
    _LOG2E,
    _MAX_KV_SPLITS,
    _TARGET_DECODE_PROGRAMS,
    _block_d,
    _check_index,
    _check_qkv,
    _ieee_dot,
    _split_kv_stage1,
    wait_previous,
)

# The split count and the scratch strides that follow from it are run-time values, not
# specialisations: every count (1.._MAX_KV_SPLITS, chosen per forward from the batch and the
# longest context) then runs one compiled kernel, where a constant would compile a variant the
# first time a context or batch reaches a new count, mid-request on an accelerator.
_SPLIT_ARGS = ["num_splits", "stride_mo_b", "stride_mo_h", "stride_ml_b", "stride_ml_h"]


@triton.jit(do_not_specialize=_SPLIT_ARGS)
def _decode_stage1_kernel(
    Q,  # [bs, H, D]
    K,  # [S, Hkv, D]
    V,  # [S, Hkv, D]
    ReqToToken,  # [R, L] int64
    ReqPoolIdx,  # [bs] int64
    SeqLens,  # [bs] int64
    MidO,  # [bs, H, num_splits, D] fp32, normalised partial outputs
    MidLse,  # [bs, H, num_splits] fp32, log2-sum-exp of each split (-inf when empty)
    qk_scale,  # sm_scale * log2(e)
    num_splits,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_r2t_r,
    stride_r2t_l,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= GROUP and >= 16 (tl.dot minimum); extra rows are masked
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(SeqLens + b)
    req = tl.load(ReqPoolIdx + b)
    # Contiguous chunk of positions for this split; trailing splits of short requests are empty.
    split_len = tl.cdiv(seq_len, num_splits)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    _split_kv_stage1(
        Q, K, V, MidO, MidLse, b, ReqToToken + req * stride_r2t_r, kv_head, split, start, end,
        qk_scale, stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_r2t_l,
        stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h,
        GROUP, HEAD_DIM, BLOCK_H, BLOCK_N, BLOCK_D, IEEE,
    )  # fmt: skip


@triton.jit(do_not_specialize=_SPLIT_ARGS)
def _decode_stage2_kernel(
    MidO,  # [bs, H, num_splits, D] fp32
    MidLse,  # [bs, H, num_splits] fp32
    Out,  # [bs, H, D]
    num_splits,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= every split count
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_valid = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM

    lse = tl.load(
        MidLse + b * stride_ml_b + h * stride_ml_h + offs_s, mask=s_valid, other=float("-inf")
    )  # [BLOCK_S]
    m = tl.max(lse, 0)
    # seq_len >= 1 makes at least one split non-empty; the guard only avoids NaN on bad input.
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # 0 for empty splits
    o = tl.load(
        MidO + b * stride_mo_b + h * stride_mo_h + offs_s[:, None] * stride_mo_s + offs_d[None, :],
        mask=s_valid[:, None] & d_valid[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    w_sum = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(w_sum == 0.0, 1.0, w_sum)
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_valid
    )


def decode_attention(
    q: torch.Tensor,  # [bs, H, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    req_to_token: torch.Tensor,  # [R, L] int64
    req_pool_indices: torch.Tensor,  # [bs] int64
    seq_lens: torch.Tensor,  # [bs] int64, >= 1, including the token being decoded
    sm_scale: float,
    num_kv_splits: int,
    mid_o: torch.Tensor | None = None,  # [bs, H, num_kv_splits, D] fp32 scratch (reusable)
    mid_lse: torch.Tensor | None = None,  # [bs, H, num_kv_splits] fp32 scratch
) -> torch.Tensor:
    """Decode with an explicit split count (the backend picks it once per forward from its
    host-side max length: `choose_num_kv_splits`)."""
    group = _check_qkv(q, k_buffer, v_buffer)
    bs, num_heads, head_dim = q.shape
    kv_heads = k_buffer.shape[1]
    _check_index("req_to_token", req_to_token, 2, q.device)
    _check_index("req_pool_indices", req_pool_indices, 1, q.device)
    _check_index("seq_lens", seq_lens, 1, q.device)
    assert req_pool_indices.shape[0] == bs and seq_lens.shape[0] == bs
    assert 1 <= num_kv_splits <= _MAX_KV_SPLITS, num_kv_splits
    if mid_o is None:
        mid_o = torch.empty(
            (bs, num_heads, num_kv_splits, head_dim), dtype=torch.float32, device=q.device
        )
    if mid_lse is None:
        mid_lse = torch.empty((bs, num_heads, num_kv_splits), dtype=torch.float32, device=q.device)
    assert mid_o.shape == (bs, num_heads, num_kv_splits, head_dim) and mid_o.stride(3) == 1
    assert mid_lse.shape == (bs, num_heads, num_kv_splits) and mid_lse.stride(2) == 1
    assert mid_o.dtype == torch.float32 and mid_lse.dtype == torch.float32
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if bs == 0:
        return out

    block_d = _block_d(head_dim)
    block_h = max(16, triton.next_power_of_2(group))
    block_n = 64 if block_d <= 64 else 32
    ieee = _ieee_dot(q)
    _decode_stage1_kernel[(bs, kv_heads, num_kv_splits)](
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        mid_o,
        mid_lse,
        sm_scale * _LOG2E,
        num_kv_splits,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        req_to_token.stride(1),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        IEEE=ieee,
        num_warps=4,
        num_stages=2,
        **pdl.launch_options(q.device),
    )
    _decode_stage2_kernel[(bs, num_heads)](
        mid_o,
        mid_lse,
        out,
        num_kv_splits,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_S=_MAX_KV_SPLITS,
        BLOCK_D=block_d,
        num_warps=4 if block_d >= 128 else 2,
        **pdl.launch_options(out.device),
    )
    return out


def choose_num_kv_splits(batch_size: int, kv_heads: int, max_seq_len: int) -> int:
    """Splits per request for decode: enough programs to fill the GPU, each split still at
    least ~256 positions long so the merge stays cheap. A power of two, so a growing context
    meets at most log2(_MAX_KV_SPLITS) + 1 counts (each a different grid and scratch size;
    the kernels take the count at run time and compile once). Host ints only (no device
    sync)."""
    if max_seq_len <= 256:
        return 1
    by_len = math.ceil(max_seq_len / 256)
    by_occupancy = math.ceil(_TARGET_DECODE_PROGRAMS / max(1, batch_size * kv_heads))
    n = max(1, min(_MAX_KV_SPLITS, by_len, by_occupancy))
    return 1 << (n.bit_length() - 1)

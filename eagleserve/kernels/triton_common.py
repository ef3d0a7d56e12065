"""Shared pieces of the Triton attention kernels: jit helpers, constants, input checks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from eagleserve.kernels import triton_interpreter  # noqa: F401  (before any launch)

_LOG2E = 1.4426950408889634
# Splits per request in decode are capped so stage 2 stays a single small block.
_MAX_KV_SPLITS = 32
# Enough stage-1 programs to fill a large GPU (H100: 132 SMs, a few programs each).
_TARGET_DECODE_PROGRAMS = 512
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# jit helpers
# ---------------------------------------------------------------------------------------------
@triton.jit
def wait_previous(PDL: tl.constexpr):
    """A kernel's first statement (kernels/pdl.py): launched with PDL, it lets the next kernel
    launch, then waits for the previous one's writes."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # IEEE is set for fp32 inputs, so results match the fp32 reference (the NVIDIA default is
    # tf32), and for CPU tensors (the interpreter): its tl.dot multiplies the raw bit patterns of
    # bfloat16 operands (triton-lang/triton#11584), so there both operands go through fp32.
    # 16-bit inputs on a GPU use the default precision; accumulation is fp32 either way.
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _online_softmax_step(s, m_i, l_i, acc, v, IEEE: tl.constexpr):
    """One flash-attention update. s [M, N] fp32 log2-scaled scores (-inf = masked);
    m_i, l_i [M] running max / sum; acc [M, D] fp32; v [N, D] in the dot dtype."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row whose scores are all masked so far keeps m = -inf; shift by 0 so exp2 gives 0 not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc


@triton.jit
def _load_kv_tile(
    K, V, tb_row, stride_tb_l, pos, n_valid, kv_head, stride_ks, stride_kh, stride_vs, stride_vh,
    offs_d, d_valid, q,
):  # fmt: skip
    """K and V [BLOCK_N, BLOCK_D] of KV head kv_head at the slots that the table row tb_row lists
    at positions pos, in q's dtype; positions where n_valid is false read slot 0 and give 0."""
    slot = tl.load(tb_row + pos * stride_tb_l, mask=n_valid, other=0)  # int64
    kv_mask = n_valid[:, None] & d_valid[None, :]
    k = tl.load(
        K + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    ).to(q.dtype)
    v = tl.load(
        V + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    ).to(q.dtype)
    return k, v


@triton.jit
def _split_kv_stage1(
    Q, K, V, MidO, MidLse, row, tb_row, kv_head, split, start, end, qk_scale,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb_l,
    stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Stage 1 of split-KV attention for one (query row, KV head, split): the GQA group's query
    heads of Q row `row` over the KV positions [start, end) of table row tb_row, in BLOCK_N tiles
    counted from start, normalised, into MidO [T, H, NUM_SPLITS, D] with their log2-sum-exp in
    MidLse [T, H, NUM_SPLITS]. An empty split stores o = 0 and lse = -inf (stage 2 weights it
    by 0). The operations depend only on (row, start, end): the caller's split rule alone
    decides whether a row's bits depend on the batch."""
    offs_h = kv_head * GROUP + tl.arange(0, BLOCK_H)  # query heads of this group
    h_valid = tl.arange(0, BLOCK_H) < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    row = row.to(tl.int64)
    q_ptrs = Q + row * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=h_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_valid = pos < end
        k, v = _load_kv_tile(
            K, V, tb_row, stride_tb_l, pos, n_valid, kv_head, stride_ks, stride_kh, stride_vs,
            stride_vh, offs_d, d_valid, q,
        )  # fmt: skip
        s = _dot(q, tl.trans(k), IEEE) * qk_scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(n_valid[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, IEEE)

    # Empty split: l = 0, m = -inf -> lse = -inf and o = 0 (a non-empty one divides by l itself).
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    mo_ptrs = (
        MidO + row * stride_mo_t + offs_h[:, None] * stride_mo_h + split * stride_mo_s
        + offs_d[None, :]
    )  # fmt: skip
    tl.store(mo_ptrs, out, mask=h_valid[:, None] & d_valid[None, :])
    tl.store(MidLse + row * stride_ml_t + offs_h * stride_ml_h + split, lse, mask=h_valid)


# ---------------------------------------------------------------------------------------------
# Python wrappers
# ---------------------------------------------------------------------------------------------
def _check_qkv(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> int:
    """Validates q [T, H, D], k/v [S, Hkv, D]; returns the GQA group size H // Hkv."""
    assert q.dim() == 3 and k_buffer.dim() == 3, (q.shape, k_buffer.shape)
    assert k_buffer.shape == v_buffer.shape, (k_buffer.shape, v_buffer.shape)
    assert q.shape[2] == k_buffer.shape[2], f"head_dim {q.shape[2]} vs {k_buffer.shape[2]}"
    assert q.dtype in _FLOAT_DTYPES and k_buffer.dtype in _FLOAT_DTYPES, (q.dtype, k_buffer.dtype)
    assert v_buffer.dtype == k_buffer.dtype, (k_buffer.dtype, v_buffer.dtype)
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        assert t.stride(2) == 1, f"{name} needs a contiguous last dim, strides {t.stride()}"
        assert t.device == q.device, f"{name} on {t.device}, q on {q.device}"
    num_heads, kv_heads = q.shape[1], k_buffer.shape[1]
    assert num_heads % kv_heads == 0, f"{num_heads} heads not a multiple of {kv_heads} KV heads"
    return num_heads // kv_heads


def _check_index(name: str, t: torch.Tensor, dim: int, device: torch.device) -> None:
    assert t.dtype == torch.int64, f"{name} must be int64, got {t.dtype}"
    assert t.dim() == dim, f"{name} must be {dim}-d, got {tuple(t.shape)}"
    assert t.device == device, f"{name} on {t.device}, q on {device}"


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _ieee_dot(q: torch.Tensor) -> bool:
    """fp32 inputs, or any CPU tensors (interpreter; see `_dot`)."""
    return q.dtype == torch.float32 or q.device.type == "cpu"

"""Shared pieces of the Triton attention kernels: jit helpers, constants, input checks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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

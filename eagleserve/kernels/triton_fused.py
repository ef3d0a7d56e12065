"""Fused per-layer Triton kernels of the GPU decoder layer (also run under TRITON_INTERPRET=1).

Each replaces several eager ops by one launch and rounds where the unfused torch path of
models/llama.py rounds, so a 16-bit result matches it to one rounding step:
- `add_rms_norm`: residual add + RMSNorm -> (normed, new residual); without a residual, RMSNorm.
- `embed_norm_pair`: an embedding lookup and two RMSNorms into the halves of one row.
- `silu_mul`: SiLU(gate) * up over a fused gate_up output [T, 2I].
- `rope_store_kv_`: neox rotary (x*cos + rotate_half(x)*sin) of q and k inside a fused qkv
  output [T, H + 2Hkv, D], in place, and the K/V rows written to their KV-pool slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagleserve.kernels import (
    pdl,
    triton_interpreter,  # noqa: F401  (before any launch)
)
from eagleserve.kernels.triton_common import wait_previous


@triton.jit
def _add_rms_norm_kernel(
    X,  # [T, N]
    Res,  # [T, N] (unused without HAS_RES)
    W,  # [N]
    Out,  # [T, N]
    ResOut,  # [T, N] (unused without HAS_RES)
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    N,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        # The sum is rounded to the model dtype once, as `h + out` is in torch.
        x = (
            x.to(tl.float32)
            + tl.load(Res + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        ).to(x.dtype)
        tl.store(ResOut + row * stride_ro + offs, x, mask=mask)
    _store_rms_normed(x, W, Out + row * stride_o, offs, mask, N, eps)


@triton.jit
def _store_rms_normed(x, W, out_row, offs, mask, N, eps):
    """RMSNorm(x) * W of one row x [BLOCK] (model dtype) stored at out_row."""
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    # As transformers: normalise in fp32, round to the input dtype, then scale by the weight.
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_row + offs, (normed * w).to(out_row.dtype.element_ty), mask=mask)


@triton.jit
def _embed_norm_pair_kernel(
    Ids,  # [T] token ids
    Emb,  # [V, N] embedding table
    G,  # [T, N]
    W1,  # [N]: the embeddings' norm
    W2,  # [N]: g's norm
    Out,  # [T, 2N]: [RMSNorm(Emb[id]) * W1, RMSNorm(g) * W2]
    stride_e,
    stride_g,
    stride_o,
    N,
    eps1,
    eps2,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    token = tl.load(Ids + row).to(tl.int64)
    emb = tl.load(Emb + token * stride_e + offs, mask=mask, other=0.0)
    _store_rms_normed(emb, W1, Out + row * stride_o, offs, mask, N, eps1)
    g = tl.load(G + row * stride_g + offs, mask=mask, other=0.0)
    _store_rms_normed(g, W2, Out + row * stride_o + N, offs, mask, N, eps2)


@triton.jit
def _silu_mul_kernel(
    GateUp,  # [T, 2I]
    Out,  # [T, I]
    stride_g,
    stride_o,
    INTER,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(GateUp + row * stride_g + offs, mask=mask, other=0.0)
    up = tl.load(GateUp + row * stride_g + INTER + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # torch rounds silu(gate) to the model dtype before the product; so does this.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


@triton.jit
def _rope_store_kv_kernel(
    QKV,  # [T, H + 2*Hkv, D], rotated in place
    Cos,  # [P, D] (row stride given): row Pos[t] (HAS_POS) or t
    SignedSin,  # [P, D]
    Pos,  # [T] each row's table row (HAS_POS only)
    KBuf,  # [S, Hkv, D]
    VBuf,  # [S, Hkv, D]
    Loc,  # [T] int64 KV slots
    stride_t,
    stride_h,
    stride_cos,
    stride_sin,
    stride_pos,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_loc,
    NUM_Q: tl.constexpr,
    NUM_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_POS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    if HAS_POS:
        at = tl.load(Pos + t * stride_pos).to(tl.int64)
    else:
        at = t
    heads = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    # roll(x, D/2)[d] = x[(d + D/2) % D]: the rotate_half partner, its sign in SignedSin.
    partner = (offs_d + HEAD_DIM // 2) % HEAD_DIM
    rot = heads < NUM_Q + NUM_KV
    rot_mask = rot[:, None] & d_valid[None, :]
    row = QKV + t * stride_t + heads[:, None] * stride_h
    x = tl.load(row + offs_d[None, :], mask=rot_mask, other=0.0)
    xr = tl.load(row + partner[None, :], mask=rot_mask, other=0.0)
    cos = tl.load(Cos + at * stride_cos + offs_d, mask=d_valid, other=0.0)
    sin = tl.load(SignedSin + at * stride_sin + offs_d, mask=d_valid, other=0.0)
    # torch rounds each product and the sum to the model dtype; one fp32 FMA chain rounded once
    # differs from it by at most one rounding step.
    y = (
        x.to(tl.float32) * cos.to(tl.float32)[None, :]
        + xr.to(tl.float32) * sin.to(tl.float32)[None, :]
    )
    y = y.to(x.dtype)
    tl.store(row + offs_d[None, :], y, mask=rot_mask)

    slot = tl.load(Loc + t * stride_loc)
    is_k = (heads >= NUM_Q) & rot
    k_ptrs = KBuf + slot * stride_ks + (heads - NUM_Q)[:, None] * stride_kh + offs_d[None, :]
    tl.store(k_ptrs, y.to(KBuf.dtype.element_ty), mask=is_k[:, None] & d_valid[None, :])
    v_head = heads - NUM_Q - NUM_KV
    is_v = (v_head >= 0) & (v_head < NUM_KV)
    v_mask = is_v[:, None] & d_valid[None, :]
    v = tl.load(row + offs_d[None, :], mask=v_mask, other=0.0)
    v_ptrs = VBuf + slot * stride_vs + v_head[:, None] * stride_vh + offs_d[None, :]
    tl.store(v_ptrs, v.to(VBuf.dtype.element_ty), mask=v_mask)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual), one launch; without a residual the second
    is `x` itself. x, residual [T, N] with a contiguous last dim; `out`: where the first goes
    (a [T, N] view with a contiguous last dim, e.g. half of a wider row), else a new tensor."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    t, n = x.shape
    if out is None:
        out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    assert out.shape == (t, n) and out.stride(1) == 1, (out.shape, out.stride())
    res_out = x
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
        res_out = torch.empty_like(out)
    if t == 0:
        return out, res_out
    block = triton.next_power_of_2(n)
    res = residual if residual is not None else x
    _add_rms_norm_kernel[(t,)](
        x, res, weight, out, res_out,
        x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
        n, eps,
        HAS_RES=residual is not None, BLOCK=block, num_warps=_warps(block),
        **pdl.launch_options(x.device),
    )  # fmt: skip
    return out, res_out


def embed_norm_pair(
    ids: torch.Tensor,
    embedding: torch.Tensor,
    g: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor],
    eps: tuple[float, float],
) -> torch.Tensor:
    """[T, 2N]: RMSNorm(embedding[ids]) * weights[0] beside RMSNorm(g) * weights[1], one launch
    (an EAGLE3 head's attention input; the bits of an embedding lookup and two `add_rms_norm`
    launches into the halves of one row). ids [T], embedding [V, N], g [T, N] of its dtype."""
    t, n = g.shape
    assert embedding.shape[1] == n and embedding.stride(1) == 1 and g.stride(1) == 1
    assert g.dtype == embedding.dtype and ids.shape == (t,)
    out = torch.empty((t, 2 * n), dtype=g.dtype, device=g.device)
    if t == 0:
        return out
    block = triton.next_power_of_2(n)
    _embed_norm_pair_kernel[(t,)](
        ids, embedding, g, weights[0], weights[1], out,
        embedding.stride(0), g.stride(0), out.stride(0), n, eps[0], eps[1],
        BLOCK=block, num_warps=_warps(block),  # add_rms_norm's: its reduction order
        **pdl.launch_options(g.device),
    )  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate_up[:, :I]) * gate_up[:, I:] -> [T, I], one launch."""
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        inter,
        BLOCK=block,
        num_warps=4,
        **pdl.launch_options(gate_up.device),
    )
    return out


def rope_store_kv_(
    qkv: torch.Tensor,  # [T, H + 2*Hkv, D]
    num_q_heads: int,
    cos: torch.Tensor,  # [T, 1, D] or [T, D]: each row's cos; with positions, [P, ...] tables
    signed_sin: torch.Tensor,  # same shape: sin, negated on the first half (see llama.py)
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,  # [T] int64, any stride (a column of a slot table)
    positions: torch.Tensor | None = None,  # [T]: each row's row of cos / signed_sin
) -> None:
    """Rotates q and k of `qkv` in place and writes k, v to their slots, one launch. With
    `positions`, cos and signed_sin are tables the kernel reads at them (no gather before)."""
    t, heads, d = qkv.shape
    kv = k_buffer.shape[1]
    assert heads == num_q_heads + 2 * kv, (qkv.shape, num_q_heads, k_buffer.shape)
    assert qkv.stride(2) == 1 and k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1
    assert k_buffer.shape[2] == d and d % 2 == 0, (k_buffer.shape, d)
    assert out_cache_loc.dtype == torch.int64 and out_cache_loc.shape == (t,)
    cos2, sin2 = cos.reshape(-1, d), signed_sin.reshape(-1, d)
    assert cos2.stride(1) == 1 and sin2.stride(1) == 1
    assert positions is not None or cos2.shape[0] == t, "per-row cos / sin need a row each"
    if t == 0:
        return
    pos = out_cache_loc if positions is None else positions  # any pointer without HAS_POS
    block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(d)
    _rope_store_kv_kernel[(t,)](
        qkv, cos2, sin2, pos, k_buffer, v_buffer, out_cache_loc,
        qkv.stride(0), qkv.stride(1), cos2.stride(0), sin2.stride(0), pos.stride(0),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        out_cache_loc.stride(0),
        NUM_Q=num_q_heads, NUM_KV=kv, HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d,
        HAS_POS=positions is not None, num_warps=_warps(block_h * block_d),
        **pdl.launch_options(qkv.device),
    )  # fmt: skip


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))

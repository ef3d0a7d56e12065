"""Triton paged attention over the layout described in `torch_attention.py`.

Three entry points with the same signatures as their torch references:
- `decode_attention`: one query per request; split-KV (flash-decoding) in two stages. Stage 1
  gives each (request, KV head, split) program all query heads of that KV head's GQA group, so
  every K/V row is read once per group; stage 2 merges the splits with their log-sum-exps.
- `extend_attention`: new tokens over a cached prefix, causal.
- `tree_verify_attention`: draft-tree tokens over a cached prefix, visibility from `tree_mask`.
  Extend and tree share one jit kernel (`_prefill_kernel`), specialised by the constexpr `TREE`;
  it packs the GQA group into the query-row dimension so K/V tiles are read once per group.

All softmax math is fp32 in the log2 domain (scores are pre-multiplied by sm_scale * log2(e)).
Nothing here calls `torch.cuda`: tensors are allocated on `q.device`, so the same code runs under
`TRITON_INTERPRET=1` on CPU tensors and on CUDA/HIP devices.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

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
# decode
# ---------------------------------------------------------------------------------------------
@triton.jit
def _decode_stage1_kernel(
    Q,  # [bs, H, D]
    K,  # [S, Hkv, D]
    V,  # [S, Hkv, D]
    ReqToToken,  # [R, L] int64
    ReqPoolIdx,  # [bs] int64
    SeqLens,  # [bs] int64
    MidO,  # [bs, H, NUM_SPLITS, D] fp32, normalised partial outputs
    MidLse,  # [bs, H, NUM_SPLITS] fp32, log2-sum-exp of each split (-inf when empty)
    qk_scale,  # sm_scale * log2(e)
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
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= GROUP and >= 16 (tl.dot minimum); extra rows are masked
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_h = kv_head * GROUP + tl.arange(0, BLOCK_H)  # query heads of this group
    h_valid = tl.arange(0, BLOCK_H) < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)

    seq_len = tl.load(SeqLens + b)
    req = tl.load(ReqPoolIdx + b)
    # Contiguous chunk of positions for this split; trailing splits of short requests are empty.
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    q_ptrs = Q + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=h_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    r2t_row = ReqToToken + req * stride_r2t_r
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_valid = pos < end
        slot = tl.load(r2t_row + pos * stride_r2t_l, mask=n_valid, other=0)  # int64
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(
            K + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        v = tl.load(
            V + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(q.dtype)
        s = _dot(q, tl.trans(k), IEEE) * qk_scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(n_valid[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, IEEE)

    # Empty split: l = 0, m = -inf -> lse = -inf and o = 0, which stage 2 weights by 0.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    mo_ptrs = (
        MidO
        + b.to(tl.int64) * stride_mo_b
        + offs_h[:, None] * stride_mo_h
        + split * stride_mo_s
        + offs_d[None, :]
    )
    tl.store(mo_ptrs, out, mask=h_valid[:, None] & d_valid[None, :])
    tl.store(
        MidLse + b.to(tl.int64) * stride_ml_b + offs_h * stride_ml_h + split, lse, mask=h_valid
    )


@triton.jit
def _decode_stage2_kernel(
    MidO,  # [bs, H, NUM_SPLITS, D] fp32
    MidLse,  # [bs, H, NUM_SPLITS] fp32
    Out,  # [bs, H, D]
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_valid = offs_s < NUM_SPLITS
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


# ---------------------------------------------------------------------------------------------
# extend / tree verify
# ---------------------------------------------------------------------------------------------
@triton.jit
def _prefill_kernel(
    Q,  # [T, H, D], request b's rows start at QStart[b]
    K,  # [S, Hkv, D]
    V,  # [S, Hkv, D]
    Out,  # [T, H, D]
    ReqToToken,  # [R, L] int64
    ReqPoolIdx,  # [bs] int64
    QStart,  # [bs] int64, first query row of each request
    ExtendLens,  # [bs] int64, query rows per request
    PrefixLens,  # [bs] int64, tree mode only: positions every query sees
    KvLens,  # [bs] int64, KV range [0, kv_len); queries are its last ExtendLens positions
    TreeMask,  # [bs, n_q, n_new] int8 (tree mode only)
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_r2t_r,
    stride_r2t_l,
    stride_tm_b,
    stride_tm_q,
    stride_tm_k,
    n_new,  # tree region width (tree_mask.shape[2]); unused when not TREE
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TREE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    # One program per (request, KV head, block of BLOCK_M rows). Rows pack (query, head of the
    # GQA group) query-major: row r is query r // GROUP, head kv_head * GROUP + r % GROUP. All
    # rows share the KV head, so each K/V tile is loaded once for the whole group; for short
    # query runs (tree verify, n ~ 4..64) this also fills the tile's rows.
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    m_block = tl.program_id(2)
    ext_len = tl.load(ExtendLens + b)
    m0 = m_block * BLOCK_M
    # Grid is sized for the longest request; shorter ones have nothing to do here.
    if m0 < ext_len * GROUP:
        q_start = tl.load(QStart + b)
        kv_len = tl.load(KvLens + b)
        req = tl.load(ReqPoolIdx + b)
        q_pos0 = kv_len - ext_len  # absolute position of query 0

        offs_r = m0 + tl.arange(0, BLOCK_M)
        qi = offs_r // GROUP  # query index within the request
        head = kv_head * GROUP + offs_r % GROUP
        m_valid = qi < ext_len
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < HEAD_DIM
        offs_n = tl.arange(0, BLOCK_N)

        q_rows = (q_start + qi).to(tl.int64)
        q = tl.load(
            Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=m_valid[:, None] & d_valid[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_D]

        if TREE:
            prefix = tl.load(PrefixLens + b)
            kv_end = kv_len
            tm_row = TreeMask + b.to(tl.int64) * stride_tm_b + qi[:, None] * stride_tm_q
        else:
            # Causal: nothing past the last query of this block is visible.
            kv_end = tl.minimum(kv_len, q_pos0 + (m0 + BLOCK_M - 1) // GROUP + 1)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        r2t_row = ReqToToken + req * stride_r2t_r
        for n0 in range(0, kv_end, BLOCK_N):
            pos = n0 + offs_n
            n_valid = pos < kv_end
            slot = tl.load(r2t_row + pos * stride_r2t_l, mask=n_valid, other=0)
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
            s = _dot(q, tl.trans(k), IEEE) * qk_scale  # [BLOCK_M, BLOCK_N]
            if TREE:
                j = pos - prefix  # index into the tree region; < 0 means prefix
                in_region = (j >= 0) & (j < n_new)
                tm = tl.load(
                    tm_row + j[None, :] * stride_tm_k,
                    mask=m_valid[:, None] & in_region[None, :] & n_valid[None, :],
                    other=0,
                )
                visible = n_valid[None, :] & ((j[None, :] < 0) | (tm != 0))
            else:
                visible = n_valid[None, :] & (pos[None, :] <= (q_pos0 + qi)[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, IEEE)

        # l_i == 0 only on rows with nothing visible (padding rows, which are not stored).
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            Out + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=m_valid[:, None] & d_valid[None, :],
        )


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


def _decode_attention(
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
    """Decode with an explicit split count (the backend picks it once per forward)."""
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
        NUM_SPLITS=num_kv_splits,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        IEEE=ieee,
        num_warps=4,
        num_stages=2,
    )
    _decode_stage2_kernel[(bs, num_heads)](
        mid_o,
        mid_lse,
        out,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_kv_splits,
        BLOCK_S=triton.next_power_of_2(num_kv_splits),
        BLOCK_D=block_d,
        num_warps=4 if block_d >= 128 else 2,
    )
    return out


def choose_num_kv_splits(batch_size: int, kv_heads: int, max_seq_len: int) -> int:
    """Splits per request for decode: enough programs to fill the GPU, each split still at
    least ~256 positions long so the merge stays cheap. Host ints only (no device sync)."""
    if max_seq_len <= 256:
        return 1
    by_len = math.ceil(max_seq_len / 256)
    by_occupancy = math.ceil(_TARGET_DECODE_PROGRAMS / max(1, batch_size * kv_heads))
    return max(1, min(_MAX_KV_SPLITS, by_len, by_occupancy))


def decode_attention(
    q: torch.Tensor,  # [bs, H, D]
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,  # [bs], including the token being decoded
    sm_scale: float,
) -> torch.Tensor:
    # Without a host-side max length, size the splits from the pool's row length (an upper
    # bound, no device sync); the backend passes an exact count instead.
    num_splits = choose_num_kv_splits(q.shape[0], k_buffer.shape[1], req_to_token.shape[1])
    return _decode_attention(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale, num_splits
    )


def _prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    req_to_token: torch.Tensor,  # [R, L] int64
    req_pool_indices: torch.Tensor,  # [bs] int64
    q_start: torch.Tensor,  # [bs] int64, first row of each request in q
    extend_lens: torch.Tensor,  # [bs] int64
    kv_lens: torch.Tensor,  # [bs] int64; queries are the last extend_lens positions of [0, kv_len)
    max_extend: int,  # host int >= max(extend_lens), sizes the grid
    sm_scale: float,
    prefix_lens: torch.Tensor | None = None,  # [bs] int64, tree mode
    tree_mask: torch.Tensor | None = None,  # [bs, n_q, n_new] bool, n_q >= max(extend_lens)
) -> torch.Tensor:
    """Shared launcher: causal when tree_mask is None, else prefix + tree-mask visibility."""
    group = _check_qkv(q, k_buffer, v_buffer)
    head_dim = q.shape[2]
    bs = req_pool_indices.shape[0]
    _check_index("req_to_token", req_to_token, 2, q.device)
    for name, t in (
        ("req_pool_indices", req_pool_indices),
        ("q_start", q_start),
        ("extend_lens", extend_lens),
        ("kv_lens", kv_lens),
    ):
        _check_index(name, t, 1, q.device)
        assert t.shape[0] == bs, f"{name} has {t.shape[0]} rows, batch is {bs}"
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if bs == 0 or q.shape[0] == 0 or max_extend == 0:
        return out

    tree = tree_mask is not None
    if tree:
        assert prefix_lens is not None
        _check_index("prefix_lens", prefix_lens, 1, q.device)
        assert tree_mask.dtype == torch.bool and tree_mask.dim() == 3, tree_mask.dtype
        assert tree_mask.shape[0] == bs and tree_mask.device == q.device
        assert tree_mask.shape[1] >= max_extend, (tree_mask.shape, max_extend)
        tm = tree_mask.view(torch.int8)  # same itemsize; Triton loads int8 more simply than i1
        tm_strides = tm.stride()
        n_new = tree_mask.shape[2]
    else:
        prefix_lens = kv_lens  # unused by the causal specialisation
        tm = extend_lens  # dummy pointer, never dereferenced
        tm_strides = (0, 0, 0)
        n_new = 0

    block_d = _block_d(head_dim)
    rows = max_extend * group  # packed (query, head-of-group) rows of the longest request
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    block_n = 64 if block_d <= 64 else 32
    grid = (bs, k_buffer.shape[1], triton.cdiv(rows, block_m))
    _prefill_kernel[grid](
        q,
        k_buffer,
        v_buffer,
        out,
        req_to_token,
        req_pool_indices,
        q_start,
        extend_lens,
        prefix_lens,
        kv_lens,
        tm,
        sm_scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        req_to_token.stride(1),
        tm_strides[0],
        tm_strides[1],
        tm_strides[2],
        n_new,
        GROUP=group,
        HEAD_DIM=head_dim,
        TREE=tree,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        IEEE=_ieee_dot(q),
        num_warps=4,
        num_stages=2,
    )
    return out


def extend_attention(
    q: torch.Tensor,  # [T, H, D], T = sum(extend_lens)
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    _check_index("prefix_lens", prefix_lens, 1, q.device)
    _check_index("extend_lens", extend_lens, 1, q.device)
    q_start = torch.cumsum(extend_lens, 0) - extend_lens
    # One host sync for the grid size; the backend computes it once per forward instead.
    max_extend = int(extend_lens.max()) if extend_lens.numel() else 0
    return _prefill_attention(
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        q_start,
        extend_lens,
        prefix_lens + extend_lens,
        max_extend,
        sm_scale,
    )


def tree_verify_attention(
    q: torch.Tensor,  # [bs * n, H, D]
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,  # [bs]
    tree_mask: torch.Tensor,  # [bs, n, n] bool
    sm_scale: float,
) -> torch.Tensor:
    _check_index("prefix_lens", prefix_lens, 1, q.device)
    bs, n = prefix_lens.shape[0], tree_mask.shape[1]
    assert tree_mask.shape == (bs, n, n), f"tree_mask {tuple(tree_mask.shape)}, bs {bs}"
    assert q.shape[0] == bs * n, f"q has {q.shape[0]} rows, expected {bs} * {n}"
    extend_lens = torch.full_like(prefix_lens, n)
    q_start = torch.arange(bs, device=q.device, dtype=torch.int64) * n
    return _prefill_attention(
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        q_start,
        extend_lens,
        prefix_lens + n,
        n,
        sm_scale,
        prefix_lens=prefix_lens,
        tree_mask=tree_mask,
    )

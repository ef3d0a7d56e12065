"""Triton paged attention over the layout described in `torch_attention.py`.

Two entry points, taking the per-forward index tensors the backend builds once per forward:
- `decode_attention`: one query per request; split-KV (flash-decoding) in two stages. Stage 1
  gives each (request, KV head, split) program all query heads of that KV head's GQA group, so
  every K/V row is read once per group; stage 2 merges the splits with their log-sum-exps.
- `prefill_attention`: new tokens over a cached prefix, causal (extend), or draft-tree tokens
  over it with visibility from `tree_mask` (tree verify). One jit kernel (`_prefill_kernel`),
  specialised by the constexpr `TREE`; it packs the GQA group into the query-row dimension so
  K/V tiles are read once per group.

All softmax math is fp32 in the log2 domain (scores are pre-multiplied by sm_scale * log2(e)).
Nothing here calls `torch.cuda`: tensors are allocated on `q.device`, so the same code runs under
`TRITON_INTERPRET=1` on CPU tensors and on CUDA/HIP devices.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagleserve.kernels import pdl
from eagleserve.kernels.triton_common import (
    _LOG2E,
    _block_d,
    _check_index,
    _check_qkv,
    _dot,
    _ieee_dot,
    _load_kv_tile,
    _online_softmax_step,
    wait_previous,
)
from eagleserve.kernels.triton_decode import (  # noqa: F401  (re-exported API)
    choose_num_kv_splits,
    decode_attention,
)


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
    PDL: tl.constexpr,
):
    wait_previous(PDL)
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
            k, v = _load_kv_tile(
                K, V, r2t_row, stride_r2t_l, pos, n_valid, kv_head, stride_ks, stride_kh,
                stride_vs, stride_vh, offs_d, d_valid, q,
            )  # fmt: skip
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


def prefill_attention(
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
    """Causal when tree_mask is None, else prefix + tree-mask visibility."""
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
        **pdl.launch_options(q.device),
    )
    return out

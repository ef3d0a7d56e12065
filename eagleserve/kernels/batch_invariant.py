"""Batch-invariant Triton kernels (`--enable-deterministic-inference`).

Each output row is computed by the same sequence of floating-point operations whatever else is
in the batch, so a verify row (chain or tree) or an extend row equals, bit for bit, the decode of
that row. That is what makes greedy EAGLE output equal target-only output on a GPU in bf16:
cuBLAS picks tiles and split-K per shape, and the regular attention kernels split the KV by the
batch, so without these the logits of a k+1-row verify and a 1-row decode differ in the last bits.

- `matmul`: y = x @ w^T (+ b) with ONE fixed tile (BLOCK_M, BLOCK_N, BLOCK_K), warps and stages
  for every M, and a sequential K loop (no split-K): row i's dot products go through the same
  MMA sequence in any batch.
- `rms_norm`: one program per row, one fixed-width reduction.
- `row_attention`: every query row is a decode row with its own KV length and its own list of
  KV slots; the KV is cut into splits of a fixed SPLIT positions counted from the row's start
  (never a function of the batch or of the grid), and the splits are merged in order, one by
  one, over that row's own splits only.

Nothing here calls `torch.cuda`: the same code runs under `TRITON_INTERPRET=1` on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagleserve.kernels.triton_common import (
    _LOG2E,
    _block_d,
    _check_qkv,
    _dot,
    _ieee_dot,
    _split_kv_stage1,
)

# The one GEMM configuration (every M uses it: a different tile could change a row's bits).
GEMM_BLOCK_M = 64
GEMM_BLOCK_N = 64
GEMM_BLOCK_K = 64
GEMM_WARPS = 4
GEMM_STAGES = 3
# KV positions per decode split, counted from each row's position 0.
ATTN_SPLIT = 256
ATTN_BLOCK_N = 32


# M is never specialized (Triton compiles M == 1 and M % 16 == 0 apart otherwise): every batch
# size runs the one compiled kernel.
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    X,  # [M, K]
    W,  # [N, K]
    Bias,  # [N] (HAS_BIAS only)
    Y,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_ym,
    stride_yn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    m_valid = offs_m < M
    n_valid = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # K in order, one tile after the other, into one fp32 accumulator: no split-K.
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_valid = k < K
        x = tl.load(
            X + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
            mask=m_valid[:, None] & k_valid[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            W + offs_n[None, :] * stride_wn + k[:, None] * stride_wk,
            mask=n_valid[None, :] & k_valid[:, None],
            other=0.0,
        ).to(x.dtype)  # [BLOCK_K, BLOCK_N]
        acc += _dot(x, w, IEEE)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(
        Y + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
        acc.to(Y.dtype.element_ty),
        mask=m_valid[:, None] & n_valid[None, :],
    )


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) with a batch-invariant reduction; x [..., K], w [N, K]; output in
    x's dtype (fp32 accumulation)."""
    assert x.shape[-1] == w.shape[1], (x.shape, w.shape)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*lead, n)
    grid = (triton.cdiv(m, GEMM_BLOCK_M), triton.cdiv(n, GEMM_BLOCK_N))
    _matmul_kernel[grid](
        x2, w, bias if bias is not None else w, y, m, n, k,
        x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_M=GEMM_BLOCK_M,
        BLOCK_N=GEMM_BLOCK_N,
        BLOCK_K=GEMM_BLOCK_K,
        IEEE=_ieee_dot(x),
        num_warps=GEMM_WARPS,
        num_stages=GEMM_STAGES,
    )  # fmt: skip
    return y.view(*lead, n)


@triton.jit
def _rms_norm_kernel(X, W, Y, N, eps, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    valid = offs < N
    x = tl.load(X + row * stride_x + offs, mask=valid, other=0.0).to(tl.float32)
    var = tl.sum(x * x, 0) / N
    xn = (x * (1.0 / tl.sqrt(var + eps))).to(Y.dtype.element_ty)
    # As transformers: normalise in fp32, cast to the input dtype, then scale by the weight.
    # (The product of two 16-bit floats is exact in fp32, so this rounds as torch's bf16 mul;
    # it also avoids 16-bit arithmetic, which the interpreter gets wrong.)
    w = tl.load(W + offs, mask=valid, other=0.0).to(Y.dtype.element_ty).to(tl.float32)
    y = w * xn.to(tl.float32)
    tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=valid)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, one program per row (a row's bits never depend on the batch)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight, y, n, eps, x2.stride(0), y.stride(0), BLOCK=triton.next_power_of_2(n)
        )
    return y.view(x.shape)


@triton.jit
def _row_attn_stage1(
    Q,  # [T, H, D]
    K,  # [S, Hkv, D]
    V,  # [S, Hkv, D]
    Table,  # [R, L] int64: KV slot of each position of a table row
    RowIdx,  # [T] int64: the table row each query reads
    RowLens,  # [T] int64: KV positions [0, len) each query reads (its own included)
    MidO,  # [T, H, NUM_SPLITS, D] fp32
    MidLse,  # [T, H, NUM_SPLITS] fp32
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_tb_r,
    stride_tb_l,
    stride_mo_t,
    stride_mo_h,
    stride_mo_s,
    stride_ml_t,
    stride_ml_h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(RowLens + t)
    start = split * SPLIT
    # Splits past the row's end are skipped; stage 2 reads only the row's own splits.
    if start < seq_len:
        row = tl.load(RowIdx + t)
        _split_kv_stage1(
            Q, K, V, MidO, MidLse, t, Table + row * stride_tb_r, kv_head, split, start,
            tl.minimum(start + SPLIT, seq_len), qk_scale, stride_qt, stride_qh, stride_ks,
            stride_kh, stride_vs, stride_vh, stride_tb_l, stride_mo_t, stride_mo_h, stride_mo_s,
            stride_ml_t, stride_ml_h, GROUP, HEAD_DIM, BLOCK_H, BLOCK_N, BLOCK_D, IEEE,
        )  # fmt: skip


@triton.jit
def _row_attn_stage2(
    MidO,
    MidLse,
    RowLens,
    Out,  # [T, H, D]
    stride_mo_t,
    stride_mo_h,
    stride_mo_s,
    stride_ml_t,
    stride_ml_h,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    n_splits = tl.cdiv(tl.load(RowLens + t), SPLIT)
    m = tl.load(MidLse + t * stride_ml_t + h * stride_ml_h)
    acc = tl.load(MidO + t * stride_mo_t + h * stride_mo_h + offs_d, mask=d_valid, other=0.0)
    w_sum = tl.zeros_like(m) + 1.0  # split 0 is non-empty: its lse is finite
    # The row's splits in order, one merge each: the same sequence for the same row always.
    for s in range(1, n_splits):
        lse = tl.load(MidLse + t * stride_ml_t + h * stride_ml_h + s)
        o = tl.load(
            MidO + t * stride_mo_t + h * stride_mo_h + s * stride_mo_s + offs_d,
            mask=d_valid,
            other=0.0,
        )
        m_new = tl.maximum(m, lse)
        a = tl.exp2(m - m_new)
        b = tl.exp2(lse - m_new)
        acc = acc * a + o * b
        w_sum = w_sum * a + b
        m = m_new
    tl.store(
        Out + t * stride_ot + h * stride_oh + offs_d,
        (acc / w_sum).to(Out.dtype.element_ty),
        mask=d_valid,
    )


def num_splits(max_row_len: int) -> int:
    """Stage-1 grid depth covering a row of max_row_len positions (a host bound)."""
    return max(1, triton.cdiv(max_row_len, ATTN_SPLIT))


def row_attention(
    q: torch.Tensor,  # [T, H, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    table: torch.Tensor,  # [R, L] int64, KV slot of each position of a table row
    row_idx: torch.Tensor,  # [T] int64, the table row of each query
    row_lens: torch.Tensor,  # [T] int64 >= 1, positions each query reads
    sm_scale: float,
    max_row_len: int,  # host upper bound of row_lens (sizes the grid only)
) -> torch.Tensor:
    """Each query attends, as a decode would, over table[row_idx[t], :row_lens[t]]."""
    group = _check_qkv(q, k_buffer, v_buffer)
    t_rows, num_heads, head_dim = q.shape
    kv_heads = k_buffer.shape[1]
    splits = num_splits(max_row_len)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if t_rows == 0:
        return out
    mid_o = torch.empty((t_rows, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((t_rows, num_heads, splits), dtype=torch.float32, device=q.device)
    block_d = _block_d(head_dim)
    _row_attn_stage1[(t_rows, kv_heads, splits)](
        q, k_buffer, v_buffer, table, row_idx, row_lens, mid_o, mid_lse, sm_scale * _LOG2E,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), table.stride(0), table.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        SPLIT=ATTN_SPLIT,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=ATTN_BLOCK_N,
        BLOCK_D=block_d,
        IEEE=_ieee_dot(q),
        num_warps=4,
        num_stages=2,
    )  # fmt: skip
    _row_attn_stage2[(t_rows, num_heads)](
        mid_o, mid_lse, row_lens, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        SPLIT=ATTN_SPLIT,
        BLOCK_D=block_d,
        num_warps=2,
    )  # fmt: skip
    return out


def causal_rows(
    kv_lens: torch.Tensor, extend_lens: torch.Tensor, n_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(request of each query row, its KV length) for requests whose extend_lens new tokens are
    the last positions of [0, kv_len): row i of a request reads kv_len - extend_len + i + 1.
    Device ops only (no sync); n_rows = sum(extend_lens), a host int."""
    ends = torch.cumsum(extend_lens, 0)
    rows = torch.arange(n_rows, device=kv_lens.device)
    req = torch.searchsorted(ends, rows, right=True)
    within = rows - (ends - extend_lens)[req]
    return req, (kv_lens - extend_lens)[req] + within + 1


def tree_row_table(
    req_to_token: torch.Tensor,  # [R, L]
    req_pool_indices: torch.Tensor,  # [bs]
    prefix_lens: torch.Tensor,  # [bs]
    tree_mask: torch.Tensor,  # [bs, n_q, n_new] bool/int8: query i sees new token j
    max_len: int,  # host bound: prefix_len + n_new <= max_len for every request
) -> tuple[torch.Tensor, torch.Tensor]:
    """(table [bs*n_q, max_len] of KV slots, row_lens [bs*n_q]): each tree query's visible
    positions (the prefix, then the tree tokens it sees, in index order = depth order since a
    parent precedes its children), packed from position 0, as the decode of that token after its
    ancestors were committed reads them."""
    bs, n_q, n_new = tree_mask.shape
    dev = req_to_token.device
    pos = torch.arange(max_len, device=dev)
    prefix = prefix_lens[:, None, None]
    in_tree = (pos >= prefix) & (pos < prefix + n_new)  # [bs, 1, L]
    j = (pos - prefix).clamp(0, n_new - 1).expand(bs, n_q, max_len)
    visible = (pos < prefix) | (in_tree & tree_mask.bool().gather(2, j))  # [bs, n_q, L]
    # Visible positions first, in increasing order (stable sort on the hidden flag).
    order = torch.sort((~visible).to(torch.int8), dim=-1, stable=True).indices
    slots = req_to_token[req_pool_indices][:, None, :max_len].expand(bs, n_q, max_len)
    table = slots.gather(2, order).reshape(bs * n_q, max_len)
    return table, visible.sum(-1).reshape(bs * n_q)

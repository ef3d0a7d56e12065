"""Plain-torch paged attention: the CPU path, and the reference the Triton kernels are tested on.

Layout shared with the Triton kernels:
- `k_buffer`, `v_buffer`: [num_slots, num_kv_heads, head_dim]; the K/V of *every* token a query
  may see (prefix and the new tokens themselves) is already written there.
- Request b reads slots `req_to_token[req_pool_indices[b], :prefix_lens[b] + extend_lens[b]]`.
- Queries are flattened request by request: [sum(extend_lens), num_heads, head_dim].
- New token i of request b sits at position prefix_lens[b] + i. It sees the whole prefix and, among
  the new tokens, token j when j <= i (causal) or when tree_mask[b, i, j] (verify).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PaddedAttnMetadata:
    """Built once per forward, shared by all layers."""

    kv_indices: torch.Tensor  # [bs, max_kv] KV slots (padding -> slot 0)
    q_gather: torch.Tensor  # [bs, max_q] row of the flattened queries (padding -> 0)
    q_valid: torch.Tensor  # [bs, max_q] bool
    mask: torch.Tensor  # [bs, 1, max_q, max_kv] bool, True = may attend
    # Every request has max_q queries (decode, verify, draft steps): the flattened queries are
    # already [bs, max_q] row-major, so no gather is needed going in or out.
    uniform_q: bool = False


def build_padded_metadata(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    max_q: int,
    max_kv: int,
    uniform_q: bool,
    tree_mask: torch.Tensor | None = None,
    kv_lens: torch.Tensor | None = None,
) -> PaddedAttnMetadata:
    """Padded gather indices and the boolean mask for one forward.

    Queries are the *last* extend_lens tokens of each request's KV range [0, kv_lens) (kv_lens
    defaults to prefix_lens + extend_lens). With a tree_mask [bs, n_q, n_new], the region
    [prefix_lens, prefix_lens + n_new) is visible only where the mask says so; the prefix always is.
    `max_q` >= every extend len and `max_kv` >= every KV range are host ints (upper bounds pad);
    `uniform_q` says every request has exactly `max_q` queries. Nothing here syncs the device.
    """
    device = req_to_token.device
    seq_lens = prefix_lens + extend_lens if kv_lens is None else kv_lens
    max_kv = min(max_kv, req_to_token.shape[1])
    kv_pos = torch.arange(max_kv, device=device)  # [max_kv]
    kv_indices = req_to_token[req_pool_indices][:, :max_kv]  # [bs, max_kv]
    kv_valid = kv_pos[None, :] < seq_lens[:, None]
    kv_indices = torch.where(kv_valid, kv_indices, torch.zeros_like(kv_indices))

    q_pos = torch.arange(max_q, device=device)  # [max_q]
    q_valid = q_pos[None, :] < extend_lens[:, None]  # [bs, max_q]
    q_start = torch.cumsum(extend_lens, 0) - extend_lens
    q_gather = torch.where(
        q_valid, q_start[:, None] + q_pos[None, :], torch.zeros_like(q_valid, dtype=torch.long)
    )
    if tree_mask is None:
        # Causal: a query at absolute position p sees keys 0..p.
        q_abs = (seq_lens - extend_lens)[:, None] + q_pos[None, :]  # [bs, max_q]
        mask = (kv_pos[None, None, :] <= q_abs[:, :, None]) & kv_valid[:, None, :]
    else:
        n_q, n_new = tree_mask.shape[1], tree_mask.shape[2]
        in_prefix = kv_pos[None, None, :] < prefix_lens[:, None, None]
        new_j = (kv_pos[None, :] - prefix_lens[:, None]).clamp(0, n_new - 1)  # [bs, max_kv]
        qi = q_pos.clamp(max=n_q - 1)
        tm = torch.gather(tree_mask[:, qi, :], 2, new_j[:, None, :].expand(-1, max_q, -1))
        mask = kv_valid[:, None, :] & (in_prefix | tm)  # [bs, max_q, max_kv]
    # Padded query rows attend to slot 0 only, so softmax never sees an all-False row.
    mask = mask | (~q_valid[:, :, None] & (kv_pos[None, None, :] == 0))
    return PaddedAttnMetadata(kv_indices, q_gather, q_valid, mask[:, None], uniform_q)


def padded_attention(
    q: torch.Tensor,  # [T, H, D]
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    md: PaddedAttnMetadata,
    sm_scale: float,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """compute_dtype (default q.dtype): float64 makes a query's result independent, up to
    rounding to q.dtype, of the padded shape it was computed in (see TorchAttnBackend)."""
    bs, max_q = md.q_gather.shape
    num_heads, kv_heads, head_dim = q.shape[1], k_buffer.shape[1], q.shape[2]
    cd = compute_dtype or q.dtype
    qp = q.view(bs, max_q, num_heads, head_dim) if md.uniform_q else q[md.q_gather]
    qp = qp.transpose(1, 2).to(cd)  # [bs, H, max_q, D]
    # index_select copies whole rows; advanced indexing goes element by element on CPU.
    flat = md.kv_indices.reshape(-1)
    k = k_buffer.index_select(0, flat).view(bs, -1, kv_heads, head_dim).transpose(1, 2).to(cd)
    v = v_buffer.index_select(0, flat).view(bs, -1, kv_heads, head_dim).transpose(1, 2).to(cd)
    # GQA inside SDPA: no copy of K/V per query head. k, v [bs, Hkv, max_kv, D]
    out = F.scaled_dot_product_attention(
        qp, k, v, attn_mask=md.mask, scale=sm_scale, enable_gqa=kv_heads != num_heads
    )
    out = out.transpose(1, 2)  # [bs, max_q, H, D]
    out = out.reshape(-1, num_heads, head_dim) if md.uniform_q else out[md.q_valid]
    return out.to(q.dtype)  # [T, H, D]

"""Reference attentions for the kernel tests: the padded torch path with host bounds read off the
(test-made) length tensors."""

from __future__ import annotations

import torch

from eagleserve.kernels.torch_attention import (
    PaddedAttnMetadata,
    build_padded_metadata,
    padded_attention,
)


def padded_metadata(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    tree_mask: torch.Tensor | None = None,
    kv_lens: torch.Tensor | None = None,
) -> PaddedAttnMetadata:
    """build_padded_metadata with exact host bounds (a test may sync the device)."""
    kv = prefix_lens + extend_lens if kv_lens is None else kv_lens
    max_q = int(extend_lens.max())
    uniform = bool((extend_lens == max_q).all())
    return build_padded_metadata(
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        max_q,
        int(kv.max()),
        uniform,
        tree_mask,
        kv_lens,
    )


def extend_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    md = padded_metadata(req_to_token, req_pool_indices, prefix_lens, extend_lens)
    return padded_attention(q, k_buffer, v_buffer, md, sm_scale)


def decode_attention_ref(
    q: torch.Tensor,  # [bs, H, D]
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,  # [bs], including the token being decoded
    sm_scale: float,
) -> torch.Tensor:
    ones = torch.ones_like(seq_lens)
    md = padded_metadata(req_to_token, req_pool_indices, seq_lens - 1, ones)
    return padded_attention(q, k_buffer, v_buffer, md, sm_scale)


def tree_verify_attention_ref(
    q: torch.Tensor,  # [bs * n, H, D]
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,  # [bs]
    tree_mask: torch.Tensor,  # [bs, n, n] bool
    sm_scale: float,
) -> torch.Tensor:
    n = tree_mask.shape[1]
    extend_lens = torch.full_like(prefix_lens, n)
    md = padded_metadata(req_to_token, req_pool_indices, prefix_lens, extend_lens, tree_mask)
    return padded_attention(q, k_buffer, v_buffer, md, sm_scale)

"""Attention backends: prepare per-forward metadata once, then attend per layer.

A backend reads the paged KV through `req_to_token`; the forward's new K/V are written to their
slots before attending. Tree verify is one more metadata kind (a `tree_mask` on the ForwardBatch).
"""

from __future__ import annotations

from typing import Protocol

import torch

from eagleserve.kernels.torch_attention import build_padded_metadata, padded_attention
from eagleserve.model.forward_batch import ForwardBatch


class AttentionBackend(Protocol):
    def init_forward_metadata(self, fb: ForwardBatch) -> None: ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor: ...


class TorchAttnBackend:
    """Padded-batch SDPA over gathered K/V; exact and fast enough on CPU."""

    def __init__(self, req_to_token: torch.Tensor, sm_scale: float) -> None:
        self.req_to_token = req_to_token
        self.sm_scale = sm_scale

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        fb.attn_metadata = build_padded_metadata(
            self.req_to_token,
            fb.req_pool_indices,
            fb.prefix_lens,
            fb.extend_lens,
            fb.tree_mask,
            fb.kv_lens,
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor:
        # q [T, H, D]; k, v [T, Hkv, D]
        pool = fb.kv_pool
        pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        return padded_attention(
            q, pool.k_buffer[layer_id], pool.v_buffer[layer_id], fb.attn_metadata, self.sm_scale
        )


def create_attn_backend(
    name: str, device: torch.device, req_to_token: torch.Tensor, sm_scale: float
) -> AttentionBackend:
    if name == "auto":
        name = "torch" if device.type == "cpu" else "triton"
    if name == "torch":
        return TorchAttnBackend(req_to_token, sm_scale)
    if name == "triton":
        from eagleserve.model.triton_backend import TritonAttnBackend

        return TritonAttnBackend(req_to_token, sm_scale)
    raise ValueError(f"unknown attention backend {name!r} (auto, torch or triton)")

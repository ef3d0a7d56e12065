"""Attention backends: prepare per-forward metadata once, then attend per layer.

A backend reads the paged KV through `req_to_token`; the forward's new K/V are written to their
slots before attending. Tree verify is one more metadata kind (a `tree_mask` on the ForwardBatch).
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from eagleserve.kernels import cpu_ext
from eagleserve.kernels.torch_attention import build_padded_metadata, padded_attention
from eagleserve.layers.forward_batch import ForwardBatch, store_new_kv


class AttentionBackend(Protocol):
    def init_forward_metadata(self, fb: ForwardBatch) -> None: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        fb: ForwardBatch,
        kv_stored: bool = False,  # k/v already written to fb.out_cache_loc
    ) -> torch.Tensor: ...


class TorchAttnBackend:
    """Padded-batch SDPA over gathered K/V; exact and fast enough on CPU.

    A query's fp32 result depends in its last bits on the padded shape (decode: 1 query, verify:
    n, other requests' lengths). When the linears round their inputs to bf16 (packed GGUF
    weights), such a bit can flip a rounding and so a greedy token: speculative output would
    then differ from target-only output. compute_dtype=float64 removes that: the fp64 results
    differ by ~1e-16, which rounding back to fp32 erases. With `row_kernel`, every forward over
    an fp32 or fp16 pool (prefill, decode, verify) runs kernels/cpu_attention.cpp instead, whose
    per-row result does not depend on the batch at all: a prefill row equals the decode at its
    position.
    """

    def __init__(
        self,
        req_to_token: torch.Tensor,
        sm_scale: float,
        compute_dtype: torch.dtype | None = None,
        row_kernel: bool = False,
    ) -> None:
        self.req_to_token = req_to_token
        self.sm_scale = sm_scale
        self.compute_dtype = compute_dtype
        self.row_kernel = row_kernel

    def uses_row_kernel(self, fb: ForwardBatch) -> bool:
        """Whether this forward's attention runs kernels/cpu_attention.cpp (an fp32 or fp16
        pool)."""
        return self.row_kernel and fb.kv_pool.dtype in (torch.float32, torch.float16)

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if self.uses_row_kernel(fb):
            fb.attn_metadata = fb.prefix_lens + fb.extend_lens if fb.kv_lens is None else fb.kv_lens
            return
        fb.attn_metadata = build_padded_metadata(
            self.req_to_token,
            fb.req_pool_indices,
            fb.prefix_lens,
            fb.extend_lens,
            fb.host.max_extend,
            fb.host.max_kv,
            fb.host.uniform,
            fb.tree_mask,
            fb.kv_lens,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        fb: ForwardBatch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        # q [T, H, D]; k, v [T, Hkv, D]
        row_kernel = self.uses_row_kernel(fb)
        store_new_kv(fb, layer_id, k, v, kv_stored, one_call=row_kernel)
        kb, vb = fb.kv_pool.k_buffer[layer_id], fb.kv_pool.v_buffer[layer_id]
        if not row_kernel:
            return padded_attention(q, kb, vb, fb.attn_metadata, self.sm_scale, self.compute_dtype)
        return cpu_ext.paged_attention(
            q.float(), kb, vb, self.req_to_token, fb.req_pool_indices, fb.prefix_lens,
            fb.extend_lens, fb.attn_metadata, fb.tree_mask, self.sm_scale,
        ).to(q.dtype)  # fmt: skip


def create_attn_backend(
    name: str,
    device: torch.device,
    req_to_token: torch.Tensor,
    sm_scale: float,
    shape_invariant: bool = False,
    deterministic: bool = False,
) -> AttentionBackend:
    """shape_invariant: results must not depend on the batch's padded shape (torch: fp64).
    deterministic (--enable-deterministic-inference): a row's result must not depend on the
    batch at all; triton: every query as a decode row; torch (CPU): shape_invariant."""
    if name == "auto":
        name = "torch" if device.type == "cpu" else "triton"
    if deterministic and name == "torch":
        if device.type != "cpu":
            raise ValueError("--enable-deterministic-inference on a GPU needs the triton backend")
        shape_invariant = True
    if name == "torch":
        # CPU SDPA with a mask has no fast bf16/fp16 path (it is slower than fp32), so CPU
        # attention computes in fp32 at least.
        compute = torch.float64 if shape_invariant else None
        if compute is None and device.type == "cpu":
            compute = torch.float32
        row_kernel = shape_invariant and device.type == "cpu" and cpu_ext.load()
        return TorchAttnBackend(req_to_token, sm_scale, compute, row_kernel)
    if shape_invariant and not deterministic:
        raise ValueError(f"the {name} attention backend cannot guarantee shape invariance")
    if name == "triton":
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "the triton attention backend runs on a GPU; on a CPU use torch (the default), "
                "or set TRITON_INTERPRET=1 to run its kernels in Triton's interpreter (slow)"
            )
        from eagleserve.layers.triton_backend import TritonAttnBackend

        return TritonAttnBackend(req_to_token, sm_scale, deterministic)
    raise ValueError(f"unknown attention backend {name!r} (auto, torch or triton)")

"""Attention backend on the Triton paged kernels (GPU path; also runs under TRITON_INTERPRET=1).

Per forward, `init_forward_metadata` builds every index tensor once from the ForwardBatch and
its host bounds (no device->host sync); `forward` then only writes K/V and launches kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagleserve.kernels import batch_invariant as bi
from eagleserve.kernels.triton_attention import (
    choose_num_kv_splits,
    decode_attention,
    prefill_attention,
)
from eagleserve.layers.forward_batch import ForwardBatch, store_new_kv


@dataclass
class TritonAttnMetadata:
    """Shared by all layers of one forward."""

    kind: str  # "decode" | "extend" (causal) | "tree"
    kv_lens: torch.Tensor  # [bs] int64, KV range [0, kv_len) each request reads
    extend_lens: torch.Tensor  # [bs] int64
    # [bs] int64, first query row of each request; None for decode (its kernel has no use).
    extend_start_loc: torch.Tensor | None
    max_extend: int
    max_kv_len: int
    num_kv_splits: int  # decode only; chosen on the first layer (needs Hkv)
    # Decode scratch, allocated on the first layer and reused by the others.
    mid_o: torch.Tensor | None = None  # [bs, H, num_kv_splits, D] fp32
    mid_lse: torch.Tensor | None = None  # [bs, H, num_kv_splits] fp32
    # Deterministic mode: every query row as a decode row (kernels/batch_invariant.py), built on
    # the forward's first layer (inside a graph capture, so replays rebuild it from its buffers).
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # table, row_idx, lens
    rows_layer: int = -1


def _start_locs(kind: str, extend_lens: torch.Tensor) -> torch.Tensor | None:
    """Each request's first query row, for the kernels that read it (not decode's)."""
    return None if kind == "decode" else torch.cumsum(extend_lens, 0) - extend_lens


class TritonAttnBackend:
    """Same contract as TorchAttnBackend: results match `torch_attention` to fp32 rounding."""

    def __init__(
        self, req_to_token: torch.Tensor, sm_scale: float, deterministic: bool = False
    ) -> None:
        self.req_to_token = req_to_token  # [R, L] int64
        self.sm_scale = sm_scale
        # --enable-deterministic-inference: every kind attends row by row as a decode would.
        self.deterministic = deterministic

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        extend_lens = fb.extend_lens
        kv_lens = fb.prefix_lens + extend_lens if fb.kv_lens is None else fb.kv_lens
        # Grid sizes are host ints: the scheduler's bounds, never a read of the device lengths.
        max_extend, max_kv_len = fb.host.max_extend, fb.host.max_kv
        if fb.tree_mask is not None:
            kind = "tree"
        elif max_extend == 1 and fb.host.uniform:
            # One query per request (decode, chain drafting, or a 1-token extend): the query is
            # the last position of its KV range, exactly what the split-KV decode kernel computes.
            kind = "decode"
        else:
            kind = "extend"
        fb.attn_metadata = TritonAttnMetadata(
            kind=kind,
            kv_lens=kv_lens,
            extend_lens=extend_lens,
            extend_start_loc=_start_locs(kind, extend_lens),
            max_extend=max_extend,
            max_kv_len=max_kv_len,
            num_kv_splits=0,
        )

    def init_forward_metadata_static(self, fb: ForwardBatch) -> None:
        """Graph capture: metadata over the static buffers only (`fb.kv_lens` is one, refilled
        before each replay), so nothing here goes stale. Every request has the same number of
        new tokens; the split count covers the longest possible row."""
        extend_lens = fb.extend_lens
        assert fb.kv_lens is not None, "graph capture needs a static kv_lens buffer"
        n = fb.host.max_extend
        kind = "tree" if fb.tree_mask is not None else ("decode" if n == 1 else "extend")
        fb.attn_metadata = TritonAttnMetadata(
            kind=kind,
            kv_lens=fb.kv_lens,
            extend_lens=extend_lens,
            extend_start_loc=_start_locs(kind, extend_lens),
            max_extend=n,
            max_kv_len=self.req_to_token.shape[1],
            num_kv_splits=0,
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
        # q [T, H, D]; k, v [T, Hkv, D]; kv_stored: already in their slots (kernels/triton_fused)
        store_new_kv(fb, layer_id, k, v, kv_stored)
        k_buf, v_buf = fb.kv_pool.k_buffer[layer_id], fb.kv_pool.v_buffer[layer_id]  # [S, Hkv, D]
        md: TritonAttnMetadata = fb.attn_metadata
        if self.deterministic:
            return self._row_attention(q, k_buf, v_buf, layer_id, fb, md)
        if md.kind == "decode":
            if md.mid_o is None:
                bs, num_heads, head_dim = q.shape
                md.num_kv_splits = choose_num_kv_splits(bs, k_buf.shape[1], md.max_kv_len)
                md.mid_o = torch.empty(
                    (bs, num_heads, md.num_kv_splits, head_dim),
                    dtype=torch.float32,
                    device=q.device,
                )
                md.mid_lse = torch.empty(
                    (bs, num_heads, md.num_kv_splits), dtype=torch.float32, device=q.device
                )
            return decode_attention(
                q,
                k_buf,
                v_buf,
                self.req_to_token,
                fb.req_pool_indices,
                md.kv_lens,
                self.sm_scale,
                md.num_kv_splits,
                md.mid_o,
                md.mid_lse,
            )
        tree = md.kind == "tree"
        assert md.extend_start_loc is not None
        return prefill_attention(
            q,
            k_buf,
            v_buf,
            self.req_to_token,
            fb.req_pool_indices,
            md.extend_start_loc,
            md.extend_lens,
            md.kv_lens,
            md.max_extend,
            self.sm_scale,
            prefix_lens=fb.prefix_lens if tree else None,
            tree_mask=fb.tree_mask if tree else None,
        )

    def _row_attention(
        self,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        layer_id: int,
        fb: ForwardBatch,
        md: TritonAttnMetadata,
    ) -> torch.Tensor:
        if md.rows is None or layer_id == md.rows_layer:
            md.rows_layer = layer_id
            if md.kind == "tree":
                table, lens = bi.tree_row_table(
                    self.req_to_token, fb.req_pool_indices, fb.prefix_lens, fb.tree_mask,
                    md.max_kv_len,
                )  # fmt: skip
                row_idx = torch.arange(q.shape[0], device=q.device)
                md.rows = (table, row_idx, lens)
            else:
                req, lens = bi.causal_rows(md.kv_lens, md.extend_lens, q.shape[0])
                md.rows = (self.req_to_token, fb.req_pool_indices[req], lens)
        table, row_idx, lens = md.rows
        return bi.row_attention(q, k_buf, v_buf, table, row_idx, lens, self.sm_scale, md.max_kv_len)

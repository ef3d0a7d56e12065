"""Per-forward metadata, set by a `with forward_context(fb):` block around one model forward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from eagleserve.core import ForwardMode

if TYPE_CHECKING:
    from eagleserve.model.attention import AttentionBackend
    from eagleserve.model.kv_cache import TokenToKVPool


@dataclass
class ForwardBatch:
    """What one forward needs. Built by the model runner (target) or the EAGLE worker (draft)."""

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot each token writes
    req_pool_indices: torch.Tensor  # [bs] int64
    prefix_lens: torch.Tensor  # [bs] int64, positions already cached before this forward
    extend_lens: torch.Tensor  # [bs] int64, tokens per request in this forward
    kv_pool: TokenToKVPool
    attn_backend: AttentionBackend
    # Rows of the flattened tokens whose logits are wanted (None: all rows).
    logits_indices: torch.Tensor | None = None
    # Verify and tree drafting: [bs, n_q, n_new] bool over the region after the prefix (see
    # kernels/torch_attention.py); None means causal.
    tree_mask: torch.Tensor | None = None
    # KV range per request when it is longer than prefix + extend (tree drafting); else None.
    kv_lens: torch.Tensor | None = None
    # Filled by attn_backend.init_forward_metadata before the forward.
    attn_metadata: Any = None

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])


_current: ForwardBatch | None = None


@contextlib.contextmanager
def forward_context(fb: ForwardBatch) -> Iterator[ForwardBatch]:
    global _current
    if _current is not None:
        raise RuntimeError("forward_context does not nest: a forward is already running")
    if fb.attn_metadata is None:  # graph replays bring static metadata of their own
        fb.attn_backend.init_forward_metadata(fb)
    _current = fb
    try:
        yield fb
    finally:
        _current = None


def get_forward_batch() -> ForwardBatch:
    if _current is None:
        raise RuntimeError("no forward_context is active")
    return _current

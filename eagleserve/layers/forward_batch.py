"""One forward's inputs: a `ForwardBatch`, built in one place from the `ScheduleBatch` (target
prefill and decode) or by the EAGLE workers (draft and verify), and set around the model's
forward by `with forward_context(fb):`.

Host-side bounds (`HostLens`) travel with it: they come from the scheduler's `seq_lens_cpu` and
the host extend lengths, so no attention backend reads a device tensor to size a grid or a
padding (on an accelerator that read would stall the overlap scheduler every step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from eagleserve.core import ForwardMode, ScheduleBatch
from eagleserve.device import host_to
from eagleserve.kernels import cpu_ext

if TYPE_CHECKING:
    from eagleserve.layers.attention import AttentionBackend
    from eagleserve.mem_cache.kv_cache import TokenToKVPool


@dataclass(frozen=True)
class HostLens:
    """Host ints bounding one forward. Upper bounds are allowed (they only add padding), except
    that `uniform` claims every request has exactly `max_extend` new tokens."""

    max_extend: int  # most new tokens of any request
    max_kv: int  # longest KV range [0, kv_len) any request reads
    uniform: bool

    @staticmethod
    def of(extend_lens: Sequence[int], kv_lens: Sequence[int]) -> HostLens:
        if len(extend_lens) == 0:
            return HostLens(0, 0, True)
        hi = max(extend_lens)
        return HostLens(hi, max(kv_lens), min(extend_lens) == hi)

    @staticmethod
    def per_request(n: int, max_prefix: int, bs: int) -> HostLens:
        """Every request adds `n` tokens after a prefix of at most `max_prefix`."""
        return HostLens(n if bs else 0, max_prefix + n if bs else 0, True)


@dataclass
class ForwardBatch:
    """What one forward needs; see the module docstring for who builds it."""

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot each token writes
    req_pool_indices: torch.Tensor  # [bs] int64
    prefix_lens: torch.Tensor  # [bs] int64, positions already cached before this forward
    extend_lens: torch.Tensor  # [bs] int64, tokens per request in this forward
    host: HostLens
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

    @classmethod
    def init_new(
        cls, batch: ScheduleBatch, kv_pool: TokenToKVPool, attn_backend: AttentionBackend
    ) -> ForwardBatch:
        """The target forward of a scheduled prefill or decode batch.

        Extend: every request's tokens after its cached prefix, logits of the last one only.
        Decode: one token per request at position seq_lens - 1 (its slot is already reserved).
        """
        dev = batch.device
        if batch.mode == "extend":
            assert batch.prefix_lens is not None and batch.extend_lens is not None
            ext = torch.tensor(batch.extend_lens, dtype=torch.long)
            pre = torch.tensor(batch.prefix_lens, dtype=torch.long)
            positions = torch.cat([torch.arange(p, p + n) for p, n in zip(pre.tolist(), ext)])
            extend_lens = host_to(ext, dev)
            return cls(
                mode="extend",
                input_ids=batch.input_ids,
                positions=host_to(positions, dev),
                out_cache_loc=batch.out_cache_loc,
                req_pool_indices=batch.req_pool_indices,
                prefix_lens=host_to(pre, dev),
                extend_lens=extend_lens,
                host=HostLens.of(batch.extend_lens, (pre + ext).tolist()),
                kv_pool=kv_pool,
                attn_backend=attn_backend,
                logits_indices=torch.cumsum(extend_lens, 0) - 1,
            )
        assert batch.seq_lens_cpu is not None, "decode needs the scheduler's host seq lens"
        max_kv = int(batch.seq_lens_cpu.max()) if batch.batch_size else 0
        last = batch.seq_lens - 1  # a decode token's position is its prefix length: one launch
        return cls(
            mode="decode",
            input_ids=batch.input_ids,
            positions=last,
            out_cache_loc=batch.out_cache_loc,
            req_pool_indices=batch.req_pool_indices,
            prefix_lens=last,
            extend_lens=torch.ones_like(batch.seq_lens),
            host=HostLens.per_request(1, max_kv - 1, batch.batch_size),
            kv_pool=kv_pool,
            attn_backend=attn_backend,
        )


def store_new_kv(
    fb: ForwardBatch,
    layer_id: int,
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_stored: bool,  # already in their slots (kernels/triton_fused): nothing to write
    one_call: bool = False,  # fp32 k through the loaded CPU extension's store_kv_
) -> None:
    """Writes the forward's new K/V to their slots fb.out_cache_loc of layer layer_id, as every
    attention backend must before it attends."""
    if kv_stored:
        return
    pool = fb.kv_pool
    if one_call and k.dtype == torch.float32:
        # One call, no index_put (views of a fused qkv are fine).
        cpu_ext.store_kv_(pool.k_buffer[layer_id], pool.v_buffer[layer_id], fb.out_cache_loc, k, v)
    else:
        pool.set_kv(layer_id, fb.out_cache_loc, k, v)


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


def in_forward() -> bool:
    """A model forward (prefill, decode, verify or draft step) is running."""
    return _current is not None

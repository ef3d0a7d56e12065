"""Head input held back while a request does not speculate (adaptive k = 0), and its catch-up.

The head's KV must cover every committed position before it drafts again. A k = 0 iteration
commits one token per request without running the head; instead its head input (the new token
and the target feature of the position before it) is held, by reference, per request slot.
When the request drafts again, one head extend over its held pairs (`catch_up_batch`) writes the
missing head KV and yields the seed of the next draft: exactly what the skipped extends would
have produced, at the cost of one extend instead of one per skipped token. A request whose ring
is full and still does not draft has its held pairs flushed: their head KV written (the K/V
projection only, `EagleHead.write_kv`), and the ring starts over; its next draft's catch-up then
covers the pairs held since.

A prefill under adaptive speculation writes the prompt's head KV and holds its last row as the
request's first pair (`EagleDraftWorker.write_prompt`): that row's whole layer and lm_head give
only the seed of a draft.

How many pairs a request holds is host-side knowledge (the scheduler decided every k), so no
device value is read to build the catch-up.
"""

from __future__ import annotations

import itertools

import torch

from eagleserve.core import ScheduleBatch
from eagleserve.device import tensor_to
from eagleserve.layers.attention import AttentionBackend
from eagleserve.layers.forward_batch import ForwardBatch, HostLens
from eagleserve.mem_cache.kv_cache import TokenToKVPool


class DraftLag:
    """Per request slot, the pairs held since its head KV was last written, in order: each a
    reference to the decode outputs it is a row of (ids [bs], features [bs, F]) and that row.
    Holding copies nothing: a k = 0 iteration adds no tensor op to a plain decode, where on a
    CPU every op after a forward pays for its code and data coming back into the caches. The
    caller hands in tensors no later forward writes to (a CUDA graph's outputs are cloned).
    A finished request's pairs stay until its slot's next request holds its first: at most
    max_lag references per slot."""

    def __init__(self, num_req_slots: int, max_lag: int) -> None:
        self.max_lag = max_lag
        self.held: list[list[tuple[torch.Tensor, torch.Tensor, int]]] = [
            [] for _ in range(num_req_slots)
        ]

    def hold(
        self,
        slots: list[int],
        lags: list[int],
        next_ids: torch.Tensor,
        features: torch.Tensor,
        rows: list[int] | None = None,
    ) -> None:
        """Holds row rows[i] (default i) of (next_ids, features) as request slots[i]'s pair
        number lags[i] (its count of pairs held so far: pairs past it were caught up, flushed,
        or belong to an earlier request in the slot, and are dropped)."""
        assert max(lags, default=0) < self.max_lag, "draft lag ring overflow"
        rows = list(range(len(slots))) if rows is None else rows
        for row, slot, m in zip(rows, slots, lags, strict=True):
            pairs = self.held[slot]
            assert len(pairs) >= m, "held pairs lost"
            del pairs[m:]
            pairs.append((next_ids, features, row))

    def take(self, slots: list[int], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [N], features [N, F]) of the first counts[i] pairs held for each of `slots`,
        request after request, and releases them. One gather over the distinct outputs they
        are rows of, whatever the number of pairs."""
        sources: dict[int, int] = {}  # id(features) -> its rows' offset in the concatenation
        ids_parts: list[torch.Tensor] = []
        feat_parts: list[torch.Tensor] = []
        index: list[int] = []
        total = 0
        for slot, m in zip(slots, counts, strict=True):
            pairs = self.held[slot]
            assert len(pairs) >= m, "held pairs lost"
            for ids, feats, row in pairs[:m]:
                offset = sources.get(id(feats))
                if offset is None:
                    offset = sources[id(feats)] = total
                    ids_parts.append(ids)
                    feat_parts.append(feats)
                    total += feats.shape[0]
                index.append(offset + row)
            del pairs[:m]
        idx = tensor_to(index, torch.long, feat_parts[0].device)
        return torch.cat(ids_parts)[idx], torch.cat(feat_parts)[idx]


def catch_up_batch(
    lag: DraftLag,
    batch: ScheduleBatch,
    lags: list[int],
    req_to_token: torch.Tensor,
    kv_pool: TokenToKVPool,
    attn_backend: AttentionBackend,
) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor, list[int]]:
    """The head extend over every held pair of the requests with lags > 0, at positions
    [L - lag, L) (L = committed length). Returns (forward batch, its features, its last row per
    request, the batch rows it covers)."""
    rows = [i for i, m in enumerate(lags) if m > 0]
    counts = [lags[i] for i in rows]
    # Every index is known on the host: one copy brings them all (a repeat_interleave by
    # device counts would read their sum back, a sync in the middle of the iteration).
    owner = [i for i, c in zip(rows, counts) for _ in range(c)]  # batch row of each pair
    behind = [c - j for c in counts for j in range(c)]  # its position is L - behind
    last = list(itertools.accumulate(counts, initial=-1))[1:]  # each request's last pair
    packed = tensor_to([*rows, *counts, *last, *owner, *behind], torch.long,
                       batch.req_pool_indices.device)  # fmt: skip
    r, n = len(rows), len(owner)
    sel, m, last_rows = packed[:r], packed[r : 2 * r], packed[2 * r : 3 * r]
    owner_t, behind_t = packed[3 * r : 3 * r + n], packed[3 * r + n :]
    rpi, L = batch.req_pool_indices[sel], batch.seq_lens[sel]
    positions = batch.seq_lens[owner_t] - behind_t
    assert batch.seq_lens_cpu is not None
    max_len = int(batch.seq_lens_cpu[rows].max())
    ids, features = lag.take([batch.reqs[i].req_pool_idx for i in rows], counts)
    fb = ForwardBatch(
        mode="extend",
        input_ids=ids,
        positions=positions,
        out_cache_loc=req_to_token[batch.req_pool_indices[owner_t], positions],
        req_pool_indices=rpi,
        prefix_lens=L - m,
        extend_lens=m,
        host=HostLens(max(counts), max_len, min(counts) == max(counts)),
        kv_pool=kv_pool,
        attn_backend=attn_backend,
    )
    return fb, features, last_rows, rows

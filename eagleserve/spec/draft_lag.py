"""Head input held back while a request does not speculate (adaptive k = 0), and its catch-up.

The head's KV must cover every committed position before it drafts again. A k = 0 iteration
commits one token per request without running the head; instead its head input (the new token
and the target feature of the position before it) is held in a ring indexed by request slot.
When the request drafts again, one head extend over its held pairs (`catch_up_batch`) writes the
missing head KV and yields the seed of the next draft: exactly what the skipped extends would
have produced, at the cost of one extend instead of one per skipped token. A request whose ring
is full and still does not draft has its held pairs flushed: their head KV written (the K/V
projection only, `EagleHead.write_kv`), and the ring starts over; its next draft's catch-up then
covers the pairs held since.

How many pairs a request holds is host-side knowledge (the scheduler decided every k), so no
device value is read to build the catch-up.
"""

from __future__ import annotations

import torch

from eagleserve.core import ScheduleBatch
from eagleserve.model.attention import AttentionBackend
from eagleserve.model.forward_batch import ForwardBatch, HostLens
from eagleserve.model.kv_cache import TokenToKVPool


class DraftLag:
    def __init__(
        self,
        num_req_slots: int,
        max_lag: int,
        feature_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_lag = max_lag
        self.ids = torch.zeros(num_req_slots, max_lag, dtype=torch.long, device=device)
        self.features = torch.zeros(
            num_req_slots, max_lag, feature_size, dtype=dtype, device=device
        )

    def hold(
        self,
        req_pool_indices: torch.Tensor,
        lags: list[int],
        next_ids: torch.Tensor,
        features: torch.Tensor,
    ) -> None:
        """Stores request i's pair at ring index lags[i] (its count of pairs held so far)."""
        assert max(lags, default=0) < self.max_lag, "draft lag ring overflow"
        col = torch.tensor(lags, dtype=torch.long, device=self.ids.device)
        self.ids[req_pool_indices, col] = next_ids
        self.features[req_pool_indices, col] = features.to(self.features.dtype)


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
    dev = batch.req_pool_indices.device
    sel = torch.tensor(rows, dtype=torch.long, device=dev)
    m = torch.tensor(counts, dtype=torch.long, device=dev)
    rpi = batch.req_pool_indices[sel]
    L = batch.seq_lens[sel]
    j = torch.cat([torch.arange(c) for c in counts]).to(dev)  # ring index of each row
    rpi_rows = rpi.repeat_interleave(m)
    positions = (L - m).repeat_interleave(m) + j
    assert batch.seq_lens_cpu is not None
    max_len = int(batch.seq_lens_cpu[rows].max())
    fb = ForwardBatch(
        mode="extend",
        input_ids=lag.ids[rpi_rows, j],
        positions=positions,
        out_cache_loc=req_to_token[rpi_rows, positions],
        req_pool_indices=rpi,
        prefix_lens=L - m,
        extend_lens=m,
        host=HostLens(max(counts), max_len, min(counts) == max(counts)),
        kv_pool=kv_pool,
        attn_backend=attn_backend,
    )
    return fb, lag.features[rpi_rows, j], torch.cumsum(m, 0) - 1, rows

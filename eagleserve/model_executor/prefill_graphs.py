"""Device graphs for the prefill of one request of up to 256 new tokens.

Eagerly, a prefill launches each layer's kernels from Python; on an accelerator that host work,
not the device, is a short prompt's time to first token (for a small model as long as a dozen
decodes). A forward of one request with T new tokens after its cached prefix replays the graph
of the smallest bucket n >= T instead, its tokens padded after the prompt's:

- causal attention keeps the padding out of every prompt row, so those rows are computed as
  eagerly (up to the GEMMs' M-dependent rounding, as any graph; batch-invariant kernels where
  `--enable-deterministic-inference` asks for them);
- padding tokens write their K/V to the dummy slot 0 and take the last prompt position (a
  rotary row that exists); their queries read whatever slots the request's req_to_token row
  holds past its prompt (valid indices; those rows are dropped), so the row must be n wide past
  the prefix, or the prefill runs eagerly.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from eagleserve.layers.forward_batch import ForwardBatch, HostLens
from eagleserve.model_executor.cuda_graph_runner import GraphedForward, GraphFn

if TYPE_CHECKING:
    from eagleserve.layers.attention import AttentionBackend
    from eagleserve.mem_cache.kv_cache import TokenToKVPool

PREFILL_BUCKETS = (16, 32, 64, 128, 256)


class PrefillGraphs:
    """One GraphedForward (batch 1, n tokens) per bucket that fits a req_to_token row."""

    def __init__(
        self,
        fn: GraphFn,
        kv_pool: TokenToKVPool,
        attn_backend: AttentionBackend,
        device: torch.device,
    ) -> None:
        self.row_width = int(attn_backend.req_to_token.shape[1])
        self.graphs = {
            n: GraphedForward(fn, "extend", kv_pool, attn_backend, device, 1, n)
            for n in PREFILL_BUCKETS
            if n <= self.row_width
        }

    def capture(self) -> None:
        for graph in self.graphs.values():
            graph.capture()

    def bucket(self, fb: ForwardBatch) -> int | None:
        """The bucket whose graph computes `fb`, a prefill as ForwardBatch.init_new builds it
        (logits of the last token), or None: it runs eagerly (a batch of several requests, a
        tree, an explicit KV range, other logits rows, more tokens than the largest bucket, a
        row too short for the padding). Host ints and shapes only."""
        if fb.mode != "extend" or fb.batch_size != 1:
            return None
        if fb.tree_mask is not None or fb.kv_lens is not None:
            return None
        if fb.logits_indices is None or fb.logits_indices.numel() != 1:
            return None
        new = fb.host.max_extend
        prefix = fb.host.max_kv - new
        for n in self.graphs:
            if n >= new:
                return n if prefix + n <= self.row_width else None
        return None

    def replay(self, fb: ForwardBatch, n: int) -> tuple[torch.Tensor, ...]:
        """The captured outputs of bucket `n` for `fb` (rows past its tokens are padding).
        Views of static buffers, valid until this bucket's next replay."""
        new = fb.host.max_extend
        pad = n - new
        padded = dataclasses.replace(
            fb,
            input_ids=F.pad(fb.input_ids, (0, pad)),
            positions=torch.cat((fb.positions, fb.positions[-1:].expand(pad))),
            out_cache_loc=F.pad(fb.out_cache_loc, (0, pad)),
            host=HostLens(n, fb.host.max_kv + pad, True),
            logits_indices=None,
            attn_metadata=None,
        )
        return self.graphs[n].replay(padded)

"""Device graphs (CUDA/HIP) for fixed-shape forwards: capture per batch-size bucket, replay padded.

One `GraphedForward` serves one kind of forward where every request has the same number of new
tokens `n`: target decode (n = 1), chain drafting (n = 1, the head), verify (n =
num_draft_tokens). Inputs are copied into static buffers; padded rows use request slot 0, KV slot
0 (never handed out) and an empty prefix, so they read valid memory and write only the dummy slot.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from eagleserve.core import ForwardMode
from eagleserve.device import device_module
from eagleserve.layers.forward_batch import ForwardBatch, HostLens, forward_context

if TYPE_CHECKING:
    from eagleserve.layers.attention import AttentionBackend
    from eagleserve.mem_cache.kv_cache import TokenToKVPool

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)

# fn(fb, extras) -> output tensors, run inside forward_context(fb); rows follow the tokens.
GraphFn = Callable[[ForwardBatch, dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]
# More outputs of a target graph, from its static batch, its extras and the forward's logits.
GraphEpilogue = Callable[
    [ForwardBatch, dict[str, torch.Tensor], torch.Tensor], tuple[torch.Tensor, ...]
]
# The extras a graph's epilogue reads: name -> (per-token shape, dtype).
ExtraShapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


def bucket_for(buckets: list[int], bs: int) -> int:
    """The smallest captured batch size that holds `bs` rows (buckets ascending)."""
    if not 0 < bs <= buckets[-1]:
        raise ValueError(f"batch size {bs} outside 1..{buckets[-1]}")
    return buckets[bisect.bisect_left(buckets, bs)]


@contextlib.contextmanager
def no_collection_while_capturing() -> Iterator[None]:
    """Garbage is collected once before the captures and never during one. An engine dropped
    earlier in the process (a bench, a notebook) is reference cycles holding its graphs: a
    collection inside a capture would destroy them there, which a capturing stream does not
    permit, and the capture fails (cudaErrorStreamCaptureInvalidated)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def graphs_supported(device: torch.device, disable: bool, attn_backend: object) -> bool:
    """Graphs need an accelerator and a backend whose metadata can be built without a sync."""
    return (
        device.type != "cpu"
        and not disable
        and hasattr(attn_backend, "init_forward_metadata_static")
    )


@dataclasses.dataclass(frozen=True)
class StagedViews:
    """Views of a GraphedForward's static buffers for one batch size."""

    bucket: int
    inputs: tuple[torch.Tensor, ...]  # input_ids, positions, out_cache_loc, slots, prefixes
    padding: tuple[torch.Tensor, ...]  # the bucket's rows past the batch
    extras: dict[str, torch.Tensor]
    outputs: tuple[torch.Tensor, ...]  # the captured outputs' rows of the batch


class GraphedForward:
    def __init__(
        self,
        fn: GraphFn,
        mode: ForwardMode,
        kv_pool: TokenToKVPool,
        attn_backend: AttentionBackend,
        device: torch.device,
        max_bs: int,
        tokens_per_req: int,
        tree: bool = False,
        extra_shapes: ExtraShapes | None = None,
        own_context: bool = True,
    ) -> None:
        self.fn, self.mode, self.device = fn, mode, device
        # False: `fn` runs several forwards and opens each one's context itself (contexts do
        # not nest), so capture must not open one around it.
        self.own_context = own_context
        self.kv_pool, self.attn_backend = kv_pool, attn_backend
        self.n = n = tokens_per_req
        self.buckets = [b for b in BUCKETS if b < max_bs] + [max_bs]
        self.max_bs = max_bs
        t = max_bs * n
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.out_cache_loc = zeros(t), zeros(t), zeros(t)
        self.req_pool_indices, self.prefix_lens = zeros(max_bs), zeros(max_bs)
        self.kv_lens = torch.full((max_bs,), n, dtype=torch.long, device=device)
        self.extend_lens = torch.full((max_bs,), n, dtype=torch.long, device=device)
        # Padded rows keep a lower-triangular mask: every query sees at least itself.
        self.tree_mask = (
            torch.ones(n, n, dtype=torch.bool, device=device).tril().repeat(max_bs, 1, 1)
            if tree
            else None
        )
        self.extras = {
            k: torch.zeros((t, *shape), dtype=dtype, device=device)
            for k, (shape, dtype) in (extra_shapes or {}).items()
        }
        self.graphs: dict[int, object] = {}
        self.views: dict[int, StagedViews] = {}
        # The captured kernels read metadata and scratch owned by these: keep them alive.
        self.batches: dict[int, ForwardBatch] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}

    def _fb(self, bs: int) -> ForwardBatch:
        t = bs * self.n
        fb = ForwardBatch(
            mode=self.mode,
            input_ids=self.input_ids[:t],
            positions=self.positions[:t],
            out_cache_loc=self.out_cache_loc[:t],
            req_pool_indices=self.req_pool_indices[:bs],
            prefix_lens=self.prefix_lens[:bs],
            extend_lens=self.extend_lens[:bs],
            # The longest row a request can have: the graph serves every length.
            host=HostLens(self.n, self.attn_backend.req_to_token.shape[1], True),
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            tree_mask=None if self.tree_mask is None else self.tree_mask[:bs],
            kv_lens=self.kv_lens[:bs],
        )
        self.attn_backend.init_forward_metadata_static(fb)
        return fb

    @torch.inference_mode()
    def capture(self) -> None:
        mod = device_module(self.device)
        pool = mod.graph_pool_handle()
        with no_collection_while_capturing():
            for bs in reversed(self.buckets):  # largest first, so smaller ones reuse its memory
                fb, extras = self.bucket_batch(bs)
                side = mod.Stream()
                side.wait_stream(mod.current_stream())
                with mod.stream(side):
                    for _ in range(2):  # warm-up: Triton compiles and autotunes outside capture
                        self.run_fn(fb, extras)
                mod.current_stream().wait_stream(side)
                graph = mod.CUDAGraph()
                with mod.graph(graph, pool=pool):
                    out = self.run_fn(fb, extras)
                self.graphs[bs], self.outputs[bs], self.batches[bs] = graph, out, fb

    def run_fn(self, fb: ForwardBatch, extras: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """`fn` on a bucket's static batch, as warm-up and capture run it. The KV lengths the
        static metadata reads are computed first, inside the graph: one launch fewer per
        replay."""
        if fb.kv_lens is not None:
            torch.add(fb.prefix_lens, self.n, out=fb.kv_lens)
        with forward_context(fb) if self.own_context else contextlib.nullcontext():
            return self.fn(fb, extras)

    def bucket_batch(self, bs: int) -> tuple[ForwardBatch, dict[str, torch.Tensor]]:
        """The static batch and extras that bucket `bs` is captured with."""
        return self._fb(bs), {k: v[: bs * self.n] for k, v in self.extras.items()}

    def replay(self, fb: ForwardBatch, **extras: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Runs `fb` (bs * n tokens, n each) padded to its bucket. Outputs are views of static
        buffers, valid until the next replay of this object."""
        pb = self.stage(fb, **extras)
        self.graphs[pb].replay()
        return self._views(fb.batch_size).outputs

    def stage(self, fb: ForwardBatch, **extras: torch.Tensor) -> int:
        """Copies `fb`'s inputs into the static buffers, the rows up to its bucket padded (slot
        0, an empty prefix); returns the bucket. Device work only: no host read."""
        v = self._views(fb.batch_size)
        sources = (fb.input_ids, fb.positions, fb.out_cache_loc, fb.req_pool_indices,
                   fb.prefix_lens)  # fmt: skip
        # One multi-tensor launch on a GPU for the five int64 inputs (per-tensor copies where
        # a source's layout rules that out).
        torch._foreach_copy_(v.inputs, sources)
        # Padding rows (a batch smaller than its bucket) are reset to slot 0 every time: rows a
        # larger batch left there hold live requests' slots, which they would overwrite.
        if v.padding:
            torch._foreach_zero_(v.padding)
        if self.tree_mask is not None and fb.tree_mask is not None:
            self.tree_mask[: fb.batch_size].copy_(fb.tree_mask)
        for k, src in extras.items():
            v.extras[k].copy_(src)
        return v.bucket

    def _views(self, bs: int) -> StagedViews:
        """The static buffers' views a batch of `bs` stages into and reads back, made once per
        size: slicing is host work a replay need not repeat."""
        v = self.views.get(bs)
        if v is None:
            pb = bucket_for(self.buckets, bs)
            t, pt = bs * self.n, pb * self.n
            per_token = (self.input_ids, self.positions, self.out_cache_loc)
            per_req = (self.req_pool_indices, self.prefix_lens)
            padding = [b[t:pt] for b in per_token] + [b[bs:pb] for b in per_req] if pb > bs else []
            v = StagedViews(
                bucket=pb,
                inputs=tuple(b[:t] for b in per_token) + tuple(b[:bs] for b in per_req),
                padding=tuple(padding),
                extras={k: b[:t] for k, b in self.extras.items()},
                # Per-token outputs have bucket * n rows, per-request ones (an epilogue's
                # accept lengths) bucket rows.
                outputs=tuple(o[: t if o.shape[0] == pt else bs] for o in self.outputs[pb])
                if pb in self.outputs
                else (),
            )
            if v.outputs or not self.outputs:  # outputs exist once the bucket is captured
                self.views[bs] = v
        return v

    def can_replay(self, fb: ForwardBatch) -> bool:
        """A forward this graph computes: its mode, n new tokens per request, a causal or tree
        attention over prefix + n (no longer KV range), all logits rows."""
        return (
            fb.mode == self.mode
            and fb.host.uniform
            and fb.host.max_extend == self.n
            and fb.kv_lens is None
            and fb.logits_indices is None
            and (fb.tree_mask is not None) == (self.tree_mask is not None)
            and 0 < fb.batch_size <= self.max_bs
        )

"""Device graphs (CUDA/HIP) for fixed-shape forwards: capture per batch-size bucket, replay padded.

One `GraphedForward` serves one kind of forward where every request has the same number of new
tokens `n`: target decode (n = 1), chain drafting (n = 1, the head), verify (n =
num_draft_tokens). Inputs are copied into static buffers; padded rows use request slot 0, KV slot
0 (never handed out) and an empty prefix, so they read valid memory and write only the dummy slot.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from eagleserve.device import device_module
from eagleserve.model.forward_batch import ForwardBatch, forward_context

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)

# fn(fb, extras) -> output tensors, run inside forward_context(fb); rows follow the tokens.
GraphFn = Callable[[ForwardBatch, dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]


def graphs_supported(device: torch.device, disable: bool, attn_backend: object) -> bool:
    """Graphs need an accelerator and a backend whose metadata can be built without a sync."""
    return (
        device.type != "cpu"
        and not disable
        and hasattr(attn_backend, "init_forward_metadata_static")
    )


class GraphedForward:
    def __init__(
        self,
        fn: GraphFn,
        make_fb: Callable[..., ForwardBatch],
        device: torch.device,
        max_bs: int,
        tokens_per_req: int,
        tree: bool = False,
        extra_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
    ) -> None:
        self.fn, self.make_fb, self.device = fn, make_fb, device
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
        # The captured kernels read metadata and scratch owned by these: keep them alive.
        self.batches: dict[int, ForwardBatch] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}

    def _fb(self, bs: int) -> ForwardBatch:
        t = bs * self.n
        fb = self.make_fb(
            input_ids=self.input_ids[:t],
            positions=self.positions[:t],
            out_cache_loc=self.out_cache_loc[:t],
            req_pool_indices=self.req_pool_indices[:bs],
            prefix_lens=self.prefix_lens[:bs],
            extend_lens=self.extend_lens[:bs],
            tree_mask=None if self.tree_mask is None else self.tree_mask[:bs],
            kv_lens=self.kv_lens[:bs],
        )
        fb.attn_backend.init_forward_metadata_static(fb)
        return fb

    @torch.inference_mode()
    def capture(self) -> None:
        mod = device_module(self.device)
        pool = mod.graph_pool_handle()
        for bs in reversed(self.buckets):  # largest first, so smaller ones reuse its memory
            fb = self._fb(bs)
            extras = {k: v[: bs * self.n] for k, v in self.extras.items()}
            side = mod.Stream()
            side.wait_stream(mod.current_stream())
            with mod.stream(side):
                for _ in range(2):  # warm-up: Triton compiles and autotunes outside capture
                    with forward_context(fb):
                        self.fn(fb, extras)
            mod.current_stream().wait_stream(side)
            graph = mod.CUDAGraph()
            with mod.graph(graph, pool=pool):
                with forward_context(fb):
                    out = self.fn(fb, extras)
            self.graphs[bs], self.outputs[bs], self.batches[bs] = graph, out, fb

    def can_run(self, bs: int) -> bool:
        return 0 < bs <= self.max_bs

    def replay(
        self,
        input_ids: torch.Tensor,  # [bs * n]
        positions: torch.Tensor,
        out_cache_loc: torch.Tensor,
        req_pool_indices: torch.Tensor,  # [bs]
        prefix_lens: torch.Tensor,
        tree_mask: torch.Tensor | None = None,  # [bs, n, n]
        **extras: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """Outputs are views of static buffers, valid until the next replay of this object."""
        bs = req_pool_indices.shape[0]
        pb = self.buckets[bisect.bisect_left(self.buckets, bs)]
        t, pt = bs * self.n, pb * self.n
        for buf, src in (
            (self.input_ids, input_ids),
            (self.positions, positions),
            (self.out_cache_loc, out_cache_loc),
        ):
            buf[:t].copy_(src)
            buf[t:pt].zero_()
        self.req_pool_indices[:bs].copy_(req_pool_indices)
        self.req_pool_indices[bs:pb].zero_()
        self.prefix_lens[:bs].copy_(prefix_lens)
        self.prefix_lens[bs:pb].zero_()
        torch.add(self.prefix_lens[:pb], self.n, out=self.kv_lens[:pb])
        if self.tree_mask is not None and tree_mask is not None:
            self.tree_mask[:bs].copy_(tree_mask)
        for k, v in extras.items():
            self.extras[k][:t].copy_(v)
        self.graphs[pb].replay()
        return tuple(o[:t] for o in self.outputs[pb])

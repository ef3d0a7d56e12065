"""The whole k-step draft as one device graph per k (SGLang's EAGLEDraftCudaGraphRunner): a chain
(topk == 1, preallocated buffers) or a top-k tree. Each step's ForwardBatch and attention
metadata come from device tensors (static metadata where the backend has it), so nothing in the
loop reads the host; eager, the same draft launches every step's ops from the host.

Inputs (a GraphedForward of one token per request): the seed as extras (topk_p, topk_index
[bs, topk], hidden [bs, h]), for a chain's drawn modes the requests' sampling parameters
(draft_extend.py `draw_extras`), the requests' slots and committed lengths L (prefix_lens) and
their bound (host.max_kv), and for a tree the bonus tokens (input_ids). Outputs: a chain's
DraftTree tensors; a tree's verify tree (TreeInfo's tensors).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from eagleserve.core import EagleDraftInput
from eagleserve.layers.attention import AttentionBackend
from eagleserve.layers.forward_batch import ForwardBatch, HostLens, forward_context
from eagleserve.mem_cache.kv_cache import TokenToKVPool
from eagleserve.model_executor.cuda_graph_runner import GraphedForward
from eagleserve.sampling.sampling_info import DrawKernel
from eagleserve.spec.draft_extend import (
    DrawMode,
    GraphDraftDraw,
    draw_extras,
    graph_draw,
    seed_from_logits,
)
from eagleserve.spec.draft_tree import draft_chain, draft_tree
from eagleserve.spec.eagle_head import EagleHead
from eagleserve.spec.tree import Topk1ChainBuffers, build_tree

LoopOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # parents, score index, tokens
# A tree loop's outputs: the verify tree it built (TreeInfo's draft_tokens, parents, depths,
# tree_mask), so building it launches nothing from the host either.
TreeOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftRows:
    """The rows of every draft step over the requests of a batch, made before the steps (a few
    launches, not a few a step). Step `depth` (1-based) is row depth - 1 of each tensor: its
    branches' positions L + depth - 1 and KV slots [bs * topk] (branch b of a top-k tree at
    region node (depth - 1) * topk + b; a chain's node at its position), and the requests' KV
    lengths after it [bs] (L + depth * topk)."""

    positions: torch.Tensor  # [steps, bs * topk]
    out_cache_loc: torch.Tensor  # [steps, bs * topk]
    kv_lens: torch.Tensor  # [steps, bs]
    extend_lens: torch.Tensor  # [bs]: topk, the rows of a step per request


@dataclass(frozen=True)
class RowOffsets:
    """Constants of `draft_rows` for up to `steps` steps of `topk` branches, made once."""

    depth: torch.Tensor  # [steps, 1, topk]: d at step d + 1
    slot: torch.Tensor  # [steps, 1, topk]: d * topk + b
    kv: torch.Tensor  # [steps, 1]: (d + 1) * topk

    @staticmethod
    def build(steps: int, topk: int, device: torch.device) -> RowOffsets:
        d = torch.arange(steps, device=device)[:, None, None]
        b = torch.arange(topk, device=device)[None, None, :]
        depth = d.expand(-1, 1, topk).contiguous()
        return RowOffsets(depth, d * topk + b, (d[:, :, 0] + 1) * topk)


def draft_rows(
    fb: ForwardBatch, req_to_token: torch.Tensor, offsets: RowOffsets, steps: int
) -> DraftRows:
    """`DraftRows` of `steps` draft steps over the requests of `fb` (committed lengths L as
    prefix_lens, their slots)."""
    L, rpi = fb.prefix_lens[None, :, None], fb.req_pool_indices[None, :, None]
    positions = L + offsets.depth[:steps]  # [steps, bs, topk]
    topk = positions.shape[2]
    slots = positions if topk == 1 else L + offsets.slot[:steps]
    loc = req_to_token[rpi, slots]
    kv_lens = fb.prefix_lens[None, :] + offsets.kv[:steps]
    per_req = fb.extend_lens if topk == 1 else torch.full_like(fb.prefix_lens, topk)
    rows = positions.shape[1] * topk  # explicit: a draft of one step has no rows at all
    return DraftRows(positions.view(steps, rows), loc.view(steps, rows), kv_lens, per_req)


def chain_step_batch(
    fb: ForwardBatch, rows: DraftRows, input_ids: torch.Tensor, depth: int, static: bool,
    max_context: int,
) -> ForwardBatch:  # fmt: skip
    """Draft depth `depth` (1-based) of a chain over the requests of `fb` (as `tree_step_batch`),
    its row of `rows`: a 1-token decode after L + depth - 1 positions. `static`: the KV lengths
    as a tensor, for metadata a graph can hold (the backend's static metadata); `max_context`
    bounds the KV lengths (req_to_token's width)."""
    positions = rows.positions[depth - 1]
    return ForwardBatch(
        mode="draft",
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=rows.out_cache_loc[depth - 1],
        req_pool_indices=fb.req_pool_indices,
        prefix_lens=positions,
        extend_lens=fb.extend_lens,
        host=HostLens(1, min(fb.host.max_kv + depth, max_context), True),
        kv_pool=fb.kv_pool,
        attn_backend=fb.attn_backend,
        kv_lens=rows.kv_lens[depth - 1] if static else None,
    )


def tree_step_batch(
    fb: ForwardBatch,
    rows: DraftRows,
    input_ids: torch.Tensor,
    depth: int,
    topk: int,
    region_mask: torch.Tensor | None,
    max_context: int,
) -> ForwardBatch:
    """Draft depth `depth` (1-based) of a top-k tree, `input_ids` [bs * topk] its branches'
    tokens, over the requests of `fb` (slots, committed lengths L as prefix_lens and their
    bound host.max_kv, the head's KV and backend), its row of `rows`: branch b writes head KV at
    region node (depth - 1) * topk + b, position L + depth - 1, and sees the prefix and the
    region nodes `region_mask` [bs, topk, depth * topk] allows."""
    return ForwardBatch(
        mode="draft",
        input_ids=input_ids,
        positions=rows.positions[depth - 1],
        out_cache_loc=rows.out_cache_loc[depth - 1],
        req_pool_indices=fb.req_pool_indices,
        prefix_lens=fb.prefix_lens,
        extend_lens=rows.extend_lens,
        host=HostLens(topk, min(fb.host.max_kv + depth * topk, max_context), True),
        kv_pool=fb.kv_pool,
        attn_backend=fb.attn_backend,
        tree_mask=region_mask,
        kv_lens=rows.kv_lens[depth - 1],
    )


class DraftLoops:
    """The chain or tree draft of k steps with nothing read from the host, and its graphs."""

    def __init__(
        self,
        head: EagleHead,
        kv_pool: TokenToKVPool,
        attn_backend: AttentionBackend,
        req_to_token: torch.Tensor,
        topk: int,
        num_draft_tokens: int,
        chain_buffers: dict[int, Topk1ChainBuffers],
        num_steps: int,
        draw_kernel: DrawKernel | None = None,
    ) -> None:
        self.head, self.kv_pool, self.attn_backend = head, kv_pool, attn_backend
        self.draw_kernel = draw_kernel
        self.req_to_token = req_to_token
        self.topk, self.num_draft_tokens = topk, num_draft_tokens
        self.chain_buffers = chain_buffers
        self.static = hasattr(attn_backend, "init_forward_metadata_static")
        # `rows`' constants for the longest draft, made here: every graph captures these.
        self.offsets = RowOffsets.build(max(num_steps - 1, 1), topk, req_to_token.device)

    def rows(self, fb: ForwardBatch, steps: int) -> DraftRows:
        """`draft_rows` of `steps` (< num_steps) draft steps over the requests of `fb`."""
        return draft_rows(fb, self.req_to_token, self.offsets, steps)

    def graph(
        self,
        k: int,
        max_bs: int,
        dtype: torch.dtype,
        device: torch.device,
        mode: DrawMode = "argmax",
    ) -> GraphedForward:
        """A graph of the k-step draft (uncaptured); a chain's drafted in `mode`."""
        h, topk = self.head.hidden_size, self.topk
        extras = {"topk_p": ((topk,), dtype), "topk_index": ((topk,), torch.long),
                  "hidden": ((h,), dtype)} | draw_extras(mode)  # fmt: skip
        run: Callable[..., tuple[torch.Tensor, ...]] = self.chain if topk == 1 else self.tree
        return GraphedForward(
            lambda fb, ex: run(fb, ex, k, mode), "draft", self.kv_pool, self.attn_backend, device,
            max_bs, 1, extra_shapes=extras,
            own_context=False,  # each of the k steps opens its own forward context
        )  # fmt: skip

    def capture_graphs(
        self,
        lengths: list[int],
        modes: tuple[DrawMode, ...],
        max_bs: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[dict[tuple[int, DrawMode], GraphedForward], tuple[DrawMode, ...]]:
        """The captured graphs of these draft lengths per draw mode (the argmax first), and
        the modes that have theirs. A drawn mode whose capture fails is dropped (its batches
        then draft in the argmax graphs); the argmax ones failing, none (every draft runs step
        by step)."""
        t0 = time.perf_counter()
        graphs: dict[tuple[int, DrawMode], GraphedForward] = {}
        kept = modes
        for mode in modes:
            try:
                for k in lengths:
                    graph = self.graph(k, max_bs, dtype, device, mode)
                    graph.capture()
                    graphs[k, mode] = graph
            except Exception:  # the eager steps still serve; tests/spec/test_gpu_paths.py
                if mode == "argmax":
                    logger.exception("capturing the draft loop failed: drafting step by step")
                    return {}, modes
                logger.exception("capturing the %s draft loop failed: its batches draft the "
                                 "argmax", mode)  # fmt: skip
                graphs = {key: g for key, g in graphs.items() if key[1] != mode}
                kept = tuple(m for m in kept if m != mode)
        logger.info("start-up: %d draft loop graphs (draws: %s) captured in %.2f s",
                    len(graphs), ", ".join(kept), time.perf_counter() - t0)  # fmt: skip
        return graphs, kept

    def _seed(
        self,
        sfb: ForwardBatch,
        ids: torch.Tensor,
        feats: torch.Tensor,
        draw: Callable[[torch.Tensor], GraphDraftDraw | None] = lambda _: None,
    ) -> LoopOutputs:
        """One head step over `sfb` (its metadata built here) and its top-k, or the chain's
        draw at the positions of its drafts (`draw`, from the step's positions)."""
        if self.static:
            self.attn_backend.init_forward_metadata_static(sfb)  # type: ignore[attr-defined]
        with forward_context(sfb):
            logits, next_feats = self.head(ids, feats, sfb.positions)
        seed = seed_from_logits(self.head, logits, next_feats, self.topk, draw(sfb.positions))
        return seed.topk_p, seed.topk_index, seed.hidden_states

    def chain(
        self, fb: ForwardBatch, extras: dict[str, torch.Tensor], k: int, mode: DrawMode = "argmax"
    ) -> LoopOutputs:
        """The k-step chain draft (`draft_chain`), drafted in `mode`. A graph passes the
        longest row as the bound of the committed lengths (its static metadata covers every
        length)."""

        rows = self.rows(fb, k - 1)
        width, bs = self.req_to_token.shape[1], fb.batch_size

        def draw(positions: torch.Tensor) -> GraphDraftDraw | None:
            # A step's row at position p holds the draft at p + 1 and proposes the one at p + 2.
            return graph_draw(mode, extras, bs, 1, positions + 2, self.draw_kernel)

        def step(ids: torch.Tensor, feats: torch.Tensor, depth: int, *_: object) -> LoopOutputs:
            sfb = chain_step_batch(fb, rows, ids, depth, self.static, width)
            return self._seed(sfb, ids, feats, draw)

        info = EagleDraftInput(extras["topk_p"], extras["topk_index"], extras["hidden"])
        tree = draft_chain(info, k, step, self.chain_buffers[k])
        return tree.parent_list, tree.top_scores_index, tree.draft_tokens

    def tree(
        self, fb: ForwardBatch, extras: dict[str, torch.Tensor], k: int, mode: DrawMode = "argmax"
    ) -> TreeOutputs:
        """The k-step top-k tree draft (`draft_tree`) and the verify tree built from it, rooted
        at the bonus tokens `fb.input_ids`. A tree drafts its top-k (`mode` the argmax)."""
        assert mode == "argmax", "a tree's branches are its top-k: nothing is drawn"

        rows, width = self.rows(fb, k - 1), self.req_to_token.shape[1]

        def step(
            ids: torch.Tensor, feats: torch.Tensor, depth: int, mask: torch.Tensor | None,
            *_: object,
        ) -> LoopOutputs:  # fmt: skip
            sfb = tree_step_batch(fb, rows, ids, depth, self.topk, mask, width)
            return self._seed(sfb, ids, feats)

        info = EagleDraftInput(extras["topk_p"], extras["topk_index"], extras["hidden"])
        d = draft_tree(info, k, self.topk, self.num_draft_tokens, step)
        t = build_tree(fb.input_ids, d.parent_list, d.top_scores_index, d.draft_tokens, self.topk,
                       self.num_draft_tokens, kernel=self.head.fused_kernels)  # fmt: skip
        return t.draft_tokens, t.parents, t.depths, t.tree_mask

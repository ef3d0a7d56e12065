"""The whole k-step draft as one device graph per k (SGLang's EAGLEDraftCudaGraphRunner): a chain
(topk == 1, preallocated buffers) or a top-k tree. Each step's ForwardBatch and attention
metadata come from device tensors (static metadata where the backend has it), so nothing in the
loop reads the host; eager, the same draft launches every step's ops from the host.

Inputs (a GraphedForward of one token per request): the seed as extras (topk_p, topk_index
[bs, topk], hidden [bs, h]), the requests' slots and committed lengths L (prefix_lens) and their
bound (host.max_kv), and for a tree the bonus tokens (input_ids). Outputs: a chain's DraftTree
tensors; a tree's verify tree (TreeInfo's tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from eagleserve.core import EagleDraftInput
from eagleserve.layers.attention import AttentionBackend
from eagleserve.layers.forward_batch import ForwardBatch, HostLens, forward_context
from eagleserve.mem_cache.kv_cache import TokenToKVPool
from eagleserve.model_executor.cuda_graph_runner import GraphedForward
from eagleserve.spec.draft_extend import seed_from_logits
from eagleserve.spec.draft_tree import draft_chain, draft_tree
from eagleserve.spec.eagle_head import EagleHead
from eagleserve.spec.tree import Topk1ChainBuffers, build_tree

LoopOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # parents, score index, tokens
# A tree loop's outputs: the verify tree it built (TreeInfo's draft_tokens, parents, depths,
# tree_mask), so building it launches nothing from the host either.
TreeOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ChainRows:
    """The rows of every draft step of a chain over the requests of a batch, made before the
    steps (three launches, not three a step): row depth - 1 of each [steps, bs] tensor is the
    draft at `depth` (1-based), a 1-token decode at position L + depth - 1."""

    positions: torch.Tensor
    out_cache_loc: torch.Tensor  # the KV slot at each position
    kv_lens: torch.Tensor  # positions + 1


def chain_rows(
    fb: ForwardBatch, req_to_token: torch.Tensor, offsets: torch.Tensor, steps: int
) -> ChainRows:
    """`ChainRows` of `steps` draft steps over the requests of `fb` (committed lengths L as
    prefix_lens); `offsets` [>= steps] is 0, 1, 2, ... (a constant: no launch of its own)."""
    positions = fb.prefix_lens[None, :] + offsets[:steps, None]
    loc = req_to_token[fb.req_pool_indices[None, :], positions]
    return ChainRows(positions, loc, positions + 1)


def chain_step_batch(
    fb: ForwardBatch, rows: ChainRows, input_ids: torch.Tensor, depth: int, static: bool,
    max_context: int,
) -> ForwardBatch:  # fmt: skip
    """Draft depth `depth` (1-based) of a chain over the requests of `fb` (as `tree_step_batch`),
    its row of `rows`. `static`: the KV lengths as a tensor, for metadata a graph can hold (the
    backend's static metadata); `max_context` bounds the KV lengths (req_to_token's width)."""
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
    req_to_token: torch.Tensor,
    input_ids: torch.Tensor,
    depth: int,
    topk: int,
    region_mask: torch.Tensor | None,
) -> ForwardBatch:
    """Draft depth `depth` (1-based) of a top-k tree, `input_ids` [bs * topk] its branches'
    tokens, over the requests of `fb` (slots, committed lengths L as prefix_lens and their
    bound host.max_kv, the head's KV and backend): branch b writes head KV at region node
    (depth - 1) * topk + b, position L + depth - 1, and sees the prefix and the region nodes
    `region_mask` [bs, topk, depth * topk] allows."""
    L, rpi = fb.prefix_lens, fb.req_pool_indices
    region_idx = (depth - 1) * topk + torch.arange(topk, device=L.device)  # [topk]
    loc = req_to_token[rpi[:, None], L[:, None] + region_idx[None, :]].reshape(-1)
    return ForwardBatch(
        mode="draft",
        input_ids=input_ids,
        positions=(L + depth - 1).repeat_interleave(topk),
        out_cache_loc=loc,
        req_pool_indices=rpi,
        prefix_lens=L,
        extend_lens=torch.full_like(L, topk),
        host=HostLens(topk, min(fb.host.max_kv + depth * topk, req_to_token.shape[1]), True),
        kv_pool=fb.kv_pool,
        attn_backend=fb.attn_backend,
        tree_mask=region_mask,
        kv_lens=L + depth * topk,
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
    ) -> None:
        self.head, self.kv_pool, self.attn_backend = head, kv_pool, attn_backend
        self.req_to_token = req_to_token
        self.topk, self.num_draft_tokens = topk, num_draft_tokens
        self.chain_buffers = chain_buffers
        self.static = hasattr(attn_backend, "init_forward_metadata_static")
        # 0, 1, 2, ...: a chain's step offsets (`chain_rows`), made before any capture.
        self.offsets = torch.arange(max(chain_buffers, default=1), device=req_to_token.device)

    def chain_rows(self, fb: ForwardBatch, steps: int) -> ChainRows:
        return chain_rows(fb, self.req_to_token, self.offsets, steps)

    def graph(
        self, k: int, max_bs: int, dtype: torch.dtype, device: torch.device
    ) -> GraphedForward:
        """A graph of the k-step draft (uncaptured)."""
        h, topk = self.head.hidden_size, self.topk
        extras = {"topk_p": ((topk,), dtype), "topk_index": ((topk,), torch.long),
                  "hidden": ((h,), dtype)}  # fmt: skip
        run: Callable[..., tuple[torch.Tensor, ...]] = self.chain if topk == 1 else self.tree
        return GraphedForward(
            lambda fb, ex: run(fb, ex, k), "draft", self.kv_pool, self.attn_backend, device,
            max_bs, 1, extra_shapes=extras,
            own_context=False,  # each of the k steps opens its own forward context
        )  # fmt: skip

    def _seed(self, sfb: ForwardBatch, ids: torch.Tensor, feats: torch.Tensor) -> LoopOutputs:
        """One head step over `sfb` (its metadata built here) and its top-k."""
        if self.static:
            self.attn_backend.init_forward_metadata_static(sfb)  # type: ignore[attr-defined]
        with forward_context(sfb):
            logits, next_feats = self.head(ids, feats, sfb.positions)
        seed = seed_from_logits(self.head, logits, next_feats, self.topk)
        return seed.topk_p, seed.topk_index, seed.hidden_states

    def chain(self, fb: ForwardBatch, extras: dict[str, torch.Tensor], k: int) -> LoopOutputs:
        """The k-step chain draft (`draft_chain`). A graph passes the longest row as the
        bound of the committed lengths (its static metadata covers every length)."""

        rows = self.chain_rows(fb, k - 1)
        width = self.req_to_token.shape[1]

        def step(ids: torch.Tensor, feats: torch.Tensor, depth: int, *_: object) -> LoopOutputs:
            sfb = chain_step_batch(fb, rows, ids, depth, self.static, width)
            return self._seed(sfb, ids, feats)

        info = EagleDraftInput(extras["topk_p"], extras["topk_index"], extras["hidden"])
        tree = draft_chain(info, k, step, self.chain_buffers[k])
        return tree.parent_list, tree.top_scores_index, tree.draft_tokens

    def tree(self, fb: ForwardBatch, extras: dict[str, torch.Tensor], k: int) -> TreeOutputs:
        """The k-step top-k tree draft (`draft_tree`) and the verify tree built from it, rooted
        at the bonus tokens `fb.input_ids`."""

        def step(
            ids: torch.Tensor, feats: torch.Tensor, depth: int, mask: torch.Tensor | None,
            *_: object,
        ) -> LoopOutputs:  # fmt: skip
            sfb = tree_step_batch(fb, self.req_to_token, ids, depth, self.topk, mask)
            return self._seed(sfb, ids, feats)

        info = EagleDraftInput(extras["topk_p"], extras["topk_index"], extras["hidden"])
        d = draft_tree(info, k, self.topk, self.num_draft_tokens, step)
        t = build_tree(fb.input_ids, d.parent_list, d.top_scores_index, d.draft_tokens, self.topk,
                       self.num_draft_tokens)  # fmt: skip
        return t.draft_tokens, t.parents, t.depths, t.tree_mask

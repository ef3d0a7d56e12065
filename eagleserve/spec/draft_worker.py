"""The EAGLE draft worker: the head, its KV, and its two kinds of forward.

- `extend`: a head forward over committed tokens (after a prefill, and after each verify over
  the accepted path); its last row per request seeds the next iteration's draft.
- `draft`: num_steps head forwards along a chain (topk == 1, preallocated buffers) or a top-k
  tree, from the seed the last extend left; all steps in one device graph where one is
  captured (spec/draft_loop.py).

The head's KV uses the target's slot numbers (one allocator, two sets of buffers), so the slots
the scheduler reserved for a request serve both.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from eagleserve.config import ServerArgs, SpecConfig
from eagleserve.constrained.constraint_batch import BatchConstraint
from eagleserve.constrained.grammar_mask import mask_logits, to_draft_vocab
from eagleserve.core import EagleDraftInput, ScheduleBatch
from eagleserve.device import tensor_to
from eagleserve.layers.attention import create_attn_backend
from eagleserve.layers.forward_batch import ForwardBatch, HostLens, forward_context
from eagleserve.mem_cache.kv_cache import TokenToKVPool
from eagleserve.model_executor.cuda_graph_runner import GraphedForward
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.models.loader import resolve_draft_path
from eagleserve.sampling.sampling_info import SamplingInfo
from eagleserve.spec.adaptive import acceptance_prior
from eagleserve.spec.draft_extend import (
    DraftDraw,
    DraftExtendGraphs,
    DrawMode,
    draw_mode,
    last_rows_forward,
    seed_from_logits,
)
from eagleserve.spec.draft_lag import DraftLag, catch_up_batch
from eagleserve.spec.draft_loop import DraftLoops, DraftRows, chain_step_batch, tree_step_batch
from eagleserve.spec.draft_tree import chain_goes_on, draft_chain, draft_tree
from eagleserve.spec.head_loader import load_eagle_head, measured_acceptance
from eagleserve.spec.tree import Topk1ChainBuffers, TreeInfo, build_chain, build_tree

logger = logging.getLogger(__name__)


class EagleDraftWorker:
    def __init__(self, target: ModelRunner, spec: SpecConfig, args: ServerArgs) -> None:
        t0 = time.perf_counter()
        self.spec = spec
        self.device = device = target.device
        self.req_to_token = target.req_to_token_pool.req_to_token
        head_path = resolve_draft_path(spec.draft_model_path)
        self.head = load_eagle_head(head_path, spec.algorithm, target.model, device, target.dtype)
        # Where the engine-wide acceptance by depth starts (spec/adaptive.py).
        self.acceptance_prior = acceptance_prior(measured_acceptance(head_path), spec.num_steps)
        packed = target.gguf_path is not None
        if packed:  # a packed target on CPU: the head runs on its kernels, weights in 4 bits
            from eagleserve.models.weight_cache import pack_head_linears_cached

            assert target.gguf_path is not None
            self.head.fuse_projections()  # packed once, kept in the cache directory
            pack_head_linears_cached(self.head, (head_path, target.gguf_path))
            self.head.use_row_kernels()
        elif target.model.fused_kernels:  # the layer on the target's kernels, fewer launches
            self.head.use_fused_kernels()
        if target.batch_invariant:  # the head's drafts are then the same in any batch too
            from eagleserve.models.batch_invariant import make_batch_invariant

            make_batch_invariant(self.head)
        # The target id of every draft id: drafts map their ids by it, and output-constraint masks
        # (target vocabulary) map onto head logits.
        self.head.freeze_vocab_map()
        vd = self.head.draft_vocab_size
        self.draft_to_target = self.head.to_target_ids(torch.arange(vd, device=device))
        # EAGLE-3 fuses hidden states entering three target layers; the head says which.
        target.model.aux_layer_ids = self.head.aux_layer_ids
        hc = self.head.config
        self.kv_pool = TokenToKVPool(
            args.max_total_tokens, hc.num_hidden_layers, hc.num_key_value_heads, hc.head_dim,
            target.dtype, device,
        )  # fmt: skip
        # Trees too: Triton runs a tree-mask step as one kernel a layer (padded SDPA: a dozen ops).
        self.attn_backend = create_attn_backend(
            args.attention_backend,
            device,
            self.req_to_token,
            hc.head_dim**-0.5,
            shape_invariant=packed,  # the target's row kernel (its fp32 pool)
        )
        logger.info("start-up: draft head and its KV pool loaded in %.2f s",
                    time.perf_counter() - t0)  # fmt: skip
        graph_bs = args.graph_max_bs()
        self.graph: GraphedForward | None = None
        if spec.is_chain and target.graphs_enabled(args):
            self.graph = GraphedForward(
                lambda fb, ex: self.head(fb.input_ids, ex["features"], fb.positions),
                "draft", self.kv_pool, self.attn_backend, device, graph_bs, 1,
                extra_shapes={"features": ((self.head.hidden_size,), target.dtype)},
            )  # fmt: skip
            t1 = time.perf_counter()
            self.graph.capture()
            logger.info("start-up: draft graph captured in %.2f s", time.perf_counter() - t1)
        # Eager chains only, which on a CPU read the probabilities for free (draft_chain).
        self.min_path_prob = spec.min_path_prob if device.type == "cpu" else 0.0
        # Per chain length drafted (adaptive speculation drafts 1..num_steps), sized for the
        # largest batch that can run, so no batch falls back to the slow path.
        chain_lengths = range(1 if spec.adaptive else spec.num_steps, spec.num_steps + 1)
        self.chain_buffers = {
            k: Topk1ChainBuffers(max(graph_bs, args.max_running_requests), k, k + 1, device)
            for k in (chain_lengths if spec.is_chain else ())
        }
        # The whole k-step draft, chain or tree, as one graph per k and draw mode (a chain's
        # per-step graph above replays k times with eager ops between; a tree has no other
        # graph). EAGLESERVE_DISABLE_DRAFT_LOOP_GRAPH=1 keeps the steps.
        graphs_on = target.graphs_enabled(args)
        self.draw_modes = self._graph_draw_modes()
        self.loops = DraftLoops(self.head, self.kv_pool, self.attn_backend, self.req_to_token,
                                spec.eagle_topk, spec.num_draft_tokens, self.chain_buffers,
                                spec.num_steps, target.draw_kernel)  # fmt: skip
        self.loop_graphs: dict[tuple[int, DrawMode], GraphedForward] = {}
        if graphs_on and os.environ.get("EAGLESERVE_DISABLE_DRAFT_LOOP_GRAPH") != "1":
            lengths = chain_lengths if spec.is_chain else (spec.num_steps,)
            self.loop_graphs, self.draw_modes = self.loops.capture_graphs(
                [k for k in lengths if k > 1], self.draw_modes, graph_bs, target.dtype, device
            )
        # The seed extend after each verify as one graph per path width and draw mode
        # (draft_extend.py).
        self.extend_graphs: DraftExtendGraphs | None = None
        # A head of several layers extends eagerly: its graph writes K/V as a one-layer head's.
        extend_graphs = graphs_on and not self.head.upper_layers
        if extend_graphs and os.environ.get("EAGLESERVE_DISABLE_DRAFT_EXTEND_GRAPH") != "1":
            # A tree's accepted path is at most its draft steps deep (accept()'s max_depth).
            widths = [k + 1 for k in chain_lengths] if spec.is_chain else [spec.num_steps + 1]
            graphs = DraftExtendGraphs(self.head, self.kv_pool, self.attn_backend, device,
                                       widths, graph_bs, target.dtype, spec.eagle_topk,
                                       self.draw_modes, target.draw_kernel)  # fmt: skip
            try:
                failed = graphs.capture()
                self.extend_graphs = graphs
                self.draw_modes = tuple(m for m in self.draw_modes if m not in failed)
            except Exception:  # the eager extend still serves; tests/spec/test_gpu_paths.py
                logger.exception("capturing the draft extend failed: extending eagerly")
        # Adaptive: head inputs held while requests do not draft (flushed when the ring is full).
        self.lag = (
            DraftLag(args.max_running_requests, spec.adaptive_probe_interval)
            if spec.adaptive
            else None
        )

    def _graph_draw_modes(self) -> tuple[DrawMode, ...]:
        """The draw modes the draft graphs are captured for: a chain's sampled requests draft
        in graphs of their own (`DraftDraw`), unless EAGLESERVE_DISABLE_DRAWN_DRAFT_GRAPHS=1
        (their graphs then draft the argmax, as a tree's always do)."""
        if (
            self.spec.eagle_topk != 1
            or os.environ.get("EAGLESERVE_DISABLE_DRAWN_DRAFT_GRAPHS") == "1"
        ):
            return ("argmax",)
        return ("argmax", "drawn", "drawn_filtered")

    def _graph_mode(self, sampling: SamplingInfo | None) -> DrawMode:
        """The draw mode of the graphs a batch with this `sampling` drafts in."""
        mode = draw_mode(sampling)
        return mode if mode in self.draw_modes else "argmax"

    def _masked(self, logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """Head logits [rows, Vd] with an output-constraint mask [rows, V] (target ids)
        applied, so the top-k drafts only tokens the constraint allows."""
        if allowed is None:
            return logits
        draft = to_draft_vocab(allowed, self.draft_to_target)
        # A reduced draft vocabulary may hold none of the allowed tokens: draft freely there
        # (the verify masks every node; an all -inf row would be NaN in the softmax).
        return mask_logits(logits, draft | ~draft.any(dim=-1, keepdim=True))

    def extend(
        self,
        fb: ForwardBatch,
        features: torch.Tensor,
        last_rows: torch.Tensor | None,
        allowed: torch.Tensor | None = None,
        sampling: SamplingInfo | None = None,
    ) -> EagleDraftInput:
        """Head forward over `fb`'s tokens (its layout, the head's KV): token j is paired with
        the target feature of the token before it. Returns the seed of the next draft; its top-k
        only among `allowed` [bs, V] (the output constraint after the committed tokens) when
        given, and sampled rows' drafts drawn (`DraftDraw`) given their `sampling` (one row per
        request).
        `last_rows` None: a fixed-shape path extend as the verify left it (mask_path_rows)."""
        if allowed is None and self.extend_graphs is not None:
            seed = self.extend_graphs.replay(fb, features, self._graph_mode(sampling), sampling)
            if seed is not None:
                return seed
        logits, feats = self.extend_forward(fb, features, last_rows)
        # A request's last row pairs its newest token (at prefix + extend) with the feature
        # before it; its draft sits one further on.
        draw = self._draw(sampling, fb.prefix_lens, fb.extend_lens, 1)
        return seed_from_logits(
            self.head, self._masked(logits, allowed), feats, self.spec.eagle_topk, draw
        )

    def _draw(
        self, sampling: SamplingInfo | None, *position: torch.Tensor | int
    ) -> DraftDraw | None:
        """How a chain's seed rows draw, their drafts sitting at the sum of `position` (None:
        all by the argmax, and the sum, ops a greedy batch does not need, is not taken)."""
        if sampling is None or sampling.all_greedy or self.spec.eagle_topk != 1:
            return None
        positions = position[0]
        for term in position[1:]:
            positions = positions + term
        assert isinstance(positions, torch.Tensor)
        return DraftDraw(sampling, positions)

    def extend_forward(
        self, fb: ForwardBatch, features: torch.Tensor, last_rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`last_rows_forward` of the head over `fb`'s tokens, in the head's KV."""
        return last_rows_forward(self.head, self._in_head_kv(fb), features, last_rows)

    def _in_head_kv(self, fb: ForwardBatch) -> ForwardBatch:
        return dataclasses.replace(
            fb,
            mode="extend",
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            logits_indices=None,
            tree_mask=None,
            attn_metadata=None,
        )

    def write_prompt(
        self,
        fb: ForwardBatch,
        features: torch.Tensor,
        last_rows: torch.Tensor,
        batch: ScheduleBatch,
    ) -> EagleDraftInput:
        """Adaptive speculation, after a prefill: the head KV of every row of `fb`, and no
        seed. A request whose prompt ends here (batch.draft_lags[i] == 1) holds its last row
        as its first pair: the whole layer and the lm_head there would give only the seed of
        a draft, and the catch-up before its first draft computes that seed anyway (its K/V,
        rewritten then, are the same). The seeds returned are placeholders."""
        assert self.lag is not None and batch.draft_lags is not None
        with forward_context(self._in_head_kv(fb)):
            self.head.write_kv(fb.input_ids, features, fb.positions, fb.out_cache_loc)
        held = [i for i, m in enumerate(batch.draft_lags) if m]
        if held:  # copies of the held rows: a prefill's features are too large to keep
            rows = last_rows[tensor_to(held, torch.long, self.device)]
            slots = [batch.reqs[i].req_pool_idx for i in held]
            self.lag.hold(slots, [0] * len(held), fb.input_ids[rows], features[rows])
        bs, topk = batch.batch_size, self.spec.eagle_topk
        return EagleDraftInput(
            torch.zeros(bs, topk, device=self.device),
            torch.zeros(bs, topk, dtype=torch.long, device=self.device),
            torch.zeros(bs, self.head.hidden_size, dtype=features.dtype, device=self.device),
        )

    def catch_up(
        self,
        batch: ScheduleBatch,
        info: EagleDraftInput,
        allowed: torch.Tensor | None = None,
        sampling: SamplingInfo | None = None,
    ) -> EagleDraftInput:
        """Runs the head over every input held for the batch's requests (batch.draft_lags);
        returns `info` with those requests' seeds replaced by the fresh ones (`allowed`
        [bs, V]: output-constraint masks of the batch's rows; `sampling`: the batch's, for
        `extend`)."""
        assert self.lag is not None and batch.draft_lags is not None
        fb, features, last_rows, rows = catch_up_batch(
            self.lag, batch, batch.draft_lags, self.req_to_token, self.kv_pool, self.attn_backend
        )
        idx = tensor_to(rows, torch.long, self.device)
        fresh = self.extend(fb, features, last_rows, None if allowed is None else allowed[idx],
                            None if sampling is None else sampling.rows(rows, idx))  # fmt: skip
        topk_p, topk_index, hidden = (
            info.topk_p.clone(), info.topk_index.clone(), info.hidden_states.clone()
        )  # fmt: skip
        topk_p[idx], topk_index[idx], hidden[idx] = (
            fresh.topk_p, fresh.topk_index, fresh.hidden_states
        )  # fmt: skip
        return EagleDraftInput(topk_p, topk_index, hidden)

    def flush(self, batch: ScheduleBatch, rows: list[int]) -> None:
        """Writes the head KV of every pair held for the batch's `rows` (spec/draft_lag.py)."""
        assert self.lag is not None and batch.draft_lags is not None
        lags = [m if i in rows else 0 for i, m in enumerate(batch.draft_lags)]
        fb, features, _, _ = catch_up_batch(
            self.lag, batch, lags, self.req_to_token, self.kv_pool, self.attn_backend
        )
        with forward_context(fb):
            self.head.write_kv(fb.input_ids, features, fb.positions, fb.out_cache_loc)

    def draft(
        self,
        batch: ScheduleBatch,
        info: EagleDraftInput,
        num_steps: int,
        constraint: BatchConstraint | None = None,
        sampling: SamplingInfo | None = None,
    ) -> TreeInfo:
        """`num_steps` head steps from `info`, and the verify tree they draft, rooted at the
        bonus tokens batch.input_ids; batch.seq_lens are the committed lengths L. With
        `constraint`, each branch's top-k is masked by the constraint after its own path (host reads
        of the paths: one sync per step). A chain run step by step draws its sampled rows'
        drafts (`DraftDraw`, given the batch's `sampling`), as does a chain's loop graph of its
        draw mode."""
        spec = self.spec
        if spec.is_chain and num_steps == 1 and not self.loop_graphs:  # the seed: no head step
            goes_on = chain_goes_on(info.topk_p, self.min_path_prob)
            return build_chain(batch.input_ids, info.topk_index, goes_on)
        assert batch.seq_lens_cpu is not None, "drafting needs the scheduler's host seq lens"
        L = batch.seq_lens
        base = ForwardBatch(  # the requests, their bonus tokens and committed lengths
            mode="draft",
            input_ids=batch.input_ids,
            positions=L,
            out_cache_loc=L,
            req_pool_indices=batch.req_pool_indices,
            prefix_lens=L,
            extend_lens=torch.ones_like(L),
            host=HostLens(1, int(batch.seq_lens_cpu.max()), True),
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
        )

        track = constraint is not None
        mode = self._graph_mode(sampling)
        loop = None if track else self.loop_graphs.get((num_steps, mode))
        if loop is not None and batch.batch_size <= loop.max_bs:
            drawn = {}
            if mode != "argmax":
                assert sampling is not None
                p = sampling.packed()
                drawn = {"draw_f": p.floats, "draw_i": p.ints}
            out = loop.replay(base, topk_p=info.topk_p, topk_index=info.topk_index,
                              hidden=info.hidden_states, **drawn)  # fmt: skip
            # A tree's loop built its verify tree; a chain's is one concatenation.
            return build_chain(batch.input_ids, out[2]) if spec.is_chain else TreeInfo(*out)
        rows = self.loops.rows(base, num_steps - 1)  # the graph makes its own

        def step(
            ids: torch.Tensor,
            feats: torch.Tensor,
            depth: int,
            mask: torch.Tensor | None,
            paths: torch.Tensor | None,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            allowed = None
            if constraint is not None and paths is not None:
                allowed = constraint.branch_allowed(paths, self.device)
            return self._step(base, rows, ids, feats, depth, mask, allowed, sampling)

        if spec.is_chain:
            chain = draft_chain(info, num_steps, step, self.chain_buffers[num_steps], track,
                                self.min_path_prob)  # fmt: skip
            return build_chain(batch.input_ids, chain.draft_tokens, chain.goes_on)
        d = draft_tree(info, num_steps, spec.eagle_topk, spec.num_draft_tokens, step, track)
        return build_tree(batch.input_ids, d.parent_list, d.top_scores_index, d.draft_tokens,
                          spec.eagle_topk, spec.num_draft_tokens,
                          kernel=self.head.fused_kernels)  # fmt: skip

    def _step(
        self,
        base: ForwardBatch,
        rows: DraftRows,
        input_ids: torch.Tensor,
        feats: torch.Tensor,
        depth: int,
        region_mask: torch.Tensor | None,
        allowed: torch.Tensor | None = None,
        sampling: SamplingInfo | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Head forward for draft depth `depth` (1-based) of every branch of `base`'s requests
        (committed lengths L as prefix_lens), its row of `rows` (`DraftLoops.rows`); returns its
        top-k. A chain step is a 1-token decode after L + depth - 1 positions; tree branches
        (`tree_step_batch`) also see the region nodes `region_mask` allows."""
        topk, width = self.spec.eagle_topk, self.req_to_token.shape[1]
        if topk == 1:  # eager metadata: the per-step graph replays only such a batch
            fb = chain_step_batch(base, rows, input_ids, depth, False, width)
        else:
            fb = tree_step_batch(base, rows, input_ids, depth, topk, region_mask, width)
        if self.graph is not None and self.graph.can_replay(fb):
            logits, next_feats = self.graph.replay(fb, features=feats)
        else:
            with forward_context(fb):
                logits, next_feats = self.head(input_ids, feats, fb.positions)
        # A step's row at position p holds the draft at p + 1 and proposes the one at p + 2.
        draw = self._draw(sampling, fb.positions, 2)
        seed = seed_from_logits(self.head, self._masked(logits, allowed), next_feats, topk, draw)
        return seed.topk_p, seed.topk_index, seed.hidden_states  # p, ids [bs*topk, topk]; features

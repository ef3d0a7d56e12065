"""The EAGLE worker: draft with the head, verify in one target forward, accept, draft-extend.

Conventions (per request, iteration start): `seq_lens` = L, the committed length (target and
draft KV valid for positions 0..L-1); `input_ids` = the bonus token b at position L (no KV yet);
`spec_info` = top-k of the head's prediction for position L+1 and its feature.
Slots for positions [L, L + alloc_len) are reserved before the iteration: drafting writes head
KV there (region node r at L + r), verify writes target KV (tree node i at L + i), and after
acceptance the row is permuted so the accepted path sits at L, L+1, ... (no KV copy).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from eagleserve.config import ModelConfig, ServerArgs, SpecConfig
from eagleserve.core import EagleDraftInput, ScheduleBatch
from eagleserve.model.attention import create_attn_backend
from eagleserve.model.cuda_graph import GraphedForward, graphs_supported
from eagleserve.model.forward_batch import ForwardBatch, forward_context
from eagleserve.model.kv_cache import TokenToKVPool
from eagleserve.model.loader import resolve_draft_path
from eagleserve.model.runner import ModelRunner
from eagleserve.model.sampler import SamplingInfo, logits_to_probs, top_logprobs
from eagleserve.scheduler.output_processor import GenerationBatchResult
from eagleserve.spec.accept import AcceptResult, verify_greedy, verify_sampling
from eagleserve.spec.draft_tree import DraftTree, draft_chain, draft_tree
from eagleserve.spec.eagle_head import load_eagle_head
from eagleserve.spec.tree import Topk1ChainBuffers, build_tree


class EagleWorker:
    def __init__(
        self,
        model_config: ModelConfig,
        model_path: str,
        spec: SpecConfig,
        device: torch.device,
        dtype: torch.dtype,
        args: ServerArgs,
        max_context_len: int,
        gguf_path: str | None = None,
    ) -> None:
        self.spec = spec
        self.device = device
        self.target = ModelRunner(
            model_config,
            model_path,
            device,
            dtype,
            args.kv_cache_tokens,
            args.max_running_requests,
            max_context_len,
            args.attention_backend,
            load_format=args.load_format,
            gguf_path=gguf_path,
        )
        self.head = load_eagle_head(
            resolve_draft_path(spec.draft_model_path), spec.algorithm, self.target.model, device,
            dtype,
        )
        if gguf_path is not None:  # a packed target on CPU: the head's matmuls in int8
            from eagleserve.model.quant import linears_to_int8

            linears_to_int8(self.head)
        # EAGLE-3 fuses hidden states entering three target layers; the head says which.
        self.target.model.aux_layer_ids = self.head.aux_layer_ids
        self.req_to_token_pool = self.target.req_to_token_pool
        self.token_to_kv_pool = self.target.token_to_kv_pool
        # Draft KV shares slot numbers with the target: one allocator, two sets of buffers.
        hc = self.head.config
        self.draft_kv_pool = TokenToKVPool(
            args.kv_cache_tokens, 1, hc.num_key_value_heads, hc.head_dim, dtype, device
        )
        self.draft_attn = create_attn_backend(
            "torch" if not spec.is_chain else args.attention_backend,
            device,
            self.req_to_token_pool.req_to_token,
            hc.head_dim**-0.5,
        )
        # The overlap scheduler prepares N+1 before it knows N's accept lengths: 2x covers the
        # one-iteration lag of the host's committed length.
        overlap = args.overlap_schedule(device.type)
        self.decode_slots_per_req = spec.alloc_len_per_decode * (2 if overlap else 1)
        self.draft_graph: GraphedForward | None = None
        if graphs_supported(device, args.disable_cuda_graph, self.target.attn_backend):
            max_bs = min(args.cuda_graph_max_bs, args.max_running_requests)
            self.target.capture_graphs(max_bs, spec.num_draft_tokens, tree=not spec.is_chain)
            if spec.is_chain:
                self.draft_graph = GraphedForward(
                    lambda fb, ex: self.head(fb.input_ids, ex["features"], fb.positions),
                    lambda **kw: ForwardBatch(
                        mode="draft", kv_pool=self.draft_kv_pool, attn_backend=self.draft_attn, **kw
                    ),
                    device,
                    max_bs,
                    1,
                    extra_shapes={"features": ((self.head.hidden_size,), dtype)},
                )
                self.draft_graph.capture()
        self.chain_buffers = (
            Topk1ChainBuffers(
                args.cuda_graph_max_bs or args.max_running_requests,
                spec.num_steps,
                spec.num_draft_tokens,
                device,
            )
            if spec.is_chain
            else None
        )

    def _rebuild_topk1_chain_buffers(self) -> None:
        if self.chain_buffers is not None:
            self.chain_buffers._rebuild_topk1_chain_buffers(
                self.spec.num_steps, self.spec.num_draft_tokens
            )

    # ---- scheduler interface ---------------------------------------------------------------
    def prepare_for_decode(self, batch: ScheduleBatch) -> None:
        """Reserves slots up to the host's view of L plus decode_slots_per_req per request."""
        batch.mode = "decode"
        r2t = self.req_to_token_pool.req_to_token
        for req in batch.reqs:
            need = req.kv_committed_len + self.decode_slots_per_req - req.kv_allocated_len
            if need > 0:
                loc = self.token_to_kv_pool.alloc(need)
                assert loc is not None, "EAGLE decode: KV pool exhausted (caller must retract)"
                r2t[req.req_pool_idx, req.kv_allocated_len : req.kv_allocated_len + need] = loc
                req.kv_allocated_len += need

    def extend_to_decode(self, batch: ScheduleBatch) -> None:
        batch.mode = "decode"
        batch.prefix_lens = batch.extend_lens = None

    @torch.inference_mode()
    def forward_batch_generation(
        self, batch: ScheduleBatch, on_verified: Callable[[ScheduleBatch], None] | None = None
    ) -> GenerationBatchResult:
        """One prefill or decode iteration. `on_verified(batch)` runs once `batch.seq_lens` and
        `batch.input_ids` hold the new lengths and bonus tokens, before the draft extend."""
        if batch.mode == "extend":
            return self._forward_prefill(batch, on_verified)
        return self._forward_decode(batch, on_verified)

    # ---- prefill -----------------------------------------------------------------------------
    def _forward_prefill(
        self, batch: ScheduleBatch, on_verified: Callable[[ScheduleBatch], None] | None
    ) -> GenerationBatchResult:
        from eagleserve.scheduler.target_worker import forward_inputs, sample_with_logprobs

        inputs = forward_inputs(batch)
        out = self.target.forward(
            "extend",
            batch.input_ids,
            out_cache_loc=batch.out_cache_loc,
            req_pool_indices=batch.req_pool_indices,
            **inputs,
        )
        result = sample_with_logprobs(out.logits, batch, self.target.config.vocab_size)
        # Head pairs token t[j+1] with feature f[j]: shift ids left, append the sampled token.
        ext = inputs["extend_lens"]
        last = inputs["logits_indices"]
        shifted = torch.roll(batch.input_ids, -1)
        shifted[last] = result.next_token_ids
        batch.input_ids = result.next_token_ids
        if on_verified is not None:
            on_verified(batch)
        self._draft_extend(
            batch,
            shifted,
            self._features(out),
            inputs["positions"],
            batch.out_cache_loc,
            inputs["prefix_lens"],
            ext,
            last,
        )
        return result

    def _features(self, out: object) -> torch.Tensor:
        aux = out.aux_hidden_states
        return aux if self.spec.algorithm == "EAGLE3" else out.hidden_states

    def _draft_extend(
        self,
        batch: ScheduleBatch,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        out_cache_loc: torch.Tensor,
        prefix_lens: torch.Tensor,
        extend_lens: torch.Tensor,
        last_rows: torch.Tensor,
    ) -> None:
        """Head forward over committed tokens; its last row per request seeds the next draft."""
        fb = self._draft_fb(
            "extend",
            input_ids,
            positions,
            out_cache_loc,
            batch.req_pool_indices,
            prefix_lens,
            extend_lens,
        )
        with forward_context(fb):
            logits, feats = self.head(input_ids, features, positions)
        probs = torch.softmax(logits[last_rows], dim=-1)
        topk_p, topk_ids = probs.topk(self.spec.eagle_topk, dim=-1)
        batch.spec_info = EagleDraftInput(
            topk_p, self.head.to_target_ids(topk_ids), feats[last_rows]
        )

    def _draft_fb(
        self,
        mode: str,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_cache_loc: torch.Tensor,
        req_pool_indices: torch.Tensor,
        prefix_lens: torch.Tensor,
        extend_lens: torch.Tensor,
        tree_mask: torch.Tensor | None = None,
        kv_lens: torch.Tensor | None = None,
    ) -> ForwardBatch:
        return ForwardBatch(
            mode=mode,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=req_pool_indices,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            kv_pool=self.draft_kv_pool,
            attn_backend=self.draft_attn,
            tree_mask=tree_mask,
            kv_lens=kv_lens,
        )

    def _draft_step(
        self,
        batch: ScheduleBatch,
        input_ids: torch.Tensor,
        feats: torch.Tensor,
        step: int,
        region_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        """Head forward for draft depth `step` (1-based) of every branch; returns top-k."""
        topk = self.spec.eagle_topk
        L = batch.seq_lens
        r2t = self.req_to_token_pool.req_to_token
        bs = batch.batch_size
        branch = torch.arange(topk, device=self.device)
        region_idx = (step - 1) * topk + branch  # [topk]
        loc = r2t[batch.req_pool_indices[:, None], L[:, None] + region_idx[None, :]].reshape(-1)
        positions = (L + step - 1).repeat_interleave(topk)
        if topk == 1 and self.draft_graph is not None and self.draft_graph.can_run(L.shape[0]):
            logits, next_feats = self.draft_graph.replay(
                input_ids, positions, loc, batch.req_pool_indices, L + step - 1, features=feats
            )
            probs = torch.softmax(logits, dim=-1)
            topk_p, topk_ids = probs.topk(topk, dim=-1)
            return topk_p, self.head.to_target_ids(topk_ids), next_feats
        if topk == 1:
            fb = self._draft_fb(
                "draft",
                input_ids,
                positions,
                loc,
                batch.req_pool_indices,
                L + step - 1,
                torch.ones_like(L),
            )
        else:
            fb = self._draft_fb(
                "draft",
                input_ids,
                positions,
                loc,
                batch.req_pool_indices,
                L,
                torch.full_like(L, topk),
                tree_mask=region_mask,
                kv_lens=L + step * topk,
            )
        with forward_context(fb):
            logits, next_feats = self.head(input_ids, feats, positions)
        probs = torch.softmax(logits, dim=-1)
        topk_p, topk_ids = probs.topk(topk, dim=-1)  # [bs*topk, topk]
        del bs
        return topk_p, self.head.to_target_ids(topk_ids), next_feats

    # ---- decode: draft -> verify -> accept -> draft extend ----------------------------------
    def _forward_decode(
        self, batch: ScheduleBatch, on_verified: Callable[[ScheduleBatch], None] | None
    ) -> GenerationBatchResult:
        spec = self.spec
        info: EagleDraftInput = batch.spec_info
        step_fn = lambda ids, feats, step, mask: self._draft_step(batch, ids, feats, step, mask)
        if spec.is_chain:
            tree: DraftTree = draft_chain(info, spec.num_steps, step_fn, self.chain_buffers)
        else:
            tree = draft_tree(info, spec.num_steps, spec.eagle_topk, spec.num_draft_tokens, step_fn)
        t = build_tree(
            batch.input_ids,
            tree.parent_list,
            tree.top_scores_index,
            tree.draft_tokens,
            spec.eagle_topk,
            spec.num_draft_tokens,
        )
        n = spec.num_draft_tokens
        bs = batch.batch_size
        L = batch.seq_lens
        r2t = self.req_to_token_pool.req_to_token
        node = torch.arange(n, device=self.device)
        loc = r2t[batch.req_pool_indices[:, None], L[:, None] + node[None, :]].reshape(-1)
        out = self.target.forward(
            "verify",
            t.draft_tokens.reshape(-1),
            (L[:, None] + t.depths).reshape(-1),
            loc,
            batch.req_pool_indices,
            L,
            torch.full_like(L, n),
            tree_mask=None if spec.is_chain else t.tree_mask,
        )
        logits = out.logits.view(bs, n, -1)
        acc = self._accept(batch, t.draft_tokens, t.parents, logits)
        if not spec.is_chain:
            self._commit_tree_path(batch, acc.accept_index, n)
        # Draft extend over the accepted path: token after node k with the feature of node k.
        a = acc.accept_lens
        rows = acc.accept_index.clamp(min=0) + (torch.arange(bs, device=self.device) * n)[:, None]
        valid = acc.accept_index >= 0  # [bs, depth+1]
        flat_rows = rows[valid]
        ext_ids = acc.output_tokens[valid]
        offs = torch.arange(acc.accept_index.shape[1], device=self.device)
        positions = (L[:, None] + offs[None, :])[valid]
        ext_loc = r2t[batch.req_pool_indices[:, None], (L[:, None] + offs[None, :])][valid]
        feats = self._features(out)[flat_rows]
        last_rows = torch.cumsum(a, 0) - 1
        # Producer of new lengths: the scheduler's refresh point recomputes the host mirror.
        batch.seq_lens = L + a
        batch.seq_lens_cpu = None
        batch.seq_lens_sum = None
        batch.input_ids = acc.bonus_tokens
        if on_verified is not None:
            on_verified(batch)
        self._draft_extend(batch, ext_ids, feats, positions, ext_loc, L, a, last_rows)
        result = GenerationBatchResult(acc.output_tokens, a)
        if any(r.sampling_params.logprobs is not None for r in batch.reqs):
            k = max((r.sampling_params.logprobs or 0) for r in batch.reqs)
            row_logits = logits.reshape(bs * n, -1)[rows.reshape(-1)]
            chosen, vals, ids = top_logprobs(
                row_logits, acc.output_tokens.clamp(min=0).reshape(-1), k
            )
            depth1 = rows.shape[1]
            result.logprobs = chosen.view(bs, depth1)
            result.top_logprob_vals = vals.view(bs, depth1, -1)
            result.top_logprob_ids = ids.view(bs, depth1, -1)
        return result

    def _accept(
        self,
        batch: ScheduleBatch,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        logits: torch.Tensor,
    ) -> AcceptResult:
        bs, n, _ = logits.shape
        predict = logits.argmax(dim=-1)  # [bs, n]
        greedy = verify_greedy(tokens, parents, predict)
        info = SamplingInfo.from_reqs(batch.reqs, logits.shape[-1], self.device)
        if info.all_greedy:
            return greedy
        sampled_rows = [i for i, g in enumerate(info.is_greedy) if not g]
        idx = torch.tensor(sampled_rows, device=self.device)
        sub = SamplingInfo.from_reqs(
            [batch.reqs[i] for i in sampled_rows], logits.shape[-1], self.device
        )
        probs = logits_to_probs(
            logits[idx].reshape(len(sampled_rows) * n, -1), sub.repeat_interleave(n)
        ).view(len(sampled_rows), n, -1)
        samp = verify_sampling(tokens[idx], parents[idx], probs, sub.generators)
        for name in ("accept_index", "accept_lens", "output_tokens", "bonus_tokens"):
            getattr(greedy, name)[idx] = getattr(samp, name)
        return greedy

    def _commit_tree_path(self, batch: ScheduleBatch, accept_index: torch.Tensor, n: int) -> None:
        """Permutes slots of [L, L+n) so the accepted nodes sit at L, L+1, ... in path order."""
        r2t = self.req_to_token_pool.req_to_token
        node = torch.arange(n, device=self.device)
        cols = batch.seq_lens[:, None] + node[None, :]  # [bs, n]
        rows = batch.req_pool_indices[:, None].expand(-1, n)
        slots = r2t[rows, cols]  # [bs, n]
        d = accept_index.shape[1]
        valid = accept_index >= 0
        # Sort key: accepted node at path step k -> k - d (negative), others -> their node index.
        path_rank = torch.where(
            valid, torch.arange(d, device=self.device)[None, :] - d, torch.zeros_like(accept_index)
        )
        path_key = torch.zeros_like(cols).scatter_reduce_(
            1, accept_index.clamp(min=0), path_rank, reduce="amin", include_self=True
        )
        key = torch.where(path_key < 0, path_key, node[None, :].expand_as(cols))
        order = key.argsort(dim=1)
        r2t[rows, cols] = slots.gather(1, order)

"""The EAGLE worker: draft with the head, verify in one target forward, accept, draft-extend.

Conventions (per request, iteration start): `seq_lens` = L, the committed length (target and
draft KV valid for positions 0..L-1); `input_ids` = the bonus token b at position L (no KV yet);
`spec_info` = top-k of the head's prediction for position L+1 and its feature.
Slots for positions [L, L + alloc_len) are reserved before the iteration: drafting writes head
KV there (region node r at L + r), verify writes target KV (tree node i at L + i), and after
acceptance the row is permuted so the accepted path sits at L, L+1, ... (no KV copy); the
scheduler permutes the host's copy of the row alike when it reads the result.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from eagleserve.config import ServerArgs, SpecConfig
from eagleserve.constrained.grammar_mask import mask_logits
from eagleserve.core import GenerationBatchResult, OnVerified, Req, ScheduleBatch
from eagleserve.distributed.parallel import broadcast_object
from eagleserve.layers.forward_batch import ForwardBatch, HostLens
from eagleserve.model_executor.cuda_graph_runner import BUCKETS
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.models.llama import ModelOutput
from eagleserve.sampling.prompt_logprobs import score_prompts, wants_prompt_logprobs
from eagleserve.sampling.sampler import sample_next, top_logprobs
from eagleserve.sampling.sampling_info import PackedSampling
from eagleserve.spec.accept import accept, commit_tree_path, unpack_walk, verify_walks
from eagleserve.spec.accepted_path import AcceptedPaths
from eagleserve.spec.adaptive import AdaptiveController, depth_choices, request_acceptance
from eagleserve.spec.cost_table_cache import cost_table
from eagleserve.spec.draft_extend import draw_extras
from eagleserve.spec.draft_worker import EagleDraftWorker


class EagleWorker:
    def __init__(self, runner: ModelRunner, spec: SpecConfig, args: ServerArgs) -> None:
        self.spec = spec
        self.device = runner.device
        self.runner = runner
        self.req_to_token_pool = runner.req_to_token_pool
        self.token_to_kv_pool = runner.token_to_kv_pool
        self.drafter = EagleDraftWorker(runner, spec, args)
        self.paths = AcceptedPaths(
            runner, max(args.max_running_requests, spec.num_draft_tokens, spec.num_steps + 1) + 1
        )
        self.decode_slots_per_req = spec.decode_slots_per_req(
            args.overlap_schedule(self.device.type)
        )
        choices = depth_choices(spec.num_steps, spec.is_chain) if spec.adaptive else ()
        verify_sizes = (
            tuple(k + 1 for k in choices if k)
            if spec.adaptive and spec.is_chain
            else (spec.num_draft_tokens,)
        )
        if runner.graphs_enabled(args):
            max_bs = args.graph_max_bs()
            # Verify graphs also walk the acceptance, greedy and drawn (`_epilogue`).
            runner.capture_graphs(max_bs, verify_sizes, not spec.is_chain, self._epilogue,
                                  draw_extras("drawn") if runner.draw_kernel else None)  # fmt: skip
        self.controller: AdaptiveController | None = None
        if spec.adaptive:
            buckets = tuple(b for b in BUCKETS if b < args.max_running_requests)
            costs = cost_table(
                runner, self.drafter, args, (*buckets, args.max_running_requests), choices
            )
            # A CPU's iterations are timed as they run (`_forward_decode`), so its controller
            # can measure a plain decode between drafts; an accelerator's run asynchronously.
            timed = self.device.type == "cpu"
            self.controller = AdaptiveController(costs, choices, spec.adaptive_probe_interval,
                                                 plain_probes=timed)  # fmt: skip

    @property
    def max_depth(self) -> int | None:
        """A tree's accepted paths are at most its draft steps deep (the width of what
        `accept` returns, less one); a chain's are its length."""
        return None if self.spec.is_chain else self.spec.num_steps

    def _epilogue(
        self, fb: ForwardBatch, extras: dict[str, torch.Tensor], logits: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """A verify graph's acceptance walks (`verify_walks`), on the walk kernel where the
        target runs the fused Triton kernels; the drawn one where a draw kernel (one launch,
        no [rows, vocabulary] temporaries) draws."""
        sampling = PackedSampling(extras["draw_f"], extras["draw_i"]) if extras else None
        return verify_walks(fb.input_ids.view(fb.batch_size, -1), fb.positions, logits,
                            sampling, fb.tree_mask, self.max_depth,
                            self.runner.model.fused_kernels, self.runner.draw_kernel)  # fmt: skip

    # ---- scheduler interface ---------------------------------------------------------------
    def plan_launch(
        self, batch: ScheduleBatch, engine_acceptance: list[float], partial: Req | None
    ) -> None:
        """Scheduler thread, before `batch` launches: `plan_decode` or `plan_prefill`."""
        if batch.mode == "decode":
            self.plan_decode(batch, engine_acceptance)
        else:
            self.plan_prefill(batch, partial)

    def plan_decode(self, batch: ScheduleBatch, engine_acceptance: list[float]) -> None:
        """Scheduler thread, before a decode launches: picks this iteration's chain length from
        the last known acceptance (with overlap, one iteration old; each request's own evidence
        shrunk towards `engine_acceptance`, spec/adaptive.py) and books the held head
        inputs (a k = 0 iteration holds one more per request, after flushing a full ring; k > 0
        catches all up)."""
        if self.controller is None:
            return
        alphas = []
        for req in batch.reqs:
            if not req.spec_trials:  # a new request: no evidence of its own yet
                depths = len(engine_acceptance)
                req.spec_hits, req.spec_trials = [0.0] * depths, [0.0] * depths
            alphas.append(request_acceptance(req.spec_hits, req.spec_trials, engine_acceptance))
        lags = [r.draft_lag for r in batch.reqs]
        k = self.controller.choose(alphas, max(lags) > 0)
        # Under tensor parallelism each rank times its own iterations: rank 0's choice is every
        # rank's, or their batches' shapes (and collectives) would differ.
        k = broadcast_object(k)
        assert self.drafter.lag is not None
        full = self.drafter.lag.max_lag
        batch.num_drafts, batch.draft_lags = k, lags
        for req, m in zip(batch.reqs, lags, strict=True):
            req.draft_lag = 0 if k else m % full + 1  # a full ring is flushed first

    def plan_prefill(self, batch: ScheduleBatch, partial: Req | None) -> None:
        """Scheduler thread, before a prefill launches (adaptive): a request whose prompt ends
        here will hold its last row's head input (`EagleDraftWorker.write_prompt`)."""
        if self.controller is None:
            return
        batch.draft_lags = [0 if req is partial else 1 for req in batch.reqs]
        for req, m in zip(batch.reqs, batch.draft_lags, strict=True):
            req.draft_lag = m

    def prepare_for_decode(self, batch: ScheduleBatch) -> None:
        """Reserves slots up to the host's view of L plus decode_slots_per_req per request: one
        allocation and one write into req_to_token for the batch (once every request's reserve
        is topped up, a decode that commits one token each needs one slot each)."""
        batch.mode = "decode"
        spans = [
            (req, req.kv_allocated_len, req.kv_committed_len + self.decode_slots_per_req)
            for req in batch.reqs
        ]
        spans = [(req, start, end) for req, start, end in spans if end > start]
        if not spans:
            return
        slots = self.token_to_kv_pool.alloc_host(sum(end - start for _, start, end in spans))
        assert slots is not None, "EAGLE decode: KV pool exhausted (caller must retract)"
        rows = [(req.req_pool_idx, start, end) for req, start, end in spans]
        self.req_to_token_pool.write_spans(rows, slots)
        for req, _, end in spans:
            req.kv_allocated_len = end

    @torch.inference_mode()
    def forward_batch_generation(
        self, batch: ScheduleBatch, on_verified: OnVerified | None = None
    ) -> GenerationBatchResult:
        """One prefill or decode iteration. `on_verified(batch)` runs once `batch.seq_lens` and
        `batch.input_ids` hold the new lengths and bonus tokens, before the draft extend."""
        if batch.mode == "extend":
            return self._forward_prefill(batch, on_verified)
        return self._forward_decode(batch, on_verified)

    def forget_held_inputs(self, batch: ScheduleBatch, rows: list[int]) -> None:
        """Forward thread, before `batch` (overlap): its `rows` are requests whose previous
        forward failed, at any point, so what they hold for the head (spec/draft_lag.py) is
        undefined and their results will be dropped. They hold afresh and catch nothing up,
        so the batch's other requests run as if those rows were new."""
        if rows and batch.draft_lags is not None:
            batch.draft_lags = [0 if i in rows else m for i, m in enumerate(batch.draft_lags)]

    def _sample_next(
        self, logits: torch.Tensor, batch: ScheduleBatch, positions: torch.Tensor, prefill: bool
    ) -> GenerationBatchResult:
        """The next token of each request, to sit at positions [bs]."""
        info, state = self.runner.sampling_info(batch), self.runner.penalty_state
        slots, constraint = batch.req_pool_indices, batch.constraint
        return sample_next(logits, batch.reqs, info, positions, state, slots, prefill, constraint)

    def _next_allowed(self, batch: ScheduleBatch) -> torch.Tensor | None:
        """Grammar masks [bs, V] after every committed token (seeds the next draft's top-k)."""
        return None if batch.constraint is None else batch.constraint.next_allowed(self.device)

    def _features(self, out: ModelOutput) -> torch.Tensor:
        return out.aux_hidden_states if self.spec.algorithm == "EAGLE3" else out.hidden_states

    # ---- prefill -----------------------------------------------------------------------------
    def _forward_prefill(
        self, batch: ScheduleBatch, on_verified: OnVerified | None
    ) -> GenerationBatchResult:
        if self.controller is not None:
            self.controller.note_prefill()
        fb = ForwardBatch.init_new(batch, self.token_to_kv_pool, self.runner.attn_backend)
        out = self.runner.forward(fb)
        assert batch.seq_lens is not None  # a prefill's: the length with its tokens
        result = self._sample_next(out.logits, batch, batch.seq_lens, prefill=True)
        scored = wants_prompt_logprobs(batch)
        if scored:
            logits_of = self.runner.model.compute_logits
            result.prompt_logprobs = score_prompts(logits_of, out.hidden_states, batch, scored)
        # Head pairs token t[j+1] with feature f[j]: shift ids left, append the sampled token
        # (the next prompt token where the prefill goes on in a later chunk).
        last = fb.logits_indices
        assert last is not None
        shifted = torch.roll(batch.input_ids, -1)
        nxt = batch.next_prompt_ids
        sampled = result.next_token_ids
        shifted[last] = sampled if nxt is None else torch.where(nxt >= 0, nxt, sampled)
        batch.input_ids = result.next_token_ids
        if on_verified is not None:
            on_verified(batch)
        draft_fb = dataclasses.replace(fb, input_ids=shifted)
        if batch.draft_lags is not None:  # adaptive: no seed until a draft needs one
            batch.spec_info = self.drafter.write_prompt(draft_fb, self._features(out), last, batch)
        else:
            allowed, info = self._next_allowed(batch), self.runner.sampling_info(batch)
            batch.spec_info = self.drafter.extend(
                draft_fb, self._features(out), last, allowed, info
            )
        return result

    # ---- decode: draft -> verify -> accept -> draft extend ----------------------------------
    def _forward_decode(
        self, batch: ScheduleBatch, on_verified: OnVerified | None
    ) -> GenerationBatchResult:
        k = self.spec.num_steps if batch.num_drafts is None else batch.num_drafts
        t0 = time.perf_counter()
        flushed, caught_up = 0.0, False
        if k == 0:
            assert batch.draft_lags is not None and self.drafter.lag is not None
            full = [i for i, m in enumerate(batch.draft_lags) if m == self.drafter.lag.max_lag]
            if full:
                self.drafter.flush(batch, full)
                flushed = time.perf_counter() - t0
            result = self._decode_without_drafts(batch, on_verified)
        else:
            if batch.draft_lags is not None and any(batch.draft_lags):
                allowed, info = self._next_allowed(batch), self.runner.sampling_info(batch)
                batch.spec_info = self.drafter.catch_up(batch, batch.spec_info, allowed, info)
                caught_up = True
            result = self._draft_verify(batch, on_verified, k)
        if self.controller is not None and self.device.type == "cpu":
            # On a CPU the forward ran synchronously: wall time is what the iteration cost (a
            # plain decode's flush of full rings aside: the price of holding, not of k = 0), at
            # the depth drafted (k, or less where the chain stopped short: draft_chain).
            end, bs = time.perf_counter(), batch.batch_size
            self.controller.observe(bs, result.num_drafts or 0, end - t0 - flushed, caught_up)
            self.controller.note_forward(bs, t0, end)
        return result

    def _decode_without_drafts(
        self, batch: ScheduleBatch, on_verified: OnVerified | None
    ) -> GenerationBatchResult:
        """k = 0: a plain target decode of the bonus token; the head's input is held back."""
        L = batch.seq_lens
        bs = batch.batch_size
        assert batch.seq_lens_cpu is not None and batch.draft_lags is not None
        max_len = int(batch.seq_lens_cpu.max())
        r2t = self.req_to_token_pool.req_to_token
        out = self.runner.forward(
            ForwardBatch(
                mode="decode",
                input_ids=batch.input_ids,
                positions=L,
                out_cache_loc=r2t[batch.req_pool_indices, L],
                req_pool_indices=batch.req_pool_indices,
                prefix_lens=L,
                extend_lens=torch.ones_like(L),
                host=HostLens.per_request(1, max_len, bs),
                kv_pool=self.token_to_kv_pool,
                attn_backend=self.runner.attn_backend,
            )
        )
        batch.add_one_token()  # known on the host: no refresh needed
        sampled = self._sample_next(out.logits, batch, batch.seq_lens, prefill=False)  # L + 1
        next_ids = sampled.next_token_ids
        lag = self.drafter.lag
        assert lag is not None
        ring_index = [m % lag.max_lag for m in batch.draft_lags]  # a full ring was flushed
        features = self._features(out)
        if out.graph_buffers:  # held past the next replay, which overwrites them
            features = features.clone()
        lag.hold([r.req_pool_idx for r in batch.reqs], ring_index, next_ids, features)
        batch.input_ids = next_ids
        if on_verified is not None:
            on_verified(batch)
        # A target-only decode's result (one token per row, no accept lengths to copy back),
        # marked as a speculative iteration that drafted nothing.
        sampled.num_drafts = 0
        return sampled

    def _draft_verify(
        self, batch: ScheduleBatch, on_verified: OnVerified | None, k: int
    ) -> GenerationBatchResult:
        spec = self.spec
        constraint = batch.constraint
        info = self.runner.sampling_info(batch)
        t = self.drafter.draft(batch, batch.spec_info, k, constraint, info)
        # A CPU's chain may stop short of k where its path is unlikely (draft_chain).
        n = t.draft_tokens.shape[1] if spec.is_chain else spec.num_draft_tokens
        k = n - 1 if spec.is_chain else k
        bs = batch.batch_size
        L = batch.seq_lens
        assert batch.seq_lens_cpu is not None
        max_len = int(batch.seq_lens_cpu.max())
        r2t = self.req_to_token_pool.req_to_token
        # A chain's node i sits at depth i, and its accepted path is its first nodes: the path
        # extend reuses these positions and slots.
        cols, slots = self.paths.slots(L, batch.req_pool_indices, n)
        positions = cols if spec.is_chain else L[:, None] + t.depths  # [bs, n]
        pen, state = info.penalties, self.runner.penalty_state
        # A verify graph walks the acceptance of the raw logits: greedy, or drawn where every
        # row's draw is the graph's (no top-k / top-p; its parameters staged as its extras).
        raw = pen is None and constraint is None
        drawn = raw and not info.all_greedy and not info.sorts and bool(self.runner.draw_kernel)
        staged = {}
        if drawn:
            packed = info.packed(n)
            staged = {"draw_f": packed.floats, "draw_i": packed.ints}
        out = self.runner.forward(
            ForwardBatch(
                mode="verify",
                input_ids=t.draft_tokens.reshape(-1),
                positions=positions.reshape(-1),
                out_cache_loc=slots.reshape(-1),
                req_pool_indices=batch.req_pool_indices,
                prefix_lens=L,
                extend_lens=torch.full_like(L, n),
                host=HostLens.per_request(n, max_len, bs),
                kv_pool=self.token_to_kv_pool,
                attn_backend=self.runner.attn_backend,
                tree_mask=None if spec.is_chain else t.tree_mask,
            ),
            **staged,
        )
        logits = out.logits.view(bs, n, -1)
        # Greedy and sampled acceptance both judge the penalized logits: node i sees the counts
        # of its own path, so the walk accepts exactly what target-only decoding would emit.
        scored = logits if pen is None else pen.verify_logits(
            logits, state, batch.req_pool_indices, t.draft_tokens, t.tree_mask, t.depths
        )  # fmt: skip
        if constraint is not None:  # node i: the constraint after its own path (a host sync)
            scored = mask_logits(scored, constraint.tree_allowed(t.draft_tokens, t.parents,
                                                              self.device))  # fmt: skip
        done = None  # copied out: the next replay overwrites the graph's walks
        if out.epilogue and raw and (drawn or info.all_greedy):
            done = unpack_walk(out.epilogue[1 if drawn else 0].clone())
        acc = accept(
            info,
            t.draft_tokens,
            t.parents,
            scored,
            positions,
            chain=spec.is_chain,
            walked=done,
            max_depth=self.max_depth,
        )
        if pen is not None:
            pen.commit(state, batch.req_pool_indices, acc.output_tokens, acc.output_tokens >= 0)
        if constraint is not None:
            constraint.advance(acc.output_tokens, acc.accept_lens)
        if not spec.is_chain:  # the host's copy follows when the scheduler reads the result
            commit_tree_path(r2t, batch.req_pool_indices, L, acc.accept_index, n)
        a = acc.accept_lens
        if t.goes_on is not None and self.controller is not None:  # a CPU's chain (host memory)
            self.controller.observe_chain(bs, k, t.goes_on, (a - 1).tolist())
        path = (cols, slots) if spec.is_chain else None
        extend_fb, path_rows, last_rows = self.paths.extend(batch, acc, max_len, path)
        if spec.is_chain and self.paths.fixed_shape:
            # A chain's path row j is its verify row j; rows past the accept length seed
            # nothing, so every verify row's feature is used as it is, without a gather.
            feats = self._features(out)
        elif spec.is_chain:  # the path rows kept are the verify rows of the accepted nodes
            feats = self._features(out)[path_rows]
        else:
            feats = self._features(out)[self.paths.verify_rows(acc, n).reshape(-1)[path_rows]]
        # Producer of new lengths: the scheduler's refresh point recomputes the host mirror.
        batch.seq_lens = L + a
        batch.seq_lens_cpu = None
        batch.seq_lens_sum = None
        batch.input_ids = acc.bonus_tokens
        if on_verified is not None:
            on_verified(batch)
        allowed = self._next_allowed(batch)
        batch.spec_info = self.drafter.extend(extend_fb, feats, last_rows, allowed, info)
        result = GenerationBatchResult(acc.output_tokens, a, num_drafts=k)
        if not spec.is_chain:
            result.tree_path, result.tree_nodes = acc.accept_index, n
        if any(r.sampling_params.logprobs is not None for r in batch.reqs):
            k = max((r.sampling_params.logprobs or 0) for r in batch.reqs)
            rows = self.paths.verify_rows(acc, n)
            row_logits = logits.reshape(bs * n, -1)[rows.reshape(-1)]
            chosen, vals, ids = top_logprobs(
                row_logits, acc.output_tokens.clamp(min=0).reshape(-1), k
            )
            result.logprobs = chosen.view(rows.shape)
            result.top_logprob_vals = vals.view(*rows.shape, -1)
            result.top_logprob_ids = ids.view(*rows.shape, -1)
        return result

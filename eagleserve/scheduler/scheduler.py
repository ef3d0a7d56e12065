"""The scheduler: a waiting queue, a running decode batch, continuous batching, KV admission."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

from eagleserve.config import ModelConfig, ServerArgs
from eagleserve.constrained.constraint_batch import BatchConstraint
from eagleserve.constrained.output_constraint import ConstraintBuilder
from eagleserve.core import FinishReason, GenerationBatchResult, Req, ScheduleBatch
from eagleserve.device import pick_device
from eagleserve.distributed.parallel import broadcast_object
from eagleserve.mem_cache.prefix_cache import PrefixCache
from eagleserve.messages import EngineStats, GenerateReqInput, TokenOutput
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.models.loader import load_tokenizer_in_background, resolve_model_path
from eagleserve.sampling.seeded_noise import RequestSeeds
from eagleserve.sampling_params import check_request
from eagleserve.scheduler.chunk_budget import ChunkBudget
from eagleserve.scheduler.engine_stats import engine_stats
from eagleserve.scheduler.future_map import FutureMap
from eagleserve.scheduler.output_processor import (
    StopChecker,
    append_tokens,
    commit_tree_paths_host,
    committed_rows,
    eos_token_ids,
    make_output,
    output_due,
)
from eagleserve.scheduler.overlap import OverlapForwarder
from eagleserve.scheduler.prefill_adder import PrefillPlan, plan_prefill
from eagleserve.scheduler.retraction import preempt_for_waiting, retract_for_decode
from eagleserve.scheduler.spec_stats import SpecStats
from eagleserve.scheduler.target_worker import TargetWorker
from eagleserve.scheduler.waiting_queue import PriorityPolicy, WaitingQueue
from eagleserve.scheduler.warmup import warm_up, warm_up_needed
from eagleserve.spec.eagle_worker import EagleWorker

logger = logging.getLogger(__name__)

# Most tokens one prefill computes when chunking is off (a longer prompt runs alone).
MAX_PREFILL_TOKENS = 8192


class Scheduler:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.device = pick_device(args.device)
        self.model_path = resolve_model_path(args.model)
        self.model_config = ModelConfig.from_dir(self.model_path)
        tokenizer = load_tokenizer_in_background(self.model_path)  # while the model builds
        self.spec_config = args.spec_config
        self.request_seeds = RequestSeeds(args.random_seed)
        self.mixed_chunk = args.enable_mixed_chunk
        if self.mixed_chunk and self.spec_config is not None:  # its running requests verify
            raise ValueError("--enable-mixed-chunk does not run with speculative decoding")
        if self.mixed_chunk and args.enable_priority_scheduling:  # cli.check_values says why
            raise ValueError("--enable-mixed-chunk does not run with --enable-priority-scheduling")
        cfg = self.model_config
        # Speculation writes up to alloc_len positions past the committed length per step.
        self.alloc_len = self.spec_config.alloc_len_per_decode if self.spec_config else 1
        self.max_context_len = args.max_context_len(cfg.max_position_embeddings, self.device.type)
        runner = ModelRunner.from_args(
            args, cfg, self.model_path, self.device, self.max_context_len + 2 * self.alloc_len
        )
        self.worker: TargetWorker | EagleWorker = (
            TargetWorker(runner, args) if self.spec_config is None
            else EagleWorker(runner, self.spec_config, args)
        )  # fmt: skip
        self.req_to_token_pool = self.worker.req_to_token_pool
        self.kv_pool = self.worker.token_to_kv_pool
        self.prefix_cache = PrefixCache(
            self.req_to_token_pool, self.kv_pool, cfg.vocab_size, not args.disable_radix_cache
        )
        self.chunk_budget = ChunkBudget(
            args.prefill_chunk_size(self.device.type), args.dynamic_chunking(self.device.type)
        )
        # The request whose prefill goes on in the next prefill (chunked), and whether a decode
        # step runs before that chunk (decodes and chunks alternate).
        self.chunked_req: Req | None = None
        self.decode_turn = False
        self.tokenizer = tokenizer.result()
        self.stop_checker = StopChecker(self.tokenizer)
        self.eos_token_ids = eos_token_ids(cfg.eos_token_ids, self.tokenizer)
        self.constraints = ConstraintBuilder(self.tokenizer, cfg.vocab_size, self.eos_token_ids)
        self.waiting = WaitingQueue(PriorityPolicy(
            args.enable_priority_scheduling, args.schedule_low_priority_values_first,
            args.priority_scheduling_preemption_threshold,
        ))  # fmt: skip
        self.running_batch: ScheduleBatch | None = None
        self.pending_outputs: list[TokenOutput] = []
        # Overlap: the batch whose forward is in flight, and requests whose slots must outlive it.
        self.enable_overlap = args.overlap_schedule(self.device.type)
        self.forwarder: OverlapForwarder | None = None
        self.future_map: FutureMap | None = None
        if self.enable_overlap:
            self.future_map = FutureMap(args.max_running_requests, self.device)
            self.forwarder = OverlapForwarder(
                self.worker, self.future_map, self.device, self.spec_config is not None
            )
            if isinstance(w := self.worker, EagleWorker):
                head = w.drafter.head
                self.future_map.warm_up(w.spec.eagle_topk, head.hidden_size, w.runner.dtype)
        # The launched batch's requests, its result, and its request whose prefill goes on
        # (no token of that one is kept).
        self.inflight: tuple[list[Req], Future[GenerationBatchResult], Req | None] | None = None
        self.deferred_release: list[Req] = []
        self.num_retracted = self.generation_tokens = 0
        eagle = self.worker if isinstance(self.worker, EagleWorker) else None
        self.spec_stats = SpecStats(self.spec_config, eagle and eagle.drafter.acceptance_prior)
        if warm_up_needed(args, self.device):
            warm_up(self)

    # ---- admission -------------------------------------------------------------------------
    def add_request(self, msg: GenerateReqInput) -> None:
        params = msg.sampling_params
        bad = check_request(
            msg.input_ids, params, self.max_context_len, self.model_config.vocab_size
        )
        err = None if bad is None else bad.message
        if err is None and params.stop and self.tokenizer is None:
            err = "stop strings need a model with a tokenizer"
        if err is None and msg.priority and not self.waiting.policy.enabled:
            err = "a priority other than 0 needs priority scheduling (--enable-priority-scheduling)"
        constraint = None  # built here, on the scheduler thread (grammars cached per spec)
        if err is None:
            constraint, err = self.constraints.build(params)
        if err is not None:
            self.pending_outputs.append(
                TokenOutput(msg.rid, [], True, "error", error=err, error_code=400)
            )
            return
        seed = None if params.is_greedy else self.request_seeds.seed_for(params.seed)
        req = Req(msg.rid, list(msg.input_ids), params, self.eos_token_ids, sampling_seed=seed)
        req.constraint, req.priority, req.stream = constraint, msg.priority, msg.stream
        bound = self.args.max_queued_requests
        away = self.waiting.turned_away(req, bound)
        if away is not None:
            msg_full = f"the request queue is full (--max-queued-requests {bound})"
            self.pending_outputs.append(
                TokenOutput(away.rid, [], True, "error", error=msg_full, error_code=503)
            )
            if away is req:
                return
            self.waiting.remove(away)
        self.waiting.push(req)

    def abort_request(self, rid: str) -> None:
        running = self.running_batch.reqs if self.running_batch is not None else []
        req = next((r for r in self.waiting if r.rid == rid), None)
        if req is not None:
            self.waiting.remove(req)
        elif self.chunked_req is not None and self.chunked_req.rid == rid:  # prefill part-way
            req, self.chunked_req = self.chunked_req, None
        else:
            req = next((r for r in running if r.rid == rid), None)
            if req is None:
                return
        req.finish_reason = FinishReason.ABORT
        self.release(req)  # a waiting request holds no slots
        self.drop_finished_from_running()
        self.pending_outputs.append(make_output(req))

    # ---- the loop --------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running_batch or self.pending_outputs or self.inflight
                    or self.deferred_release or self.chunked_req)  # fmt: skip

    def step(self) -> list[TokenOutput]:
        """One iteration. With overlap: launch batch N+1, then process batch N's results."""
        batch = self.get_next_batch_to_run()
        prev, self.inflight = self.inflight, None
        if batch is not None:
            reqs = list(batch.reqs)  # the batch object changes (merge/filter) after launch
            partial = self.chunked_req if batch.mode == "extend" else None
            mode, tokens, t0 = batch.mode, sum(batch.extend_lens or ()), time.perf_counter()
            decode_rows = batch.decode_rows
            try:
                handle = self.run_batch(batch, partial)
            except Exception as exc:  # a faulty forward fails its own requests, nothing else
                self._fail_requests(reqs, exc)
                handle = None
            if handle is not None and batch.mode == "extend":
                self._merge_into_running(batch, partial)
            if isinstance(handle, Future):
                self.inflight = (reqs, handle, partial)
            elif handle is not None:  # it ran synchronously: its time is its cost
                self.chunk_budget.observe(mode, tokens, time.perf_counter() - t0, decode_rows)
                self.process_batch_result(reqs, handle, partial)
        if prev is not None:
            self._process_finished_forward(prev)
        if self.inflight is None:
            self._flush_deferred_release()
        outputs, self.pending_outputs = self.pending_outputs, []
        return outputs

    def _process_finished_forward(
        self, launched: tuple[list[Req], Future[GenerationBatchResult], Req | None]
    ) -> None:
        reqs, fut, partial = launched
        result, exc = OverlapForwarder.collect(fut)
        # Slots released while it ran are free now; those it fails wait for the next batch.
        self._flush_deferred_release()
        if exc is not None:
            self._fail_requests(reqs, exc)
        if result is not None:
            self.process_batch_result(reqs, result, partial)

    def finish_inflight(self) -> None:
        launched, self.inflight = self.inflight, None
        self._process_finished_forward(launched)

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        if self.mixed_chunk and self.running_batch is not None:
            return self._get_mixed_batch()
        # Between two chunks of a long prefill the running requests decode once.
        if not (self.decode_turn and self.running_batch is not None):
            batch = self.get_new_batch_prefill()
            if batch is not None:
                self.decode_turn = self.chunked_req is not None
                return batch
        self.decode_turn = False
        if self.running_batch is None:
            return None
        self.update_running_batch()
        return self.running_batch

    def _get_mixed_batch(self) -> ScheduleBatch | None:
        """The running requests' decode step, with the next prefill (a chunk or new prompts)
        as more rows of the same forward when there is one."""
        # The decode slots first: a shortage may send the part-way prefill back (before it is
        # in a batch); the prefill then keeps a next step's slots free for the running requests.
        self.update_running_batch()
        prefill = self.get_new_batch_prefill()
        running = self.running_batch
        if prefill is None or running is None:
            return prefill or running
        prefill.mix_with_running(running)
        return prefill

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked_req is None:
            return None
        budget = self.chunk_budget.tokens(self.running_batch is not None, MAX_PREFILL_TOKENS)
        if self.chunk_budget.dynamic:  # timed per rank under TP: rank 0's is every rank's
            budget = broadcast_object(budget)
        plan = self._plan_prefill(budget)
        while plan is None and preempt_for_waiting(self):
            plan = self._plan_prefill(budget)
        if plan is None:
            return None
        self.chunked_req = plan.chunked_req
        now = time.monotonic()
        for req in plan.reqs:  # queue time ends at the first prefill (a retraction keeps it)
            req.prefill_start_time = req.prefill_start_time or now
        batch = ScheduleBatch(reqs=plan.reqs, mode="extend", device=self.device)
        batch.prepare_for_extend(self.req_to_token_pool, self.kv_pool, plan.extend_lens)
        return batch

    def _plan_prefill(self, budget: int) -> PrefillPlan | None:
        return plan_prefill(
            self.waiting,
            self.chunked_req,
            self.running_batch.batch_size if self.running_batch else 0,
            self.args.max_running_requests,
            budget,
            self.chunk_budget.max_tokens is not None,
            self.worker.decode_slots_per_req,
            self.prefix_cache,
        )

    def update_running_batch(self) -> None:
        batch = retract_for_decode(self)
        if batch is not None:
            self.worker.prepare_for_decode(batch)

    def run_batch(
        self, batch: ScheduleBatch, partial: Req | None = None
    ) -> GenerationBatchResult | Future:
        """Launches `batch`; `partial` is its request whose prefill goes on (its token is
        thrown away, so it samples greedily)."""
        # The one refresh point of seq_lens_cpu/seq_lens_sum before a forward. With overlap and
        # EAGLE the new lengths come from the previous verify's publish (the host a bound).
        if self.future_map is not None and self.spec_config is not None:
            self.future_map.resolve_seq_lens_cpu(batch, self.spec_config.max_accept_len)
        if batch.seq_lens_sum is None:
            batch.refresh_seq_lens_cpu(sync=False)
        if isinstance(self.worker, EagleWorker):
            self.worker.plan_launch(batch, self.spec_stats.acceptance_ema, partial)
        # Built here, on the host batch, so the overlap forward's snapshot shares the cache.
        info = self.worker.runner.sampling_info(batch)
        if partial is not None:
            info.is_greedy[batch.reqs.index(partial)] = True
        # Per launch: a request whose prefill goes on commits no token (its matcher waits).
        vocab = self.model_config.vocab_size
        batch.constraint = BatchConstraint.of_reqs(batch.reqs, vocab, partial)
        if self.forwarder is not None:
            return self.forwarder.launch(batch)
        return self.worker.forward_batch_generation(batch)

    def _merge_into_running(self, batch: ScheduleBatch, partial: Req | None) -> None:
        """A prefilled batch joins the running batch; its next inputs are already set. A
        request whose prefill goes on stays out. A mixed batch holds the running requests
        too: it replaces the running batch."""
        if batch.decode_rows:
            self.running_batch = None
        if partial is not None:
            batch.filter_batch([i for i, r in enumerate(batch.reqs) if r is not partial])
            if batch.batch_size == 0:
                return
        batch.extend_to_decode()
        if self.running_batch is None:
            self.running_batch = batch
        else:
            self.running_batch.merge_batch(batch)

    def drop_finished_from_running(self) -> None:
        if (batch := self.running_batch) is None:
            return
        keep = [i for i, r in enumerate(batch.reqs) if not r.finished]
        if len(keep) < batch.batch_size:
            batch.filter_batch(keep)
        if batch.batch_size == 0:
            self.running_batch = None

    # ---- results ---------------------------------------------------------------------------
    def process_batch_result(
        self, reqs: list[Req], result: GenerationBatchResult, partial: Req | None = None
    ) -> None:
        outputs = self.pending_outputs
        rows = committed_rows(result)
        if result.tree_path is not None:
            commit_tree_paths_host(self.req_to_token_pool, reqs, result, partial)
        scored = {} if result.prompt_logprobs is None else dict(result.prompt_logprobs.per_row())
        for i, req in enumerate(reqs):
            # Finished or aborted while this batch ran, or part-way through its prefill.
            if req.finished or req is partial:
                continue
            req.prompt_logprobs = scored.get(i, req.prompt_logprobs)
            if req.sampling_params.max_new_tokens == 0:  # scored its prompt: nothing to add
                req.finish_reason = FinishReason.LENGTH
                outputs.append(make_output(req))
                self.release(req)
                continue
            toks, lp, top = rows[i]
            if result.num_drafts is not None:  # a speculative decode, k = 0 included
                self.spec_stats.count_verify(req, result.num_drafts, len(toks))
            want_lp = req.sampling_params.logprobs is not None
            self.generation_tokens += append_tokens(
                req, toks, self.stop_checker, lp if want_lp else None, top
            )
            # The newest token is the next step's input: its KV is not written yet.
            req.kv_committed_len = req.seq_len - 1
            if output_due(req, self.args.stream_interval, time.monotonic()):
                outputs.append(make_output(req))
            if req.finished:
                self.release(req)
        self.drop_finished_from_running()

    def _fail_requests(self, reqs: list[Req], exc: BaseException) -> None:
        logger.error("forward failed for requests %s: %r", [r.rid for r in reqs], exc, exc_info=exc)
        for req in reqs:
            req.kv_committed_len = 0  # what the forward wrote is not to be cached
            if req.finished:
                continue
            if req is self.chunked_req:
                self.chunked_req = None
            req.finish_reason = FinishReason.ERROR
            out = make_output(req)
            out.error, out.error_code = f"internal error in the engine: {exc!r}", 500
            self.pending_outputs.append(out)
            self.release(req)
        self.drop_finished_from_running()

    def release(self, req: Req) -> None:
        """Frees `req`'s KV and request slots, its cacheable prefix into the radix cache first;
        after the in-flight forward, which may still read or write them."""
        if req.req_pool_idx is None:
            return
        if self.inflight is not None:
            self.deferred_release.append(req)
            return
        self.prefix_cache.release(req, cache=True)

    def _flush_deferred_release(self) -> None:
        for req in self.deferred_release:
            if req.req_pool_idx is not None:
                self.prefix_cache.release(req, cache=True)
        self.deferred_release = []

    def stats(self) -> EngineStats:
        return engine_stats(self)

    def flush_cache(self, _: object = None) -> int | None:  # _: a TP follower's replay argument
        """Empties the prefix cache: the slots freed; None while requests queue or run."""
        return None if self.has_work() else self.prefix_cache.flush()

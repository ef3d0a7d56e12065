"""The scheduler: a waiting queue, a running decode batch, continuous batching, KV admission."""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from concurrent.futures import Future

import torch

from eagleserve.config import ModelConfig, ServerArgs
from eagleserve.core import FinishReason, GenerationBatchResult, Req, ScheduleBatch
from eagleserve.device import pick_device
from eagleserve.messages import EngineStats, GenerateReqInput, TokenOutput
from eagleserve.model.loader import load_tokenizer, resolve_model_path
from eagleserve.model.runner import ModelRunner
from eagleserve.model.sampler import SamplingInfo
from eagleserve.sampling_params import check_request
from eagleserve.scheduler.future_map import FutureMap
from eagleserve.scheduler.output_processor import (
    StopChecker,
    append_tokens,
    make_output,
)
from eagleserve.scheduler.overlap import OverlapForwarder
from eagleserve.scheduler.target_worker import TargetWorker
from eagleserve.spec.adaptive import ACCEPT_PRIOR, update_acceptance
from eagleserve.spec.eagle_worker import EagleWorker

logger = logging.getLogger(__name__)

MAX_PREFILL_TOKENS = 8192


class Scheduler:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.device = pick_device(args.device)
        self.model_path = resolve_model_path(args.model)
        self.model_config = ModelConfig.from_dir(self.model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        self.spec_config = args.spec_config
        cfg = self.model_config
        self.max_context_len = min(
            args.max_context_len or cfg.max_position_embeddings, args.kv_cache_tokens
        )
        # Speculation writes up to alloc_len positions past the committed length per step.
        self.alloc_len = self.spec_config.alloc_len_per_decode if self.spec_config else 1
        runner = ModelRunner.from_args(
            args, cfg, self.model_path, self.device, self.max_context_len + 2 * self.alloc_len
        )
        self.worker: TargetWorker | EagleWorker = (
            TargetWorker(runner, args)
            if self.spec_config is None
            else EagleWorker(runner, self.spec_config, args)
        )
        self.req_to_token_pool = self.worker.req_to_token_pool
        self.kv_pool = self.worker.token_to_kv_pool
        self.stop_checker = StopChecker(self.tokenizer)
        eos = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.waiting: deque[Req] = deque()
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
            if isinstance(self.worker, EagleWorker):
                self.future_map.warm_up(
                    self.worker.spec.eagle_topk,
                    self.worker.drafter.head.hidden_size,
                    self.worker.runner.dtype,
                )
        self.inflight: tuple[list[Req], Future[GenerationBatchResult]] | None = None
        self.deferred_release: list[Req] = []
        self.num_retracted = 0
        self.stats_verify_calls = 0
        self.stats_accepted_tokens = 0
        num_steps = self.spec_config.num_steps if self.spec_config else 0
        self.stats_accepted_per_position = [0] * num_steps
        self.stats_proposed_tokens = 0
        self.stats_iterations_per_num_drafts = [0] * (num_steps + 1 if num_steps else 0)
        # Engine-wide acceptance by depth: /metrics, and where a new request's own EMA starts.
        self.stats_acceptance_ema = [ACCEPT_PRIOR] * num_steps

    # ---- admission -------------------------------------------------------------------------
    def add_request(self, msg: GenerateReqInput) -> None:
        params = msg.sampling_params
        bad = check_request(
            msg.input_ids, params, self.max_context_len, self.model_config.vocab_size
        )
        err = None if bad is None else bad.message
        if err is None and params.stop and self.tokenizer is None:
            err = "stop strings need a model with a tokenizer"
        if err is not None:
            self.pending_outputs.append(
                TokenOutput(msg.rid, [], True, "error", error=err, error_code=400)
            )
            return
        gen = None
        if not params.is_greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(
                params.seed
                if params.seed is not None
                else int.from_bytes(os.urandom(8), "little") >> 1
            )
        self.waiting.append(
            Req(msg.rid, list(msg.input_ids), params, self.eos_token_ids, generator=gen)
        )

    def abort_request(self, rid: str) -> None:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish_reason = FinishReason.ABORT
                self.pending_outputs.append(make_output(req))
                return
        batch = self.running_batch
        if batch is None:
            return
        for req in batch.reqs:
            if req.rid == rid:
                req.finish_reason = FinishReason.ABORT
                self._release(req)
                self._drop_finished_from_running()
                self.pending_outputs.append(make_output(req))
                return

    # ---- the loop --------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(
            self.waiting
            or self.running_batch
            or self.pending_outputs
            or self.inflight
            or self.deferred_release
        )

    def step(self) -> list[TokenOutput]:
        """One iteration. With overlap: launch batch N+1, then process batch N's results."""
        batch = self.get_next_batch_to_run()
        prev, self.inflight = self.inflight, None
        if batch is not None:
            reqs = list(batch.reqs)  # the batch object changes (merge/filter) after launch
            try:
                handle = self.run_batch(batch)
            except Exception as exc:  # a faulty forward fails its own requests, nothing else
                self._fail_requests(reqs, exc)
                handle = None
            if handle is not None and batch.mode == "extend":
                self._merge_into_running(batch)
            if isinstance(handle, Future):
                self.inflight = (reqs, handle)
            elif handle is not None:
                self.process_batch_result(reqs, handle)
        if prev is not None:
            self._process_finished_forward(prev)
        if self.inflight is None:
            self._flush_deferred_release()
        outputs, self.pending_outputs = self.pending_outputs, []
        return outputs

    def _process_finished_forward(
        self, launched: tuple[list[Req], Future[GenerationBatchResult]]
    ) -> None:
        reqs, fut = launched
        exc = fut.exception()
        # Requests released while that forward ran may now give their slots back.
        self._flush_deferred_release()
        if exc is not None:
            self._fail_requests(reqs, exc)
        else:
            self.process_batch_result(reqs, fut.result())

    def _finish_inflight(self) -> None:
        launched, self.inflight = self.inflight, None
        self._process_finished_forward(launched)

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        batch = self.get_new_batch_prefill()
        if batch is not None:
            return batch
        if self.running_batch is None:
            return None
        self.update_running_batch()
        return self.running_batch

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        running = self.running_batch.batch_size if self.running_batch else 0
        # Keep room for one step of every running request so admission never forces a retract.
        free = self.kv_pool.available_size() - running * self.worker.decode_slots_per_req
        picked: list[Req] = []
        tokens = 0
        while self.waiting and running + len(picked) < self.args.max_running_requests:
            req = self.waiting[0]
            need = req.seq_len + self.worker.decode_slots_per_req
            if need > free or (picked and tokens + req.seq_len > MAX_PREFILL_TOKENS):
                break
            if self.req_to_token_pool.available_size() <= len(picked):
                break
            picked.append(self.waiting.popleft())
            free -= need
            tokens += req.seq_len
        if not picked:
            return None
        now = time.monotonic()
        for req in picked:  # queue time ends at the first prefill (a retraction keeps it)
            req.prefill_start_time = req.prefill_start_time or now
        batch = ScheduleBatch(reqs=picked, mode="extend", device=self.device)
        batch.prepare_for_extend(self.req_to_token_pool, self.kv_pool)
        return batch

    def update_running_batch(self) -> None:
        batch = self.running_batch
        assert batch is not None
        per_req = self.worker.decode_slots_per_req
        if self.kv_pool.available_size() < batch.batch_size * per_req and self.inflight:
            # Retraction needs exact host state: let the in-flight batch land first.
            self._finish_inflight()
            batch = self.running_batch
            if batch is None:
                return
        while self.kv_pool.available_size() < batch.batch_size * per_req and batch.batch_size > 1:
            req = batch.reqs[-1]
            logger.info("KV pool full: retracting request %s", req.rid)
            self._release(req)
            req.retract_count += 1
            self.num_retracted += 1
            batch.filter_batch(list(range(batch.batch_size - 1)))
            self.waiting.appendleft(req)
        self.worker.prepare_for_decode(batch)

    def run_batch(self, batch: ScheduleBatch) -> GenerationBatchResult | Future:
        # The one refresh point of seq_lens_cpu/seq_lens_sum before a forward. With overlap and
        # EAGLE the new lengths come from the previous verify's publish.
        if self.future_map is not None:
            self.future_map.resolve_seq_lens_cpu(batch)
        if batch.seq_lens_sum is None:
            batch.refresh_seq_lens_cpu(sync=False)
        if batch.mode == "decode" and isinstance(self.worker, EagleWorker):
            self.worker.plan_decode(batch, self.stats_acceptance_ema)
        # Built here, on the host batch, so the overlap forward's snapshot shares the cache.
        SamplingInfo.of_batch(batch, self.model_config.vocab_size)
        if self.forwarder is not None:
            return self.forwarder.launch(batch)
        return self.worker.forward_batch_generation(batch)

    def _merge_into_running(self, batch: ScheduleBatch) -> None:
        """A prefilled batch joins the running batch; its next inputs are already set."""
        batch.extend_to_decode()
        if self.running_batch is None:
            self.running_batch = batch
        else:
            self.running_batch.merge_batch(batch)

    def _drop_finished_from_running(self) -> None:
        batch = self.running_batch
        if batch is None:
            return
        keep = [i for i, r in enumerate(batch.reqs) if not r.finished]
        if len(keep) < batch.batch_size:
            batch.filter_batch(keep)
        if batch.batch_size == 0:
            self.running_batch = None

    # ---- results ---------------------------------------------------------------------------
    def process_batch_result(self, reqs: list[Req], result: GenerationBatchResult) -> None:
        outputs = self.pending_outputs
        next_ids = result.next_token_ids.tolist()
        accept = result.accept_lens.tolist() if result.accept_lens is not None else None
        lps = result.logprobs.tolist() if result.logprobs is not None else None
        tvals = result.top_logprob_vals.tolist() if result.top_logprob_vals is not None else None
        tids = result.top_logprob_ids.tolist() if result.top_logprob_ids is not None else None
        scored = {} if result.prompt_logprobs is None else {
            row: (lps, tops) for row, lps, tops in result.prompt_logprobs.per_row()
        }  # fmt: skip
        for i, req in enumerate(reqs):
            if req.finished:  # finished or aborted while this batch ran: drop its tokens
                continue
            req.prompt_logprobs = scored.get(i, req.prompt_logprobs)
            if req.sampling_params.max_new_tokens == 0:  # scored its prompt: nothing to add
                req.finish_reason = FinishReason.LENGTH
                outputs.append(make_output(req))
                self._release(req)
                continue
            if accept is None:
                toks, n = [next_ids[i]], 1
                lp = [lps[i]] if lps is not None else None
                top = [list(zip(tids[i], tvals[i]))] if tids is not None else None
            else:
                n = accept[i]
                toks = next_ids[i][:n]
                lp = lps[i][:n] if lps is not None else None
                top = [list(zip(tids[i][j], tvals[i][j])) for j in range(n)] if tids else None
                self._count_verify(req, result.num_drafts, n)
            want_lp = req.sampling_params.logprobs is not None
            append_tokens(req, toks, self.stop_checker, lp if want_lp else None, top)
            # The newest token is the next step's input: its KV is not written yet.
            req.kv_committed_len = req.seq_len - 1
            outputs.append(make_output(req))
            if req.finished:
                self._release(req)
        self._drop_finished_from_running()

    def _count_verify(self, req: Req, num_drafts: int | None, accepted: int) -> None:
        """Speculative statistics of one request's iteration; a k = 0 iteration (adaptive) is
        a plain decode and no verify."""
        k = len(self.stats_accepted_per_position) if num_drafts is None else num_drafts
        if self.stats_iterations_per_num_drafts:
            self.stats_iterations_per_num_drafts[k] += 1
        if k == 0:
            return
        if req.spec_alphas:
            update_acceptance(req.spec_alphas, k, accepted - 1)
        update_acceptance(self.stats_acceptance_ema, k, accepted - 1)
        req.spec_verify_ct += 1
        req.spec_accepted_tokens += accepted
        self.stats_verify_calls += 1
        self.stats_accepted_tokens += accepted
        spec = self.spec_config
        assert spec is not None
        self.stats_proposed_tokens += k if spec.is_chain else spec.num_draft_tokens - 1
        for d in range(min(accepted - 1, len(self.stats_accepted_per_position))):
            self.stats_accepted_per_position[d] += 1

    def _fail_requests(self, reqs: list[Req], exc: BaseException) -> None:
        logger.error("forward failed for requests %s: %r", [r.rid for r in reqs], exc, exc_info=exc)
        for req in reqs:
            if req.finished:
                continue
            req.finish_reason = FinishReason.ERROR
            out = make_output(req)
            out.error, out.error_code = f"internal error in the engine: {exc!r}", 500
            self.pending_outputs.append(out)
            self._release(req)
        self._drop_finished_from_running()

    def _release(self, req: Req) -> None:
        """Frees every KV slot and the request slot of `req`.

        With a forward in flight that may still read or write this request's slots, the
        release waits until that forward has finished.
        """
        if req.req_pool_idx is None:
            return
        if self.inflight is not None:
            self.deferred_release.append(req)
            return
        self._free_slots(req)

    def _flush_deferred_release(self) -> None:
        for req in self.deferred_release:
            self._free_slots(req)
        self.deferred_release = []

    def _free_slots(self, req: Req) -> None:
        if req.req_pool_idx is None:
            return
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_allocated_len]
        self.kv_pool.free(slots)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_allocated_len = 0
        req.kv_committed_len = 0

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.running_batch.batch_size if self.running_batch else 0,
            num_waiting=len(self.waiting),
            kv_used_tokens=self.kv_pool.size - self.kv_pool.available_size(),
            kv_total_tokens=self.kv_pool.size,
            num_retracted_total=self.num_retracted,
            spec_verify_calls_total=self.stats_verify_calls,
            spec_accepted_tokens_total=self.stats_accepted_tokens,
            spec_accepted_per_position=list(self.stats_accepted_per_position),
            spec_proposed_tokens_total=self.stats_proposed_tokens,
            spec_iterations_per_num_drafts=list(self.stats_iterations_per_num_drafts),
            spec_acceptance_ema=list(self.stats_acceptance_ema),
        )

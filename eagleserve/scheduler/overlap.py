"""The forward side of the overlap scheduler: batch N runs here while the host prepares N+1.

Inputs of N+1 that depend on N's results are futures: decode input ids are `-future_index`
placeholders, and with EAGLE the relay state (bonus token, top-k, hidden state, new seq lens)
goes through the FutureMap. The forward runs on one forward thread (and, on an accelerator,
on its own stream), so forwards execute in launch order and a batch's resolve always sees the
previous batch's stash. The forward thread returns once a batch's work and its result's copy to
the host are queued (not done), so on an accelerator it launches N+1 while N still runs; the
scheduler waits for N's copies in `collect`. Until then every tensor N was launched with stays
referenced (tests/scheduler/test_overlap_inputs.py): the scheduler's stream must not reuse a
block N's forward has yet to read.

Grammar masks are not futures: they need the committed tokens on the host, so a forward holding a
grammar request reads its tokens back and advances the matchers before it returns; the next
forward, prepared here before acceptance was known, computes its masks when it runs (after that
one, in launch order). See constrained/grammar.py for the invariant.
"""

from __future__ import annotations

import copy
import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from eagleserve.core import GenerationBatchResult, ScheduleBatch
from eagleserve.device import device_module
from eagleserve.scheduler.future_map import FutureMap
from eagleserve.scheduler.omp_spin import OVERLAP_SPIN_ENV, user_set_spin
from eagleserve.scheduler.target_worker import TargetWorker
from eagleserve.spec.eagle_worker import EagleWorker

logger = logging.getLogger(__name__)


class OverlapForwarder:
    def __init__(
        self,
        worker: TargetWorker | EagleWorker,
        future_map: FutureMap,
        device: torch.device,
        is_spec: bool,
    ) -> None:
        self.worker = worker
        self.future_map = future_map
        self.device = device
        self.is_spec = is_spec
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eagleserve-fwd")
        # Requests (by id) of the batch whose forward just failed: the batch launched after it
        # holds them too, before the scheduler has failed them (forward thread only).
        self.failed_reqs: set[int] = set()
        # The last two batches as they were launched (the forward replaces some of its
        # snapshot's tensors), so every tensor a forward reads stays referenced until its result
        # has been collected: the scheduler collects N after launching N+1, and `collect` waits
        # for the copies queued behind N's forward, so N's kernels are done when N+2 launches.
        # A tensor the scheduler made for N (input ids, slots, lengths) and dropped sooner goes
        # back to the pool of the scheduler's stream, which orders its reuse after that
        # stream's work only: the next batch's inputs could take the block and overwrite it
        # while N's forward, on the forward stream, has yet to read it (SGLang's overlap thread
        # keeps its last two batches for the same reason).
        self._launched: deque[ScheduleBatch] = deque(maxlen=2)
        mod = device_module(device) if device.type != "cpu" else None
        self.stream = mod.Stream() if mod is not None else None
        self._mod = mod
        if device.type == "cpu" and not user_set_spin():
            settings = " ".join(f"{k}={v}" for k, v in OVERLAP_SPIN_ENV.items())
            logger.warning(
                "overlap scheduler on a CPU without %s in the environment before torch was "
                "imported: libgomp shortens its spin-wait and decodes run about half as fast "
                "(eagleserve/scheduler/omp_spin.py; the server's engine process gets them)",
                settings,
            )

    def launch(self, batch: ScheduleBatch) -> Future[GenerationBatchResult]:
        """Submits `batch`, then rewrites the host batch's next inputs as futures."""
        snapshot = copy.copy(batch)  # the host mutates `batch` while the forward runs
        self._launched.append(copy.copy(batch))
        if self.is_spec:
            self.future_map.expect_publish()
        caller_stream = self._mod.current_stream() if self._mod is not None else None
        fut = self.executor.submit(self._run, snapshot, caller_stream)
        fi = FutureMap.alloc_future_indices(batch.req_pool_indices)
        batch.input_ids = FutureMap.placeholder_ids(fi)
        if self.is_spec:
            batch.future_indices = fi
            batch.spec_info = None
            # A verify decides its lengths; a prefill's are the batch's already, and a decode
            # without drafts commits one token each: the next launch need not wait for those.
            batch.lengths_in_flight = batch.mode == "decode" and not batch.without_drafts
            if batch.without_drafts:
                batch.add_one_token()
        return fut

    @staticmethod
    def collect(
        fut: Future[GenerationBatchResult],
    ) -> tuple[GenerationBatchResult | None, BaseException | None]:
        """A launched batch's host result, or the exception that failed it. The forward thread
        returns once its work is queued, so this waits for the result's copies too: a device
        fault surfaces here."""
        exc = fut.exception()
        if exc is not None:
            return None, exc
        result = fut.result()
        try:
            result.wait_host()
        except Exception as e:
            return None, e
        return result, None

    def _run(self, batch: ScheduleBatch, caller_stream: Any) -> GenerationBatchResult:
        if self.stream is None:
            return self._forward(batch)
        # Device-side barrier: inputs the host enqueued on its stream come first.
        self.stream.wait_stream(caller_stream)
        with self._mod.stream(self.stream):
            return self._forward(batch)

    @torch.inference_mode()
    def _forward(self, batch: ScheduleBatch) -> GenerationBatchResult:
        fm = self.future_map
        fi = FutureMap.alloc_future_indices(batch.req_pool_indices)
        start_seq_lens: torch.Tensor | None = None
        published = False

        def on_verified(b: ScheduleBatch) -> None:
            # The host may prepare N+1 once the new lengths are known, before draft extend.
            nonlocal published
            fm.stash(fi, b.input_ids, new_seq_lens=b.seq_lens)
            fm.publish()
            published = True

        # An adaptive decode without drafts leaves every request's draft seed in its row, and
        # runs on the lengths the host resolved.
        drafts = not batch.without_drafts
        failed, self.failed_reqs = self.failed_reqs, set()
        try:
            info = fm.resolve_future(batch, drafts)
            if info is not None:
                batch.spec_info = info
            if failed and isinstance(self.worker, EagleWorker):  # right after a failed forward
                lost = [i for i, r in enumerate(batch.reqs) if id(r) in failed]
                self.worker.forget_held_inputs(batch, lost)
            # The lengths it starts from: what a failed forward leaves for the next one. No copy:
            # workers assign new seq_lens tensors, never write into this one.
            start_seq_lens = batch.seq_lens
            if not self.is_spec:
                result = self.worker.forward_batch_generation(batch)
                fm.stash(fi, result.next_token_ids)
            else:
                result = self.worker.forward_batch_generation(batch, on_verified=on_verified)
                if drafts:
                    fm.stash_draft(fi, batch.spec_info)
        except BaseException:
            # The scheduler fails this batch's requests when it collects the result; until
            # then the next batch must neither wait forever for the publish nor read garbage.
            self.failed_reqs = {id(r) for r in batch.reqs}
            fm.stash_failed(fi, None if published else start_seq_lens)
            if self.is_spec and not published:
                fm.publish()
            raise
        return result.to_host()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True)

"""FutureMap: the device-side relay that lets the overlap scheduler run one iteration ahead.

While forward N is still running, the scheduler already builds batch N+1. Values that only
forward N knows (next tokens, bonus tokens, post-verify seq lens, the draft head's top-k and
hidden state) are therefore not put into batch N+1 directly: forward N *stashes* them into
buffers indexed by request slot, and forward N+1 *resolves* them from there, in stream order,
without the host ever waiting for them. Only `resolve_seq_lens_cpu` waits, for the previous
verify's `publish` call (the forward thread's, on the host), and makes the device wait for the
verify itself: the host takes a bound of the lengths, not the lengths.

Placeholder convention (invariants every producer/consumer relies on):
- Every buffer has `pool_size + 1` rows. The future index of request-pool slot `p` is `p + 1`
  (`alloc_future_indices`), so valid future indices are `1..pool_size` and row 0 is never a
  future. `batch.future_indices` always holds future indices, never raw pool slots.
- A decode input id that is not known yet is written as the placeholder `-future_index`, i.e.
  `-(req_pool_idx + 1)`, which is always <= -1. Real token ids are >= 0, so token id 0 is never
  mistaken for a placeholder and 0 is never a valid placeholder.
- Row 0 is the scratch row: the branch-free resolve `where(ids < 0, buf[(-ids).clamp(min=0)], ids)`
  reads row 0 for every real token (the value is discarded), and the debug poison writes row 0
  for them; nothing ever stashes into row 0, so it stays -1 and a future index of 0 trips the
  guard like any other unstashed slot.
- `output_tokens_buf` and `new_seq_lens_buf` start at -1 (and, with `debug_poison`, slots are
  reset to -1 right after they are consumed), so a slot read before anything stashed it shows
  up as a non-positive seq len and trips `torch._assert_async((seq_lens > 0).all())`.

`EAGLESERVE_DISABLE_COMPILE=1` (read at call time): `_gather_spec_extras` runs the eager
gathers, not the `torch.compile`d one (debugging, platforms without a working inductor).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from eagleserve.core import EagleDraftInput
from eagleserve.device import device_module
from eagleserve.scheduler.publish_counter import HostPublishCounter

if TYPE_CHECKING:
    from eagleserve.core import ScheduleBatch

DISABLE_COMPILE_ENV = "EAGLESERVE_DISABLE_COMPILE"

_GatherResult = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _gather_spec_extras_eager(
    indices: torch.Tensor,
    topk_p_buf: torch.Tensor,
    topk_index_buf: torch.Tensor,
    hidden_states_buf: torch.Tensor,
) -> _GatherResult:
    """The three row gathers at `indices` [bs]: -> [bs, topk], [bs, topk], [bs, h]."""
    return topk_p_buf[indices], topk_index_buf[indices], hidden_states_buf[indices]


# Created on first use: building the compiled wrapper imports dynamo/inductor, which must not
# slow down `import eagleserve`. Guarded by a lock because the forward thread may race the
# scheduler thread on the very first call.
_compiled_gather: Callable[..., _GatherResult] | None = None
_compile_lock = threading.Lock()


def _compile_disabled() -> bool:
    return os.environ.get(DISABLE_COMPILE_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def _get_compiled_gather() -> Callable[..., _GatherResult]:
    global _compiled_gather
    if _compiled_gather is None:
        with _compile_lock:
            if _compiled_gather is None:
                # combo_kernels fuses the three differently-shaped gathers horizontally into one
                # launch on GPUs (inductor otherwise emits one kernel per output).
                _compiled_gather = torch.compile(
                    _gather_spec_extras_eager, dynamic=True, options={"combo_kernels": True}
                )
    return _compiled_gather


def _mark_batch_dim_unbacked(indices: torch.Tensor) -> None:
    # dynamic=True still specializes sizes 0 and 1 (a backed symint gets a `== 1` guard), so
    # bs=1 would compile a second graph. An unbacked batch dim has no such guard: one graph
    # serves every bs >= 1 (bs == 0 never reaches the compiled path).
    from torch._dynamo import decorators

    mark = getattr(decorators, "mark_unbacked", None)
    if mark is not None:
        mark(indices, 0)
    else:  # older torch: at worst one extra graph for bs == 1
        torch._dynamo.mark_dynamic(indices, 0)


def _gather_spec_extras(
    indices: torch.Tensor,
    topk_p_buf: torch.Tensor,
    topk_index_buf: torch.Tensor,
    hidden_states_buf: torch.Tensor,
) -> _GatherResult:
    """Gathers rows `indices` [bs] of the draft relay buffers in one fused (compiled) kernel.

    Returns (topk_p [bs, topk], topk_index [bs, topk], hidden [bs, h]). Compiled lazily with
    `torch.compile(dynamic=True)`; one graph per (dtypes, topk) configuration, independent of
    bs. `EAGLESERVE_DISABLE_COMPILE=1` runs the eager gathers instead.
    """
    if _compile_disabled() or indices.numel() == 0:
        return _gather_spec_extras_eager(indices, topk_p_buf, topk_index_buf, hidden_states_buf)
    _mark_batch_dim_unbacked(indices)
    return _get_compiled_gather()(indices, topk_p_buf, topk_index_buf, hidden_states_buf)


class FutureMap:
    """Request-slot-indexed relay buffers for the overlap scheduler (see module docstring).

    Producer side (forward stream / forward thread): `stash`, `publish`.
    Consumer side: `resolve_future` (forward stream, no host sync) and `resolve_seq_lens_cpu`
    (scheduler thread, waits for the previous publish).
    """

    def __init__(self, pool_size: int, device: torch.device, *, debug_poison: bool = False):
        assert pool_size > 0
        self.pool_size = pool_size
        self.device = torch.device(device)
        # Poison (write -1 into) every slot right after it is consumed, so a second resolve of
        # the same slot without a stash in between trips the guards. Costs a few small kernels.
        self.debug_poison = debug_poison
        rows = pool_size + 1  # row 0 is the scratch row, never a future (module docstring)
        # -1 everywhere: an unstashed slot trips the `seq_lens > 0` guard.
        self.output_tokens_buf = torch.full((rows,), -1, dtype=torch.int64, device=self.device)
        self.new_seq_lens_buf = torch.full((rows,), -1, dtype=torch.int64, device=self.device)
        # Draft relay buffers: shapes/dtypes come with `warm_up` or the first `stash_draft`.
        self.topk_p_buf: torch.Tensor | None = None  # [rows, topk]
        self.topk_index_buf: torch.Tensor | None = None  # [rows, topk]
        self.hidden_states_buf: torch.Tensor | None = None  # [rows, h]
        # Set by the first stash with new_seq_lens (spec). Without spec the host tracks seq lens
        # itself and both seq-len resolves are no-ops.
        self.relays_seq_lens = False
        # Device event recorded by publish(); created lazily (no accelerator API is touched
        # unless a publish happens on a device that has events). None on CPU.
        self._publish_event: Any = None
        # Host-side publish count: the only mechanism on CPU, and on accelerators it makes
        # sure the event was recorded at all when publish() runs on another thread.
        self._host_publish = HostPublishCounter()

    # ---- mapping ---------------------------------------------------------------------------

    @staticmethod
    def alloc_future_indices(req_pool_indices: torch.Tensor) -> torch.Tensor:
        """Future index of each request slot: `req_pool_idx + 1` ([bs] int64, values >= 1)."""
        return req_pool_indices.to(torch.int64) + 1

    @staticmethod
    def placeholder_ids(future_indices: torch.Tensor) -> torch.Tensor:
        """Decode input ids that `resolve_future` replaces by the stashed tokens ([bs], <= -1)."""
        return -future_indices

    # ---- producer side ---------------------------------------------------------------------

    def stash(
        self,
        future_indices: torch.Tensor,
        output_tokens: torch.Tensor,
        new_seq_lens: torch.Tensor | None = None,
    ) -> None:
        """Writes this forward's tokens into the rows `future_indices` [bs] (device, in order).

        output_tokens [bs]: next token (no spec) or bonus token (spec). new_seq_lens [bs]:
        post-verify lengths (spec; the host reads them after `publish`).
        """
        if future_indices.numel() == 0:
            return  # idle batch: nothing to write
        idx = future_indices.to(self.device, torch.int64, non_blocking=True)
        self._copy_rows(self.output_tokens_buf, idx, output_tokens)
        if new_seq_lens is not None:
            self._copy_rows(self.new_seq_lens_buf, idx, new_seq_lens)
            self.relays_seq_lens = True

    def stash_draft(self, future_indices: torch.Tensor, info: EagleDraftInput) -> None:
        """Writes the draft extend's seed (top-k and feature) into the rows `future_indices`."""
        if future_indices.numel() == 0:
            return
        idx = future_indices.to(self.device, torch.int64, non_blocking=True)
        if self.topk_p_buf is None:
            self._alloc_draft_bufs(info.topk_p, info.topk_index, info.hidden_states)
        assert self.topk_p_buf is not None and self.topk_index_buf is not None
        assert self.hidden_states_buf is not None
        # A feature rounded on its way through the relay would change the next draft.
        assert info.hidden_states.dtype == self.hidden_states_buf.dtype, "warm_up dtype"
        self._copy_rows(self.topk_p_buf, idx, info.topk_p)
        self._copy_rows(self.topk_index_buf, idx, info.topk_index)
        self._copy_rows(self.hidden_states_buf, idx, info.hidden_states)

    def warm_up(self, topk: int, hidden_size: int, dtype: torch.dtype) -> None:
        """Allocates the draft relay buffers and compiles the gather before the first request
        (otherwise the first speculative decode after start-up pays the compile)."""
        dev = self.device
        self._alloc_draft_bufs(
            torch.empty(0, topk, device=dev),
            torch.empty(0, topk, dtype=torch.int64, device=dev),
            torch.empty(0, hidden_size, dtype=dtype, device=dev),
        )
        assert self.topk_p_buf is not None and self.topk_index_buf is not None
        assert self.hidden_states_buf is not None
        idx = torch.ones(2, dtype=torch.int64, device=dev)
        with torch.inference_mode():  # as the forward resolves (grad mode is a guard)
            _gather_spec_extras(idx, self.topk_p_buf, self.topk_index_buf, self.hidden_states_buf)

    def _alloc_draft_bufs(self, *samples: torch.Tensor) -> None:
        self.topk_p_buf, self.topk_index_buf, self.hidden_states_buf = (
            self._alloc_like_rows(t) for t in samples
        )

    def stash_failed(self, future_indices: torch.Tensor, seq_lens: torch.Tensor | None) -> None:
        """A forward raised: fills its rows with harmless values for the batch launched after it.

        That batch still holds the failed requests (the host learns of the failure only after
        launching it); their results are dropped, but its forward must not crash on them and so
        fail healthy requests too. Token 0 and zero drafts are valid inputs; `seq_lens` (the
        lengths the failed forward started from) stay within the slots the requests own.
        """
        if future_indices.numel() == 0:
            return
        idx = future_indices.to(self.device, torch.int64, non_blocking=True)
        self.output_tokens_buf.index_fill_(0, idx, 0)
        if seq_lens is not None:
            self._copy_rows(self.new_seq_lens_buf, idx, seq_lens)
        for buf in (self.topk_p_buf, self.topk_index_buf, self.hidden_states_buf):
            if buf is not None:
                buf.index_fill_(0, idx, 0)

    def _alloc_like_rows(self, sample: torch.Tensor) -> torch.Tensor:
        # [pool + 1, *row_shape]; -1 keeps unstashed rows recognisable in a debugger.
        shape = (self.pool_size + 1, *sample.shape[1:])
        return torch.full(shape, -1, dtype=sample.dtype, device=self.device)

    def _copy_rows(self, buf: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
        # index_copy_ needs equal dtypes and row shapes; a row-shape mismatch (e.g. a different
        # hidden size) raises here instead of corrupting the buffer.
        buf.index_copy_(0, idx, src.to(self.device, buf.dtype, non_blocking=True))

    def expect_publish(self) -> int:
        """Host side, before handing a forward that will `publish()` to another thread.

        Returns a ticket for `wait_published`. Not needed when publish() is called on the
        scheduler thread itself (single-threaded launch on an accelerator, or inline on CPU).
        """
        return self._host_publish.expect()

    def publish(self) -> None:
        """Marks everything stashed so far (notably new_seq_lens) as ready for the host.

        Accelerator: records a device event on the current stream (work is still in flight;
        `wait_published` synchronizes on it). CPU: the stash already ran, so the publish is
        purely host-side. In both cases the host counter is bumped last, so a waiter that sees
        the count also sees a recorded event.
        """
        if self.device.type != "cpu":
            if self._publish_event is None:
                # Device-agnostic: torch.Event maps to CUDA and HIP (device type "cuda") and
                # other accelerators; the CPU backend has no events, hence the branch.
                self._publish_event = torch.Event(device=self.device)
            self._publish_event.record()
        self._host_publish.done()

    def wait_published(
        self, ticket: int | None = None, timeout: float | None = None, on_device: bool = False
    ) -> None:
        """Host side: blocks until publish number `ticket` (default: the last one announced by
        `expect_publish`, else whatever was already recorded) has happened and, on an
        accelerator, until the device work before it finished; `on_device`: the current stream
        waits for that work instead, the host does not. Raises TimeoutError."""
        self._host_publish.wait(ticket, timeout)
        if self._publish_event is None:
            return
        if on_device:
            device_module(self.device).current_stream().wait_event(self._publish_event)
        else:
            self._publish_event.synchronize()

    @property
    def num_published(self) -> int:
        return self._host_publish.published

    # ---- consumer side ---------------------------------------------------------------------

    def resolve_future(self, batch: ScheduleBatch, drafts: bool = True) -> EagleDraftInput | None:
        """Forward side, before the model runs: replaces placeholders by stashed values.

        Runs entirely on the device in stream order (no host sync):
        - `batch.input_ids`: every negative id `-f` becomes `output_tokens_buf[f]` (the next or
          bonus token); other ids pass through, so extend tokens and decode placeholders can
          share a batch.
        - with draft buffers, `batch.future_indices` and `drafts`: returns the gathered
          draft seed (an adaptive k = 0 decode neither reads nor stashes it: future indices
          are request slots, so a seed waits in its row for the iteration that drafts).
        - once seq lens are relayed, for a batch that `drafts`: `batch.seq_lens =
          new_seq_lens_buf[future_indices]`, followed by an async guard that all are > 0
          (catches unstashed/poisoned slots). One that does not keeps the lengths the host
          launched it with: `resolve_seq_lens_cpu` made them current, the same values.
        """
        ids = batch.input_ids
        resolved_ids: torch.Tensor | None = None
        if ids is not None and ids.numel() > 0:
            # Branch-free: real ids read the scratch row 0 and discard it.
            gather_idx = (-ids).clamp(min=0)  # [num_tokens]
            resolved_ids = torch.where(ids < 0, self.output_tokens_buf[gather_idx], ids)
            batch.input_ids = resolved_ids

        fi = batch.future_indices
        info: EagleDraftInput | None = None
        if fi is not None and fi.numel() > 0:
            if self.topk_p_buf is not None and drafts:
                assert self.topk_index_buf is not None and self.hidden_states_buf is not None
                info = EagleDraftInput(
                    *_gather_spec_extras(
                        fi, self.topk_p_buf, self.topk_index_buf, self.hidden_states_buf
                    )
                )
            if self.relays_seq_lens and drafts:
                batch.seq_lens = self.new_seq_lens_buf[fi]
                # Every committed length is >= 1; -1 means the slot was never stashed (or was
                # already consumed, with debug_poison) - an ordering bug, not a data issue.
                torch._assert_async((batch.seq_lens > 0).all())

        if self.debug_poison:
            # All gathers above are enqueued before these writes (same stream / thread).
            if resolved_ids is not None:
                assert ids is not None
                torch._assert_async((resolved_ids >= 0).all())
                self.output_tokens_buf.index_fill_(0, (-ids).clamp(min=0), -1)
            if fi is not None and fi.numel() > 0:
                self._poison_rows(fi, drafts)
        return info

    def _poison_rows(self, fi: torch.Tensor, drafts: bool) -> None:
        seed = (self.topk_p_buf, self.topk_index_buf, self.hidden_states_buf)
        for buf in (self.output_tokens_buf, self.new_seq_lens_buf, *(seed if drafts else ())):
            if buf is not None:
                buf.index_fill_(0, fi, -1)

    def resolve_seq_lens_cpu(self, batch: ScheduleBatch, max_new: int) -> None:
        """Scheduler side: makes `batch.seq_lens` current (on the device) and
        `seq_lens_cpu`/`seq_lens_sum` a host bound of them, with no device sync.

        Returns at once (batch untouched) when `batch.future_indices is None` or the host
        already knows the lengths (`lengths_in_flight` is False: a prefill, or a decode without
        drafts). Otherwise waits for the forward thread to have published the previous verify
        (on the host), gathers `new_seq_lens_buf[future_indices]` behind that publish on the
        device, and bounds them on the host by each request's committed length (its results
        before that verify are processed) plus `max_new`, the most a verify commits. Without
        relayed seq lens (no spec) the batch stays untouched.
        """
        fi = batch.future_indices
        if fi is None or not batch.lengths_in_flight:
            return
        self.wait_published(on_device=True)
        batch.lengths_in_flight = False
        if not self.relays_seq_lens:
            return
        batch.seq_lens = self.new_seq_lens_buf[fi]
        if batch.reqs:
            bound = torch.tensor([r.kv_committed_len for r in batch.reqs]) + max_new
            batch.refresh_seq_lens_cpu(bound=bound)
        else:  # no requests to bound them by (a bare batch): the lengths themselves
            batch.refresh_seq_lens_cpu(sync=True)
        if self.device.type == "cpu":  # free to read there: a readable error, not the guard's
            seq_lens = batch.seq_lens.cpu()
            if seq_lens.numel() > 0 and int(seq_lens.min()) <= 0:
                raise RuntimeError(
                    "FutureMap.resolve_seq_lens_cpu: unstashed future slot(s) "
                    f"{fi.cpu()[seq_lens <= 0].tolist()} (seq lens {seq_lens.tolist()})"
                )

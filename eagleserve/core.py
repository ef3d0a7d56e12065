"""Shared nouns: requests and the schedule batch (sampling parameters: sampling_params.py).

Who fills what:
- `SamplingParams`: the caller (server or offline `Engine`), validated by `check_request`.
- `Req`: created by the scheduler from a `GenerateReqInput`; the scheduler owns its KV fields
  (`req_pool_idx`, `kv_committed_len`, `kv_allocated_len`); `output_ids` grow in result processing.
- `ScheduleBatch`: built by the scheduler; `seq_lens_cpu`/`seq_lens_sum` are recomputed only by
  `refresh_seq_lens_cpu` (producers set `seq_lens_sum = None`). `seq_lens_cpu` never reads the
  device: it is exact, or an upper bound right after a speculative verify whose lengths are
  still in flight; every host use of it (grid sizes, KV bounds) takes a bound.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from eagleserve.device import host_to, tensor_to
from eagleserve.messages import PromptScores
from eagleserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from eagleserve.mem_cache.kv_cache import ReqToTokenPool, TokenToKVPool

ForwardMode = Literal["extend", "decode", "draft", "verify"]


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    # Logprob of each output token and its top alternatives, when asked for.
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # The prompt's scores (messages.py PromptScores), from the prefill until the next output.
    prompt_logprobs: PromptScores | None = None
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None
    # KV bookkeeping (scheduler-owned). req_pool_idx is None while the request holds no slot.
    req_pool_idx: int | None = None
    kv_committed_len: int = 0  # positions whose KV is final
    kv_allocated_len: int = 0  # positions with a KV slot (>= committed; spec over-allocates)
    # Speculative stats: accepted tokens per verify step.
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    # Adaptive speculation: the request's verified drafts per depth, accepted and judged, aged
    # per iteration (spec/adaptive.py `request_acceptance`), and committed tokens whose head
    # extend is held back (spec/draft_lag.py).
    spec_hits: list[float] = field(default_factory=list)
    spec_trials: list[float] = field(default_factory=list)
    draft_lag: int = 0
    # A sampled request's noise seed (sampling/seeded_noise.py): its own, or drawn from the
    # OS's entropy at arrival. None for a greedy request.
    sampling_seed: int | None = None
    # The output constraint (grammar, allowed_token_ids, bad_words): constrained/
    # output_constraint.py OutputConstraint (None: any token).
    constraint: Any = None
    # Tokens already handed to the output stream (streaming sends the rest).
    num_sent_tokens: int = 0
    # Whether the client streams the answer (one that does not needs no output between its
    # first token and its end: scheduler/output_processor.py `output_due`), and the
    # time.monotonic() of the request's last output.
    stream: bool = False
    output_sent_time: float = 0.0
    retract_count: int = 0
    # Priority scheduling's value (scheduler/waiting_queue.py), and the request's place in
    # arrival order (-1 until the waiting queue numbers it; a retraction keeps it).
    priority: int = 0
    arrival_index: int = -1
    # Prompt tokens whose KV came from the prefix cache at admission (usage.cached_tokens).
    cached_tokens: int = 0
    # Monotonic times (engine process): arrival, first scheduled for a prefill (metrics).
    arrival_time: float = field(default_factory=time.monotonic)
    prefill_start_time: float | None = None

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ScheduleBatch:
    """One forward's worth of requests. Filled by the scheduler; read by the model runner."""

    reqs: list[Req]
    mode: ForwardMode
    device: torch.device
    # Device tensors, [bs] unless noted; filled by prepare_for_extend / prepare_for_decode.
    input_ids: torch.Tensor | None = None  # [num_tokens] int64
    req_pool_indices: torch.Tensor | None = None  # [bs] int64
    seq_lens: torch.Tensor | None = None  # [bs] int64, length *after* this forward's tokens
    out_cache_loc: torch.Tensor | None = None  # [num_tokens] int64 KV slots written
    # Extend only: tokens already cached and tokens computed now, per request (host lists).
    prefix_lens: list[int] | None = None
    extend_lens: list[int] | None = None
    # Extend only, [bs] int64: the prompt token after this forward's last one for a request
    # whose prefill goes on in a later chunk (the EAGLE head pairs it with the last feature),
    # -1 for one whose prefill ends here. None when every prefill ends here.
    next_prompt_ids: torch.Tensor | None = None
    # Extend only: the last `decode_rows` requests decode one token each (a mixed chunk, see
    # mix_with_running); the rows before them are prefilled.
    decode_rows: int = 0
    # Host mirror of seq_lens, exact or an upper bound (module docstring). Only
    # refresh_seq_lens_cpu recomputes these two.
    seq_lens_cpu: torch.Tensor | None = None
    seq_lens_sum: int | None = None
    # Speculative relay state (EagleDraftInput) carried between iterations; None without spec.
    spec_info: EagleDraftInput | None = None
    # Overlap: FutureMap slots whose values this batch's inputs will resolve from; and whether
    # the forward in flight decides its new lengths (a verify: the host mirror is stale until
    # that forward publishes them) rather than the host knowing them at launch.
    future_indices: torch.Tensor | None = None
    lengths_in_flight: bool = False
    # Adaptive speculation, set per decode iteration before launch: the chain length, and how
    # many held head inputs each request has (None: the configured chain, nothing held); per
    # prefill, 1 for a request whose prompt ends here (its last row's input is held).
    num_drafts: int | None = None
    draft_lags: list[int] | None = None
    # (the `reqs` it was built for, SamplingInfo) built by the scheduler before launch, reused
    # while the batch holds those same Req objects (sampling/sampler.py SamplingInfo.of_batch).
    sampling_info: tuple[tuple[Req, ...], Any] | None = None
    # The constrained/constraint_batch.py BatchConstraint of this launch (None: no constrained
    # row), built by the scheduler before each launch.
    constraint: Any = None

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def without_drafts(self) -> bool:
        """An adaptive decode that drafts nothing: one token per request, so its lengths are
        known when it launches."""
        return self.mode == "decode" and self.num_drafts == 0

    def add_one_token(self) -> None:
        """seq_lens, and their host mirror where known, count one more token per request."""
        assert self.seq_lens is not None
        self.seq_lens = self.seq_lens + 1
        if self.seq_lens_cpu is not None:
            self.seq_lens_cpu = self.seq_lens_cpu + 1
        self.seq_lens_sum = None

    def refresh_seq_lens_cpu(self, sync: bool = True, bound: torch.Tensor | None = None) -> None:
        """The one place that recomputes `seq_lens_cpu` and `seq_lens_sum`.

        `bound`: host lengths at least the device's (lengths a verify in flight decides), taken
        as they are. Else sync=True copies the device `seq_lens` to the host (a device sync);
        sync=False trusts `seq_lens_cpu` and recomputes only the sum.
        """
        if bound is not None:
            self.seq_lens_cpu = bound
        elif sync or self.seq_lens_cpu is None:
            assert self.seq_lens is not None
            self.seq_lens_cpu = self.seq_lens.to("cpu")
        self.seq_lens_sum = int(self.seq_lens_cpu.sum())

    def prepare_for_extend(
        self, req_to_token_pool: ReqToTokenPool, kv_pool: TokenToKVPool, extend_lens: list[int]
    ) -> None:
        """Request i computes extend_lens[i] tokens after its first kv_committed_len ones (a
        cached prefix, earlier chunks), reading those through req_to_token.

        Every request already has a request slot. A request whose positions lack KV slots gets
        them all now, also those of later chunks. The caller checked that enough are free.
        """
        assert self.mode == "extend"
        fills = [r.fill_ids for r in self.reqs]
        starts = [r.kv_committed_len for r in self.reqs]
        spans = []
        for req, fill in zip(self.reqs, fills):
            assert req.req_pool_idx is not None and req.kv_allocated_len <= len(fill)
            if req.kv_allocated_len < len(fill):
                spans.append((req.req_pool_idx, req.kv_allocated_len, len(fill)))
                req.kv_allocated_len = len(fill)
        if spans:
            slots = kv_pool.alloc_host(sum(end - start for _, start, end in spans))
            assert slots is not None, "prepare_for_extend: KV pool exhausted (caller must check)"
            req_to_token_pool.write_spans(spans, slots)
        ends = [s + n for s, n in zip(starts, extend_lens)]
        host = req_to_token_pool.req_to_token_host
        loc = torch.cat([host[r.req_pool_idx, s:e] for r, s, e in zip(self.reqs, starts, ends)])
        self.out_cache_loc = host_to(loc, self.device)
        for req, end in zip(self.reqs, ends):
            req.kv_committed_len = end
            req.draft_lag = 0  # a prefill runs the head over every token
        self.prefix_lens, self.extend_lens = starts, list(extend_lens)
        dev = self.device
        ids = [t for f, s, e in zip(fills, starts, ends) for t in f[s:e]]
        # Each copied to the device without waiting for the forward in flight (overlap).
        self.input_ids = tensor_to(ids, torch.long, dev)
        if any(e < len(f) for f, e in zip(fills, ends)):
            nxt = [f[e] if e < len(f) else -1 for f, e in zip(fills, ends)]
            self.next_prompt_ids = tensor_to(nxt, torch.long, dev)
        self.req_pool_indices = tensor_to([r.req_pool_idx for r in self.reqs], torch.long, dev)
        self.seq_lens_cpu = torch.tensor(ends, dtype=torch.long)
        self.seq_lens = host_to(self.seq_lens_cpu, dev)
        self.refresh_seq_lens_cpu(sync=False)

    def prepare_for_decode(self, req_to_token_pool: ReqToTokenPool, kv_pool: TokenToKVPool) -> None:
        """One new KV slot per request at position seq_lens; afterwards seq_lens counts it.

        `input_ids` already hold the last sampled token of each request (or its placeholder).
        """
        self.mode = "decode"
        slots = kv_pool.alloc_host(self.batch_size)
        assert slots is not None, "prepare_for_decode: KV pool exhausted (caller must retract)"
        # A target-only request holds slots up to its length: the new one goes at seq_len.
        spans = [(r.req_pool_idx, r.kv_allocated_len, r.kv_allocated_len + 1) for r in self.reqs]
        self.out_cache_loc = req_to_token_pool.write_spans(spans, slots)
        for req in self.reqs:
            req.kv_allocated_len += 1
        self.add_one_token()

    def mix_with_running(self, running: ScheduleBatch) -> None:
        """This prefill batch takes in `running`, a decode batch already prepared for its step
        (one new KV slot per request): each of its requests becomes one more extend row of one
        token after a prefix of seq_len - 1, so a chunk and the decodes run in one forward."""
        assert self.mode == "extend" and running.mode == "decode" and running.spec_info is None
        assert self.prefix_lens is not None and self.extend_lens is not None
        assert running.seq_lens_cpu is not None and self.seq_lens_cpu is not None
        n = running.batch_size
        self.reqs = self.reqs + running.reqs
        self.input_ids = torch.cat([self.input_ids, running.input_ids])
        self.out_cache_loc = torch.cat([self.out_cache_loc, running.out_cache_loc])
        self.req_pool_indices = torch.cat([self.req_pool_indices, running.req_pool_indices])
        self.prefix_lens = self.prefix_lens + (running.seq_lens_cpu - 1).tolist()
        self.extend_lens = self.extend_lens + [1] * n
        if self.next_prompt_ids is not None:
            done = torch.full((n,), -1, dtype=torch.long, device=self.device)
            self.next_prompt_ids = torch.cat([self.next_prompt_ids, done])
        self.seq_lens = torch.cat([self.seq_lens, running.seq_lens])
        self.seq_lens_cpu = torch.cat([self.seq_lens_cpu, running.seq_lens_cpu])
        self.decode_rows = n
        self.refresh_seq_lens_cpu(sync=False)

    def extend_to_decode(self) -> None:
        """A prefilled batch becomes a decode batch: its next inputs are already set."""
        self.mode = "decode"
        self.prefix_lens = self.extend_lens = None
        self.next_prompt_ids = None
        self.decode_rows = 0

    def filter_batch(self, keep: list[int]) -> None:
        """Keeps the requests at positions `keep` (a running batch between decode steps)."""
        idx = torch.tensor(keep, dtype=torch.long)
        self.reqs = [self.reqs[i] for i in keep]
        dev_idx = host_to(idx, self.device)  # a pageable copy would wait for the forward in flight
        self.req_pool_indices = self.req_pool_indices[dev_idx]
        self.seq_lens = self.seq_lens[dev_idx]
        self.input_ids = self.input_ids[dev_idx]
        if self.seq_lens_cpu is not None:
            self.seq_lens_cpu = self.seq_lens_cpu[idx]
        if self.future_indices is not None:
            self.future_indices = self.future_indices[dev_idx]
        if self.spec_info is not None:
            self.spec_info = self.spec_info.filter(dev_idx)
        self.seq_lens_sum = None

    def merge_batch(self, other: ScheduleBatch) -> None:
        self.reqs = self.reqs + other.reqs
        self.req_pool_indices = torch.cat([self.req_pool_indices, other.req_pool_indices])
        self.seq_lens = torch.cat([self.seq_lens, other.seq_lens])
        self.input_ids = torch.cat([self.input_ids, other.input_ids])
        if self.seq_lens_cpu is not None and other.seq_lens_cpu is not None:
            self.seq_lens_cpu = torch.cat([self.seq_lens_cpu, other.seq_lens_cpu])
        else:
            self.seq_lens_cpu = None
        if self.future_indices is not None or other.future_indices is not None:
            assert self.future_indices is not None and other.future_indices is not None
            self.future_indices = torch.cat([self.future_indices, other.future_indices])
        self.lengths_in_flight = self.lengths_in_flight or other.lengths_in_flight
        if self.spec_info is not None:
            self.spec_info = self.spec_info.merge(other.spec_info)
        self.seq_lens_sum = None


# Called by a speculative worker once a batch's new seq_lens and bonus tokens are set, before
# its draft extend: the overlap scheduler publishes the lengths there.
OnVerified = Callable[[ScheduleBatch], None]


@dataclass
class EagleDraftInput:
    """The speculative relay state one decode iteration hands the next, per request.

    Filled by the EAGLE worker after a draft extend; its rows follow `ScheduleBatch.reqs`.
    """

    topk_p: torch.Tensor  # [bs, topk] draft probabilities of the first draft tokens
    topk_index: torch.Tensor  # [bs, topk] their target-vocabulary ids
    hidden_states: torch.Tensor  # [bs, hidden] head feature fed to the next draft step

    def filter(self, idx: torch.Tensor) -> EagleDraftInput:
        return EagleDraftInput(self.topk_p[idx], self.topk_index[idx], self.hidden_states[idx])

    def merge(self, other: EagleDraftInput) -> EagleDraftInput:
        return EagleDraftInput(
            torch.cat([self.topk_p, other.topk_p]),
            torch.cat([self.topk_index, other.topk_index]),
            torch.cat([self.hidden_states, other.hidden_states]),
        )


@dataclass
class GenerationBatchResult:
    """What one forward iteration produced; device tensors until `to_host`."""

    next_token_ids: torch.Tensor  # [bs] int64, or [bs, stride] with speculation
    accept_lens: torch.Tensor | None = None  # [bs] tokens committed per request (spec only)
    logprobs: torch.Tensor | None = None  # [bs] or [bs, stride] logprob of each token
    top_logprob_vals: torch.Tensor | None = None  # [..., k]
    top_logprob_ids: torch.Tensor | None = None  # [..., k]
    num_drafts: int | None = None  # spec: draft tokens per request this iteration
    prompt_logprobs: Any = None  # a prefill's sampling/prompt_logprobs.py PromptLogprobs, if any
    # A tree verify: each row's accepted node per path step (-1 past its path) among its
    # `tree_nodes` nodes; the scheduler reorders the host's req_to_token rows as the device's.
    tree_path: torch.Tensor | None = None
    tree_nodes: int | None = None

    # On an accelerator, set by to_host(): fires once the host copies are complete.
    copy_done: torch.Event | None = None

    def to_host(self) -> GenerationBatchResult:
        """Host copies of the tensors, queued behind the forward that made them without waiting
        for it (pinned memory on an accelerator), so the overlap scheduler's forward thread can
        launch the next batch at once; readers call `wait_host()` first. (A prefill's prompt
        logprobs are copied synchronously.)"""
        device = self.next_token_ids.device
        accel = device.type != "cpu"

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or not accel:
                return t
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return out.copy_(t, non_blocking=True)

        result = GenerationBatchResult(
            host(self.next_token_ids),  # type: ignore[arg-type]
            host(self.accept_lens),
            host(self.logprobs),
            host(self.top_logprob_vals),
            host(self.top_logprob_ids),
            self.num_drafts,
            None if self.prompt_logprobs is None else self.prompt_logprobs.to_host(),
            host(self.tree_path),
            self.tree_nodes,
        )
        if accel:
            result.copy_done = torch.Event(device=device)
            result.copy_done.record()  # on the current (the forward's) stream
        return result

    def wait_host(self) -> None:
        """Blocks until to_host()'s copies are complete (a device fault surfaces here)."""
        if self.copy_done is not None:
            self.copy_done.synchronize()

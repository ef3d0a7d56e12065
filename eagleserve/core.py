"""Shared nouns: sampling parameters, requests, and the schedule batch.

Who fills what:
- `SamplingParams`: the caller (server or offline `Engine`), validated once by `validate()`.
- `Req`: created by the scheduler from a `GenerateReqInput`; the scheduler owns its KV fields
  (`req_pool_idx`, `kv_committed_len`, `kv_allocated_len`); `output_ids` grow in result processing.
- `ScheduleBatch`: built by the scheduler; `seq_lens_cpu`/`seq_lens_sum` are recomputed only by
  `refresh_seq_lens_cpu` (producers set `seq_lens_sum = None`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from eagleserve.model.kv_cache import ReqToTokenPool, TokenToKVPool

ForwardMode = Literal["extend", "decode", "draft", "verify"]

# torch.Generator.manual_seed takes a signed 64-bit value; seeds live in [0, 2^63).
SEED_BOUND = 2**63
# vLLM takes any positive repetition penalty. These bounds keep logit / penalty finite in fp32
# (a subnormal penalty rounds to 0 there); past them the effect is the same anyway.
MAX_REPETITION_PENALTY = 1e6
MIN_REPETITION_PENALTY = 1e-6


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token plus top-k
    # Logprobs of the prompt tokens (each given the ones before it) with the top-k, when set;
    # with max_new_tokens 0 the request only scores its prompt.
    prompt_logprobs: int | None = None
    # Penalties and bias (model/penalties.py): OpenAI's ranges; repetition as vLLM's.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # EOS and stop ids are masked, stop strings ignored, below this
    logit_bias: dict[int, float] = field(default_factory=dict)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler needs this request's token counts."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
            or self.min_tokens > 0
        )

    def validate(self, vocab_size: int = 0) -> str | None:
        """Returns an error message, or None when the parameters are usable (logit_bias keys
        are checked against `vocab_size` when it is known)."""
        scoring = self.prompt_logprobs is not None
        if self.max_new_tokens < 0 or (self.max_new_tokens == 0 and not scoring):
            return "max_tokens must be at least 1 (0 only to score the prompt)"
        if self.temperature < 0:
            return "temperature must be non-negative"
        if not (0.0 < self.top_p <= 1.0):
            return "top_p must be in (0, 1]"
        if self.top_k == 0 or self.top_k < -1:
            return "top_k must be -1 (disabled) or a positive integer"
        if not (0.0 <= self.min_p <= 1.0):
            return "min_p must be in [0, 1]"
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            return "logprobs must be between 0 and 20"
        if self.seed is not None and not (0 <= self.seed < SEED_BOUND):
            return f"seed must be in [0, {SEED_BOUND})"
        if scoring and not (0 <= self.prompt_logprobs <= 20):
            return "prompt logprobs must be between 0 and 20"
        return self._validate_penalties(vocab_size)

    def _validate_penalties(self, vocab_size: int) -> str | None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                return f"{name} must be between -2 and 2"
        if not (MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY):
            return (f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
                    f"{MAX_REPETITION_PENALTY}]")  # fmt: skip
        if not (0 <= self.min_tokens <= self.max_new_tokens):
            return "min_tokens must be between 0 and max_tokens"
        for token, bias in self.logit_bias.items():
            if token < 0 or (vocab_size and token >= vocab_size):
                return f"logit_bias keys must be token ids in [0, {vocab_size}), got {token}"
            if not (-100.0 <= bias <= 100.0):
                return "logit_bias values must be between -100 and 100"
        return None


@dataclass(frozen=True)
class RequestError:
    """Why a request cannot run: the message, the OpenAI request field it is about, a code."""

    message: str
    param: str | None = None
    code: str | None = None


def check_prompt(
    input_ids: Sequence[int], max_context_len: int, vocab_size: int, param: str = "prompt"
) -> RequestError | None:
    """The prompt alone: not empty, shorter than the context, token ids in the vocabulary."""
    n = len(input_ids)
    if n == 0:
        return RequestError("the prompt is empty", param)
    if n >= max_context_len:
        msg = (
            f"This model's maximum context length is {max_context_len} tokens; the prompt has {n}."
        )
        return RequestError(msg, param, "context_length_exceeded")
    if vocab_size and any(t < 0 or t >= vocab_size for t in input_ids):
        return RequestError(f"token ids must be in [0, {vocab_size})", param)
    return None


def check_budget(prompt_len: int, max_new_tokens: int, max_context_len: int) -> RequestError | None:
    """Prompt plus every token asked for must fit the context (no request is cut short)."""
    if prompt_len + max_new_tokens <= max_context_len:
        return None
    msg = (
        f"This model's maximum context length is {max_context_len} tokens; the prompt has "
        f"{prompt_len} and max_tokens is {max_new_tokens}."
    )
    return RequestError(msg, "max_tokens", "context_length_exceeded")


def check_request(
    input_ids: Sequence[int], params: SamplingParams, max_context_len: int, vocab_size: int
) -> RequestError | None:
    """The one validation of a request. The HTTP server runs these checks (as 400s) before the
    engine sees a request; the scheduler runs them again for the offline Engine and every other
    caller, so nothing invalid reaches a forward."""
    err = params.validate(vocab_size)
    if err is not None:
        return RequestError(err)
    return check_prompt(input_ids, max_context_len, vocab_size) or check_budget(
        len(input_ids), params.max_new_tokens, max_context_len
    )


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
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None
    # KV bookkeeping (scheduler-owned). req_pool_idx is None while the request holds no slot.
    req_pool_idx: int | None = None
    kv_committed_len: int = 0  # positions whose KV is final
    kv_allocated_len: int = 0  # positions with a KV slot (>= committed; spec over-allocates)
    # Speculative stats: accepted tokens per verify step.
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    # Adaptive speculation: acceptance EMA per draft depth, and committed tokens whose head
    # extend is held back (spec/draft_lag.py).
    spec_alphas: list[float] = field(default_factory=list)
    draft_lag: int = 0
    generator: torch.Generator | None = None
    # Tokens already handed to the output stream (streaming sends the rest).
    num_sent_tokens: int = 0
    retract_count: int = 0

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def check_invariants(self) -> None:
        assert 0 <= self.kv_committed_len <= self.kv_allocated_len, (
            self.kv_committed_len,
            self.kv_allocated_len,
        )
        assert self.kv_committed_len <= self.seq_len


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
    # Host mirror of seq_lens. Only refresh_seq_lens_cpu recomputes these two.
    seq_lens_cpu: torch.Tensor | None = None
    seq_lens_sum: int | None = None
    # Speculative relay state (EagleDraftInput) carried between iterations; None without spec.
    spec_info: EagleDraftInput | None = None
    # Overlap: FutureMap slots whose values this batch's inputs will resolve from.
    future_indices: torch.Tensor | None = None
    # Adaptive speculation, set per decode iteration before launch: the chain length, and how
    # many held head inputs each request has (None: the configured chain, nothing held).
    num_drafts: int | None = None
    draft_lags: list[int] | None = None
    # (ids of `reqs`, SamplingInfo) built by the scheduler before launch, reused while the
    # batch's membership is unchanged (model/sampler.py SamplingInfo.of_batch).
    sampling_info: tuple[tuple[int, ...], Any] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    def refresh_seq_lens_cpu(self, sync: bool = True) -> None:
        """The one place that recomputes `seq_lens_cpu` and `seq_lens_sum`.

        sync=True copies the device `seq_lens` to the host (a device sync); sync=False trusts
        `seq_lens_cpu` and recomputes only the sum.
        """
        if sync or self.seq_lens_cpu is None:
            assert self.seq_lens is not None
            self.seq_lens_cpu = self.seq_lens.to("cpu")
        self.seq_lens_sum = int(self.seq_lens_cpu.sum())

    def prepare_for_extend(self, req_to_token_pool: ReqToTokenPool, kv_pool: TokenToKVPool) -> None:
        """Gives every request a request slot and KV slots for all its tokens (no prefix cache).

        The caller checked that enough slots are free.
        """
        assert self.mode == "extend"
        fills = [r.fill_ids for r in self.reqs]
        self.extend_lens = [len(f) for f in fills]
        self.prefix_lens = [0] * len(fills)
        loc = kv_pool.alloc(sum(self.extend_lens))
        assert loc is not None, "prepare_for_extend: KV pool exhausted (caller must check)"
        start = 0
        for req, n in zip(self.reqs, self.extend_lens):
            if req.req_pool_idx is None:
                req.req_pool_idx = req_to_token_pool.alloc()
                assert req.req_pool_idx is not None
            req_to_token_pool.req_to_token[req.req_pool_idx, :n] = loc[start : start + n]
            req.kv_allocated_len = n
            req.kv_committed_len = n
            req.draft_lag = 0  # a prefill runs the head over every token
            start += n
        dev = self.device
        self.input_ids = torch.tensor([t for f in fills for t in f], dtype=torch.long, device=dev)
        self.out_cache_loc = loc
        self.req_pool_indices = torch.tensor(
            [r.req_pool_idx for r in self.reqs], dtype=torch.long, device=dev
        )
        self.seq_lens_cpu = torch.tensor(self.extend_lens, dtype=torch.long)
        self.seq_lens = self.seq_lens_cpu.to(dev)
        self.refresh_seq_lens_cpu(sync=False)

    def prepare_for_decode(self, req_to_token_pool: ReqToTokenPool, kv_pool: TokenToKVPool) -> None:
        """One new KV slot per request at position seq_lens; afterwards seq_lens counts it.

        `input_ids` already hold the last sampled token of each request (or its placeholder).
        """
        self.mode = "decode"
        loc = kv_pool.alloc(self.batch_size)
        assert loc is not None, "prepare_for_decode: KV pool exhausted (caller must retract)"
        req_to_token_pool.req_to_token[self.req_pool_indices, self.seq_lens] = loc
        for req in self.reqs:
            req.kv_allocated_len += 1
        self.out_cache_loc = loc
        self.seq_lens = self.seq_lens + 1
        if self.seq_lens_cpu is not None:
            self.seq_lens_cpu = self.seq_lens_cpu + 1
        self.seq_lens_sum = None

    def extend_to_decode(self) -> None:
        """A prefilled batch becomes a decode batch: its next inputs are already set."""
        self.mode = "decode"
        self.prefix_lens = self.extend_lens = None

    def filter_batch(self, keep: list[int]) -> None:
        """Keeps the requests at positions `keep` (a running batch between decode steps)."""
        idx = torch.tensor(keep, dtype=torch.long)
        self.reqs = [self.reqs[i] for i in keep]
        dev_idx = idx.to(self.device)
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

    def to_host(self) -> GenerationBatchResult:
        """Copies the tensors to the host (waits for the forward that made them)."""
        cpu = lambda t: None if t is None else t.to("cpu")
        return GenerationBatchResult(
            cpu(self.next_token_ids),
            cpu(self.accept_lens),
            cpu(self.logprobs),
            cpu(self.top_logprob_vals),
            cpu(self.top_logprob_ids),
            self.num_drafts,
        )

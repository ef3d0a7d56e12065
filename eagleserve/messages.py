"""Typed messages between the HTTP process and the engine process (and the offline Engine)."""

from __future__ import annotations

from dataclasses import dataclass, field

from eagleserve.sampling_params import SamplingParams


@dataclass
class GenerateReqInput:
    """Server -> engine: one sequence to generate (n > 1 is sent as n of these)."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    priority: int = 0  # with priority scheduling (scheduler/waiting_queue.py)


@dataclass
class AbortReq:
    """Server -> engine: drop a request (client gone); its KV slots are freed at once."""

    rid: str


@dataclass
class ShutdownReq:
    """Server -> engine: stop admitting, finish or abort in-flight work, then exit."""

    timeout_s: float = 30.0


@dataclass
class StatsReq:
    """Server -> engine: ask for an `EngineStats` reply."""


@dataclass
class FlushCacheReq:
    """Server -> engine: empty the prefix cache if nothing is queued or running; the engine
    answers with a `FlushCacheResult`."""


@dataclass
class FlushCacheResult:
    """Engine -> server: KV slots the flush freed, or None when requests were in the way."""

    freed_tokens: int | None


@dataclass
class ProfileReq:
    """Server -> engine: start (`start`) or stop the torch profiler (SGLang's and vLLM's
    /start_profile and /stop_profile); the engine answers with a `ProfileResult`.
    `num_steps`: stop by itself after that many scheduler steps."""

    start: bool
    output_dir: str | None = None
    num_steps: int | None = None
    activities: tuple[str, ...] = ("CPU", "GPU")
    record_shapes: bool = False
    with_stack: bool = False


@dataclass
class ProfileResult:
    """Engine -> server: whether the profiler did as asked, and why not; the trace file it
    writes (start) or wrote (stop)."""

    ok: bool
    message: str
    trace_path: str | None = None


@dataclass
class PromptScores:
    """A prompt's scores: each token's logprob given the tokens before it, its rank in that
    distribution (1: the most likely) and the top alternatives as (id, logprob); the first
    token has None, None and no alternatives."""

    logprobs: list[float | None]
    ranks: list[int | None]
    top: list[list[tuple[int, float]]]


@dataclass
class TokenOutput:
    """Engine -> server: new tokens of one request since its last TokenOutput."""

    rid: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # Per new token, when logprobs were asked for: its logprob and the top alternatives.
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # Once, with the first output after the prefill, when asked for: the prompt's scores.
    prompt_logprobs: PromptScores | None = None
    # Mean accepted tokens per verify step so far (speculative decoding), else None.
    spec_accept_length: float | None = None
    error: str | None = None
    error_code: int | None = None  # HTTP status to use when error is set
    # With the first output after the prefill: seconds waiting for it, and from its start to
    # this output (the prefill forward with its sampling).
    queue_time_s: float | None = None
    prefill_time_s: float | None = None


@dataclass
class BatchTokenOutput:
    outputs: list[TokenOutput] = field(default_factory=list)


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_used_tokens: int = 0  # held by requests (not free, not an unlocked cached prefix)
    kv_total_tokens: int = 0
    kv_cached_tokens: int = 0  # held by the prefix cache (radix tree)
    # Prompt tokens admitted, those of them found in the prefix cache, and slots evicted.
    prefix_cache_queried_tokens_total: int = 0
    prefix_cache_hit_tokens_total: int = 0
    prefix_cache_evicted_tokens_total: int = 0
    num_retracted_total: int = 0
    generation_tokens_total: int = 0  # output tokens committed (sent or not yet)
    spec_verify_calls_total: int = 0
    spec_accepted_tokens_total: int = 0
    # Accepted draft tokens at each draft depth (index 0 = first draft token).
    spec_accepted_per_position: list[int] = field(default_factory=list)
    # Draft tokens verified, and decode iterations by chain length k (index k; adaptive
    # speculation picks k per iteration, k = 0 being a plain decode).
    spec_proposed_tokens_total: int = 0
    spec_iterations_per_num_drafts: list[int] = field(default_factory=list)
    # Engine-wide acceptance at each depth given the earlier ones were accepted (an EMA).
    spec_acceptance_ema: list[float] = field(default_factory=list)
    # Structured output: grammars compiled (cache misses), their compile time, cache hits.
    grammar_compiles_total: int = 0
    grammar_compile_seconds_total: float = 0.0
    grammar_cache_hits_total: int = 0


@dataclass
class EngineReady:
    """Engine -> server, once: the model is loaded and the engine takes requests."""

    model_path: str
    max_context_len: int
    kv_total_tokens: int = 0
    vocab_size: int = 0
    device_name: str = ""  # "NVIDIA H200", or the CPU's model and core count


@dataclass
class EngineStartupError:
    """Engine -> server, instead of `EngineReady`: start-up failed; the engine then exits."""

    message: str
    traceback: str = ""

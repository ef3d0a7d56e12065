"""What a request asks for (`SamplingParams`) and the one validation of a request.

The HTTP server runs these checks (as 400s naming the field) before the engine sees a request;
the scheduler runs them again for the offline Engine and every other caller, so nothing invalid
reaches a forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

# Seeds live in [0, 2^63): nonnegative int64 on the device (sampling/seeded_noise.py).
SEED_BOUND = 2**63
# vLLM takes any positive repetition penalty. These bounds keep logit / penalty finite in fp32
# (a subnormal penalty rounds to 0 there); past them the effect is the same anyway.
MAX_REPETITION_PENALTY = 1e6
MIN_REPETITION_PENALTY = 1e-6
# vLLM's caps on bad_words: words, and their tokens in all (constrained/output_constraint.py).
MAX_BAD_WORDS = 128
MAX_BAD_WORD_TOKENS = 1024

GrammarKind = Literal["json_object", "json_schema", "regex", "ebnf", "structural_tag"]


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the output (constrained/grammar.py compiles it): `json_object` (any JSON
    object; `value` unused), `json_schema` (`value`: the schema as JSON text), `regex`, `ebnf`
    (xgrammar's EBNF, rule `root`), `structural_tag` (xgrammar's structural tag as JSON text:
    tool calls)."""

    kind: GrammarKind
    value: str = ""


@dataclass(frozen=True)
class ThinkingGate:
    """A reasoning model's output: `grammar` constrains only what follows its thinking, which
    ends at token `end_id` (`</think>`); `start_id` (`<think>`) where the output may open with
    it and thinks only then (Qwen3), None where it thinks from its first token (DeepSeek-R1)."""

    end_id: int
    start_id: int | None = None


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # the text keeps the stop string that ended it
    skip_special_tokens: bool = True  # the text leaves special tokens out (stop strings too)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token plus top-k
    # Logprobs of the prompt tokens (each given the ones before it) with the top-k, when set.
    # max_new_tokens 0: the request is prefilled and ends (it scores its prompt).
    prompt_logprobs: int | None = None
    # Penalties and bias (sampling/penalties.py): OpenAI's ranges; repetition as vLLM's.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # EOS and stop ids are masked, stop strings ignored, below this
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: GrammarSpec | None = None  # structured output (None: free text)
    thinking: ThinkingGate | None = None  # the grammar starts after the thinking (None: at once)
    # vLLM's: the only tokens the output may hold (None: any), and words it must not hold
    # (constrained/output_constraint.py).
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    # vLLM's: set, the request shares prefix-cache KV only with requests of the same salt.
    cache_salt: str | None = None

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

    def validate(self, vocab_size: int = 0) -> RequestError | None:
        """The first unusable parameter (its message names the API field), or None. logit_bias
        keys are checked against `vocab_size` when it is known."""
        checks: list[tuple[bool, str, str]] = [
            (self.max_new_tokens >= 0, "max_tokens must be non-negative", "max_tokens"),
            (self.temperature >= 0, "temperature must be non-negative", "temperature"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "top_p"),
            (self.top_k == -1 or self.top_k > 0,
             "top_k must be -1 (disabled) or a positive integer", "top_k"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", "min_p"),
            (self.logprobs is None or 0 <= self.logprobs <= 20,
             "logprobs must be between 0 and 20", "logprobs"),
            (self.seed is None or 0 <= self.seed < SEED_BOUND,
             f"seed must be in [0, {SEED_BOUND})", "seed"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             "logprobs must be between 0 and 20", "logprobs"),
            (-2.0 <= self.presence_penalty <= 2.0,
             "presence_penalty must be between -2 and 2", "presence_penalty"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             "frequency_penalty must be between -2 and 2", "frequency_penalty"),
            (MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
             f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
             f"{MAX_REPETITION_PENALTY}]", "repetition_penalty"),
            (0 <= self.min_tokens <= self.max_new_tokens,
             "min_tokens must be between 0 and max_tokens", "min_tokens"),
            # A completed grammar allows only EOS, which min_tokens would forbid.
            (self.grammar is None or self.min_tokens == 0,
             "min_tokens cannot be combined with structured output", "min_tokens"),
        ]  # fmt: skip
        for ok, message, param in checks:
            if not ok:
                return RequestError(message, param)
        if self.thinking is not None:
            gate = [self.thinking.end_id, self.thinking.start_id]
            if any(t is not None and (t < 0 or (vocab_size and t >= vocab_size)) for t in gate):
                return RequestError("the thinking's tags are no tokens of this model", "thinking")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                return RequestError("allowed_token_ids must not be empty", "allowed_token_ids")
            if any(t < 0 or (vocab_size and t >= vocab_size) for t in self.allowed_token_ids):
                msg = f"allowed_token_ids must be token ids in [0, {vocab_size})"
                return RequestError(msg, "allowed_token_ids")
        if self.cache_salt is not None and not self.cache_salt:
            return RequestError("cache_salt must be a non-empty string", "cache_salt")
        if any(not w.strip() for w in self.bad_words):
            return RequestError("bad_words must not be empty or only blanks", "bad_words")
        if len(self.bad_words) > MAX_BAD_WORDS:
            return RequestError(f"at most {MAX_BAD_WORDS} bad_words", "bad_words")
        for token, bias in self.logit_bias.items():
            if token < 0 or (vocab_size and token >= vocab_size):
                msg = f"logit_bias keys must be token ids in [0, {vocab_size}), got {token}"
                return RequestError(msg, "logit_bias")
            if not (-100.0 <= bias <= 100.0):
                return RequestError("logit_bias values must be between -100 and 100", "logit_bias")
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
        return err
    return check_prompt(input_ids, max_context_len, vocab_size) or check_budget(
        len(input_ids), params.max_new_tokens, max_context_len
    )

"""Which request fields eagleserve honours, and a 400 naming each one it cannot honour yet.

Invariant (issue #20): every field that would change the output is either used or answered with
a 400 whose `param` names it; none is dropped silently. Ranges are checked by pydantic in
protocol.py (so they show in the OpenAPI schema, as OpenAI's are) and by
`SamplingParams.validate`; this module rejects in-range values the engine does not implement:
the deprecated `functions`, `best_of` > n, `suffix`, non-text content, and vLLM's extensions
it does not implement (server/vllm_fields.py `REFUSED`). Each is accepted at its neutral
value, so clients that always send the defaults (e.g. `tools: []`) keep working.
"""

from __future__ import annotations

from eagleserve.server.beam_search import MAX_BEAM_WIDTH
from eagleserve.server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from eagleserve.server.serving import ApiError
from eagleserve.server.vllm_fields import REFUSED

UNSUPPORTED = "unsupported_parameter"

MAX_TOKEN_ID_DIGITS = 12  # longer keys are no token id (and int() of 4300+ digits raises)


def not_supported(param: str, accepted: str) -> ApiError:
    msg = f"{param} is not supported yet by this server; only {accepted} is accepted"
    return ApiError(400, msg, param, UNSUPPORTED)


def check_shared(body: _SamplingFields) -> ApiError | None:
    """The fields both endpoints share that are refused unless neutral (vLLM's, today)."""
    for name, neutral, accepted in REFUSED:
        if not neutral(getattr(body, name)):
            return not_supported(name, accepted)
    return None


def check_prompt_logprobs(body: _SamplingFields) -> ApiError | None:
    """vLLM's prompt_logprobs: 0..20 alternatives (vLLM's default max_logprobs), not streamed
    (vLLM refuses it with stream too)."""
    k = body.prompt_logprobs
    if k is None:
        return None
    if k == -1:
        return not_supported("prompt_logprobs", "0 to 20 (-1, the whole vocabulary, is not)")
    if not 0 <= k <= 20:
        return ApiError(400, "prompt_logprobs must be between 0 and 20", "prompt_logprobs")
    if body.stream:
        msg = "prompt_logprobs are not available when stream is true"
        return ApiError(400, msg, "prompt_logprobs")
    return None


# Fields beam search does not take (server/beam_search.py), and their neutral values (None
# and empty ones are neutral too).
NOT_WITH_BEAMS = {
    "stop": None, "stop_token_ids": None, "presence_penalty": 0, "frequency_penalty": 0,
    "repetition_penalty": 1, "min_tokens": 0, "logit_bias": None, "response_format": None,
    "regex": None, "ebnf": None, "json_schema": None, "guided_json": None, "guided_regex": None,
    "guided_choice": None, "guided_grammar": None, "structured_outputs": None,
    "allowed_token_ids": None, "bad_words": None, "prompt_logprobs": None,
}  # fmt: skip


def check_beam_search(body: _SamplingFields) -> ApiError | None:
    """vLLM's use_beam_search: n beams (at most MAX_BEAM_WIDTH), length_penalty; the fields
    that would change a sampled answer's tokens are refused with it."""
    if not body.use_beam_search:
        if body.length_penalty != 1.0:
            return ApiError(400, "length_penalty needs use_beam_search", "length_penalty")
        return None
    if body.n > MAX_BEAM_WIDTH:
        msg = f"use_beam_search takes n (the beam width) up to {MAX_BEAM_WIDTH}"
        return ApiError(400, msg, "n")
    for name, neutral in NOT_WITH_BEAMS.items():
        value = getattr(body, name)
        if value is None or value == neutral or value in ([], {}, ""):
            continue
        if name == "response_format" and value.type == "text":
            continue
        return ApiError(400, f"{name} cannot be combined with use_beam_search", name)
    return None


def check_logit_bias_keys(body: _SamplingFields) -> ApiError | None:
    """OpenAI's keys are token ids as strings (decimal digits); the vocabulary bound is checked
    with the other sampling parameters."""
    for key in body.logit_bias or {}:
        if not (key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS):
            shown = key if len(key) <= 20 else key[:20] + "..."
            return ApiError(400, f"logit_bias keys must be token ids, got {shown!r}", "logit_bias")
    return None


def check_completion(body: CompletionRequest) -> ApiError | None:
    if body.use_beam_search and body.echo:
        return ApiError(400, "echo cannot be combined with use_beam_search", "echo")
    if body.max_tokens == 0 and not body.echo:
        msg = "max_tokens 0 needs echo: it returns the prompt (with logprobs, its scores) only"
        return ApiError(400, msg, "max_tokens")
    if body.best_of is not None and body.best_of < body.n:
        return ApiError(400, f"best_of ({body.best_of}) must be at least n ({body.n})", "best_of")
    if body.best_of not in (None, 1, body.n):
        return not_supported("best_of", "1 or a value equal to n")
    if body.suffix:
        return not_supported("suffix", "an empty suffix")
    return None


def check_chat(body: ChatCompletionRequest) -> ApiError | None:
    if body.use_beam_search and body.tools:
        return ApiError(400, "tools cannot be combined with use_beam_search", "tools")
    if body.top_logprobs and not body.logprobs:
        msg = "top_logprobs needs logprobs set to true"  # as vLLM and OpenAI answer
        return ApiError(400, msg, "top_logprobs")
    if body.functions:
        return not_supported("functions", "an empty list (send tools instead)")
    if body.echo:
        return not_supported("echo", "false on chat completions")
    if body.function_call not in (None, "none", "auto"):
        return not_supported("function_call", '"none" (send tools and tool_choice instead)')
    for i, msg in enumerate(body.messages):
        for j, part in enumerate(msg.content if isinstance(msg.content, list) else []):
            if part.type != "text":
                param = f"messages.{i}.content.{j}.type"
                text = f"{param}: content parts of type {part.type!r} are not supported; "
                return ApiError(400, text + "this model reads text only", param, UNSUPPORTED)
    return None


def check_request(body: CompletionRequest | ChatCompletionRequest) -> ApiError | None:
    """The first field of `body` the server cannot honour, as a 400; None when all are fine."""
    err = (check_logit_bias_keys(body) or check_shared(body) or check_prompt_logprobs(body)
           or check_beam_search(body))  # fmt: skip
    if err is not None:
        return err
    if isinstance(body, CompletionRequest):
        return check_completion(body)
    return check_chat(body)

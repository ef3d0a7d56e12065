"""Which request fields eagleserve honours, and a 400 naming each one it cannot honour yet.

Invariant (issue #20): every field that would change the output is either used or answered with
a 400 whose `param` names it; none is dropped silently. Ranges are checked by pydantic in
protocol.py (so they show in the OpenAPI schema, as OpenAI's are) and by
`SamplingParams.validate`; this module rejects in-range values the engine does not implement:
structured output, tools, `best_of` > n, `suffix`, non-text content. Each is accepted at its
neutral value, so clients that always send the defaults (e.g. `tools: []`) keep working.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eagleserve.server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from eagleserve.server.serving import ApiError

UNSUPPORTED = "unsupported_parameter"

# (field, is-neutral test, what is accepted) for fields both endpoints share.
NEUTRAL: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("response_format", lambda v: v is None or v.type == "text", '{"type": "text"}'),
)
MAX_TOKEN_ID_DIGITS = 12  # longer keys are no token id (and int() of 4300+ digits raises)


def not_supported(param: str, accepted: str) -> ApiError:
    msg = f"{param} is not supported yet by this server; only {accepted} is accepted"
    return ApiError(400, msg, param, UNSUPPORTED)


def check_shared(body: _SamplingFields) -> ApiError | None:
    for name, neutral, accepted in NEUTRAL:
        if not neutral(getattr(body, name)):
            return not_supported(name, accepted)
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
    if body.top_logprobs and not body.logprobs:
        msg = "top_logprobs needs logprobs set to true"  # as vLLM and OpenAI answer
        return ApiError(400, msg, "top_logprobs")
    for name in ("tools", "functions"):
        if getattr(body, name):
            return not_supported(name, "an empty list (structured output comes later)")
    for name in ("tool_choice", "function_call"):
        if getattr(body, name) not in (None, "none", "auto"):
            return not_supported(name, '"none" (no tools are served)')
    for i, msg in enumerate(body.messages):
        if msg.tool_calls:  # the template would drop them: the model would not see the calls
            return not_supported(f"messages.{i}.tool_calls", "none (no tools are served)")
        for j, part in enumerate(msg.content if isinstance(msg.content, list) else []):
            if part.type != "text":
                param = f"messages.{i}.content.{j}.type"
                text = f"{param}: content parts of type {part.type!r} are not supported; "
                return ApiError(400, text + "this model reads text only", param, UNSUPPORTED)
    return None


def check_request(body: CompletionRequest | ChatCompletionRequest) -> ApiError | None:
    """The first field of `body` the server cannot honour, as a 400; None when all are fine."""
    err = check_logit_bias_keys(body) or check_shared(body)
    if err is not None:
        return err
    if isinstance(body, CompletionRequest):
        return check_completion(body)
    return check_chat(body)

"""The answer bodies of /v1/completions and /v1/chat/completions in OpenAI's formats, whole
and streamed, with the extensions vLLM and SGLang add (each sent only when asked for)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from eagleserve.server.protocol import now


def unasked() -> Any:
    """A field sent only when set: an extension (vLLM's, SGLang's), which OpenAI's own clients
    then never see, or a delta's part (the OpenAPI schema lists each)."""
    return Field(None, exclude_if=lambda v: v is None)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    spec_accept_length: float | None = unasked()  # mean accepted tokens per verify step


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of a prompt token's scores: the logprob, the rank (1: the most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's `prompt_logprobs` answer: per prompt token, None for the first, else {token id: entry}
# for the token itself and the top alternatives asked for.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = unasked()  # vLLM's, when asked for
    # vLLM's return_token_ids: the choice's prompt (a stream's first chunk) and its tokens.
    prompt_token_ids: list[int] | None = unasked()
    token_ids: list[int] | None = unasked()


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    """As OpenAI's: calls only when there are some; the thinking only where there is one."""

    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = unasked()  # OpenAI's: id, type, function
    reasoning_content: str | None = unasked()  # SGLang's and vLLM's, with --reasoning-parser


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = unasked()  # vLLM's return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = unasked()  # vLLM's, when asked for
    prompt_token_ids: list[int] | None = unasked()  # vLLM's return_token_ids


class ChatDelta(BaseModel):
    role: str | None = unasked()
    content: str | None = unasked()
    reasoning_content: str | None = unasked()
    tool_calls: list[dict[str, Any]] | None = unasked()  # each with its `index` among the calls


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = unasked()  # vLLM's return_token_ids: this chunk's


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = unasked()  # vLLM's return_token_ids: the first chunk's

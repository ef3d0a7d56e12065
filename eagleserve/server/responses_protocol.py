"""Bodies of OpenAI's Responses API (/v1/responses, server/responses.py): the request as
eagleserve reads it and the response object it answers with, in OpenAI's field names."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from eagleserve.server.answers import ChatTokenLogprob
from eagleserve.server.protocol import ReasoningEffort, _SamplingFields

# The `include` value that asks for the output text's logprobs (OpenAI's name).
INCLUDE_LOGPROBS = "message.output_text.logprobs"


def item_id(prefix: str) -> str:
    """An id in OpenAI's form for the Responses API's objects: resp_..., msg_..., fc_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ContentPart(BaseModel):
    """A part of an input message's content: `input_text`, or an earlier answer's
    `output_text` (anything else is a 400: the models read text)."""

    model_config = ConfigDict(extra="ignore")
    type: str
    text: str = ""


class InputItem(BaseModel):
    """One item of `input`: a message (`type` message, or none, with a role), a function call
    the model made earlier (`function_call`), or the output of one (`function_call_output`)."""

    model_config = ConfigDict(extra="ignore")
    type: str = "message"
    id: str | None = None  # a replayed output item's
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None


class TextFormat(BaseModel):
    """`text.format`: free text, any JSON object, or JSON following `schema`."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: Literal["low", "medium", "high"] | None = None


RESPONSES_EXAMPLES = [
    {"input": "Count to five.", "instructions": "Answer in one line.", "max_output_tokens": 16,
     "temperature": 0},
    {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}],
     "max_output_tokens": 8, "top_logprobs": 2, "include": [INCLUDE_LOGPROBS], "store": False},
]  # fmt: skip


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # summary's old name


class ResponsesRequest(_SamplingFields):
    """OpenAI's fields, and the sampling extensions the chat route takes (top_k, min_p,
    repetition_penalty, seed, stop, ...: server/protocol.py) through `extra_body`. Fields that
    would change the answer and are not served are 400s (responses.py `check_responses`)."""

    model_config = ConfigDict(json_schema_extra={"examples": RESPONSES_EXAMPLES})

    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool | None = None  # answered at once, run on (server/background.py)
    # `effort`: the chat template's reasoning_effort, as vLLM passes it; `summary`: taken, but
    # no summaries are made (a reasoning item's `summary` stays empty).
    reasoning: ReasoningConfig | None = None
    # auto: the oldest turns dropped where the conversation is over the context (else a 400).
    truncation: Literal["auto", "disabled"] | None = None
    # Refused unless neutral: no stored prompts or conversations.
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] | None = None


Status = Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Status
    content: list[OutputText]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """The thinking of a reasoning model (--reasoning-parser), before its message."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Status


class FunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Status


Item = ReasoningItem | OutputMessage | FunctionCall  # an output item


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """The response: its output items (an assistant message, function calls) and the settings
    it ran with, as OpenAI echoes them."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    reasoning: ReasoningConfig | None = None
    model: str
    output: list[Item] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool
    temperature: float | None = None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True

"""Request bodies in OpenAI's formats (completions, chat completions, /tokenize), the model list
and errors; the completions' answers are server/answers.py's."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from eagleserve.server.vllm_fields import VllmFields

MAX_N = 16


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage in every chunk


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")  # json_schema's payload (server/structured.py)
    type: Literal["text", "json_object", "json_schema", "structural_tag"]


Bias = Annotated[float, Field(ge=-100, le=100)]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class _SamplingFields(VllmFields):
    """Fields shared by both endpoints, vLLM's extensions among them (server/vllm_fields.py).
    Unknown fields (e.g. `user`) are accepted and ignored; the fields declared that change the
    output are either honoured or rejected with a 400 by `validation.check_request` (ranges
    here, as OpenAI's; supported values there)."""

    # No NaN / Infinity (Python's json writes them; 1e400 parses as inf): none may reach the
    # engine's sampling tensors.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    # Bounds are in the schema (clients and fuzzers see them); top_k 0 and -1 both mean off.
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)  # vLLM's extension
    min_tokens: int | None = Field(None, ge=0)  # vLLM's extension
    logit_bias: dict[str, Bias] | None = None
    response_format: ResponseFormat | None = None
    # SGLang's extensions (extra_body): output constraints (a regex, an EBNF with rule `root`,
    # a JSON schema as text), and the stop string kept in the text (vLLM's
    # include_stop_str_in_output).
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    no_stop_trim: bool = False

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        opts = self.stream_options
        return bool(opts and opts.include_usage and opts.continuous_usage_stats)


# Request examples in the OpenAPI document: clients see the fields used together, and the
# schema fuzzer (tests/reliability/test_fuzz.py) sends each of them first.
COMPLETION_EXAMPLES = [
    {"prompt": "1, 2, 3,", "max_tokens": 8, "temperature": 0, "logit_bias": {"11": -100},
     "presence_penalty": 0.5, "frequency_penalty": 1.0, "repetition_penalty": 1.2,
     "min_tokens": 4},
    {"prompt": "The capital of France is Paris.", "max_tokens": 0, "echo": True, "logprobs": 2},
    {"prompt": [5, 6, 7], "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0.8,
     "seed": 7, "frequency_penalty": -2, "logit_bias": {"5": 100}},
]  # fmt: skip
CHAT_EXAMPLES = [
    {"messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 12,
     "presence_penalty": 2, "repetition_penalty": 0.8, "logit_bias": {"0": -5}, "min_tokens": 3,
     "logprobs": True, "top_logprobs": 2},
]  # fmt: skip


class CompletionRequest(_SamplingFields):
    model_config = ConfigDict(json_schema_extra={"examples": COMPLETION_EXAMPLES})

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 with echo: score the prompt (else a 400)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    # vLLM's extension: a text prompt gets the tokenizer's special tokens (a BOS), as vLLM and
    # SGLang encode it.
    add_special_tokens: bool = True


class ChatContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "text"  # anything but "text" is a 400 (validation.py): the models read text
    text: str = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # earlier calls (server/tool_calls.py)
    tool_call_id: str | None = None  # a tool message's: the call it answers
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if p.type == "text")


class ChatCompletionRequest(_SamplingFields):
    model_config = ConfigDict(json_schema_extra={"examples": CHAT_EXAMPLES})

    messages: list[ChatMessage] = Field(min_length=1)  # in the schema, so fuzzers know too
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None  # the deprecated form of tools
    function_call: str | dict[str, Any] | None = None
    # vLLM's extension: the template's text holds the special tokens it wants; adding the
    # tokenizer's (a second BOS) only when asked.
    add_special_tokens: bool = False
    # vLLM's and SGLang's template controls: the assistant turn's header after the messages,
    # or the last (assistant) message left open to be continued; and the template's own
    # variables (e.g. a model's `enable_thinking`).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's; as vLLM, the chat template's `reasoning_effort` (a template that does not read
    # it renders as without it).
    reasoning_effort: ReasoningEffort | None = None
    echo: bool = False  # vLLM's: the last message in front of the answer (a 400: not served)
    # With --reasoning-parser: SGLang's switch for the thinking apart (false: all in content),
    # vLLM's for whether the thinking is sent at all (server/reasoning.py).
    separate_reasoning: bool = True
    include_reasoning: bool = True


# ---- /tokenize and /detokenize (vLLM's bodies) ------------------------------------------------


TOKENIZE_EXAMPLES = [
    {"prompt": "The capital of France is", "return_token_strs": True},
    {"messages": [{"role": "user", "content": "Count to five."}], "add_generation_prompt": True},
]  # fmt: skip


class TokenizeRequest(BaseModel):
    """Either `prompt` (a completion's text) or `messages` (a chat, rendered by the template
    with `tools` described in its system message, as /v1/chat/completions does)."""

    model_config = ConfigDict(extra="ignore", json_schema_extra={"examples": TOKENIZE_EXAMPLES})

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Default: as the endpoint the text is for encodes it (a prompt with the tokenizer's
    # special tokens, a chat's template text without them).
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- ids, models, errors ---------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "eagleserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


ERROR_TYPES = {
    400: "invalid_request_error",
    503: "service_unavailable",
}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    err_type = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    info = ErrorInfo(message=message, type=err_type, param=param, code=code)
    return ErrorResponse(error=info).model_dump()

"""A Responses API request (/v1/responses) as the chat completion it runs as: the input items
after a stored turn's conversation become chat messages, function tools and `text.format`
chat's tools and response_format; and the checks of the fields it cannot honour (400s).

Each request field that would change the answer is honoured or a 400 naming it: one answer
(`n` 1), text content only, function tools only. `reasoning.effort` is the chat template's
reasoning_effort, as vLLM passes it; a reasoning model's thinking is split by
--reasoning-parser. `truncation: "auto"` drops the oldest turns (server/responses.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from eagleserve.server.protocol import ChatCompletionRequest, ChatMessage, _SamplingFields
from eagleserve.server.responses_protocol import (
    INCLUDE_LOGPROBS,
    ContentPart,
    InputItem,
    ResponsesRequest,
    item_id,
)
from eagleserve.server.serving import ApiError
from eagleserve.server.validation import UNSUPPORTED, check_request, not_supported

TEXT_PARTS = ("input_text", "output_text")
# The id prefix of each item type's (OpenAI's), for items sent without an id.
ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                  "reasoning": "rs"}  # fmt: skip

# The chat request's fields taken as they are; the rest are the Responses API's own.
SHARED = frozenset(_SamplingFields.model_fields) - {"response_format"}


def check_responses(body: ResponsesRequest) -> ApiError | None:
    """The fields of the Responses API that are not served unless neutral."""
    if body.n != 1:
        return not_supported("n", "1 (a response has one answer)")
    if body.use_beam_search:
        return not_supported("use_beam_search", "false on /v1/responses")
    if body.response_format is not None:
        msg = "response_format is chat completions' field: send text.format"
        return ApiError(400, msg, "response_format")
    if body.prompt_logprobs is not None:
        return not_supported("prompt_logprobs", "null on /v1/responses")
    if body.return_token_ids:
        return not_supported("return_token_ids", "false on /v1/responses")
    if body.background and not body.store:
        return ApiError(400, "background responses are stored: send store true", "background")
    if body.prompt is not None:
        return not_supported("prompt", "null (no stored prompt templates)")
    if body.conversation is not None:
        return not_supported("conversation", "null (send previous_response_id)")
    if body.text is not None and body.text.verbosity is not None:
        return not_supported("text.verbosity", "null")
    return None


def part_text(parts: str | list[ContentPart] | None, param: str) -> str | ApiError:
    if parts is None or isinstance(parts, str):
        return parts or ""
    for j, p in enumerate(parts):
        if p.type not in TEXT_PARTS:
            msg = f"{param}.{j}.type: content parts of type {p.type!r} are not supported; "
            return ApiError(
                400, msg + "this model reads text only", f"{param}.{j}.type", UNSUPPORTED
            )
    return "".join(p.text for p in parts)


def item_message(
    item: InputItem, i: int, before: list[ChatMessage]
) -> ChatMessage | ApiError | None:
    """Input item i as a chat message; None for a function call merged into the assistant
    message before it (a turn's text and its parallel calls stay one turn, as the stored
    conversation holds them) and for an earlier reasoning item."""
    param = f"input.{i}"
    if item.type == "message":
        if item.role is None:
            return ApiError(400, f"{param}.role: a message needs a role", f"{param}.role")
        text = part_text(item.content, f"{param}.content")
        return text if isinstance(text, ApiError) else ChatMessage(role=item.role, content=text)
    if item.type == "function_call":
        if not (item.call_id and item.name):
            return ApiError(400, f"{param}: a function_call needs call_id and name", param)
        call = {
            "id": item.call_id,
            "type": "function",
            "function": {"name": item.name, "arguments": item.arguments or "{}"},
        }
        last = before[-1] if before else None
        if last is not None and last.role == "assistant":  # the same turn: its text, its calls
            last.tool_calls = [*(last.tool_calls or []), call]
            return None
        return ChatMessage(role="assistant", tool_calls=[call])
    if item.type == "reasoning":  # an earlier turn's thinking: templates leave it out
        return None
    if item.type == "function_call_output":
        if not item.call_id:
            return ApiError(400, f"{param}: a function_call_output needs call_id", param)
        text = part_text(item.output, f"{param}.output")
        return text if isinstance(text, ApiError) else ChatMessage(role="tool", content=text)
    msg = f"{param}.type: input items of type {item.type!r} are not supported; send messages "
    msg += "and function_call, function_call_output and reasoning items"
    return ApiError(400, msg, f"{param}.type", UNSUPPORTED)


def input_messages(body: ResponsesRequest) -> list[ChatMessage] | ApiError:
    """`input` as chat messages (a string: one user message)."""
    if isinstance(body.input, str):
        return [ChatMessage(role="user", content=body.input)]
    msgs: list[ChatMessage] = []
    for i, item in enumerate(body.input):
        msg = item_message(item, i, msgs)
        if isinstance(msg, ApiError):
            return msg
        if msg is not None:
            msgs.append(msg)
    return msgs


def listed_input_items(body: ResponsesRequest) -> tuple[dict[str, Any], ...]:
    """The request's `input` as OpenAI lists it back: items with ids (their own, or new ones), a
    string input one user message, a message's string content one text part."""
    items = body.input
    if isinstance(items, str):
        items = [InputItem(role="user", content=items)]
    listed = []
    for item in items:
        out = item.model_dump(exclude_none=True)
        out["id"] = item.id or item_id(ITEM_ID_PREFIX.get(item.type, "item"))
        if item.type == "message" and isinstance(item.content, str):
            part = "output_text" if item.role == "assistant" else "input_text"
            out["content"] = [{"type": part, "text": item.content}]
        listed.append(out)
    return tuple(listed)


def chat_tools(body: ResponsesRequest) -> list[dict[str, Any]] | ApiError:
    """Function tools (`{"type": "function", "name", "parameters", ...}`) in chat's form."""
    out = []
    for i, tool in enumerate(body.tools or []):
        if tool.get("type") != "function":
            msg = f"tools.{i}.type: only function tools are served, not {tool.get('type')!r}"
            return ApiError(400, msg, f"tools.{i}.type", UNSUPPORTED)
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None | ApiError:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        msg = 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}'
        return ApiError(400, msg, "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def chat_format(body: ResponsesRequest) -> dict[str, Any] | ApiError | None:
    """`text.format` as chat's response_format."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        return ApiError(400, "text.format.schema: json_schema needs a schema", "text.format.schema")
    return {
        "type": "json_schema",
        "json_schema": {
            "name": fmt.name or "response",
            "schema": fmt.schema_,
            "strict": fmt.strict,
        },
    }


def chat_request(
    body: ResponsesRequest, messages: list[ChatMessage]
) -> ChatCompletionRequest | ApiError:
    """The chat completion the response runs as."""
    if body.instructions:
        messages = [ChatMessage(role="system", content=body.instructions), *messages]
    if not messages:
        return ApiError(400, "input must not be empty", "input")
    tools, choice, fmt = chat_tools(body), chat_tool_choice(body.tool_choice), chat_format(body)
    for part in (tools, choice, fmt):
        if isinstance(part, ApiError):
            return part
    logprobs = INCLUDE_LOGPROBS in (body.include or [])
    data = {name: getattr(body, name) for name in SHARED}
    data.update(
        messages=messages,
        tools=tools or None,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=fmt,
        max_tokens=body.max_output_tokens,
        reasoning_effort=body.reasoning.effort if body.reasoning else None,
        logprobs=logprobs,
        top_logprobs=(body.top_logprobs or 0) if logprobs else None,
    )
    try:
        chat = ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:  # a value the chat route bounds (e.g. an empty message list)
        first = exc.errors(include_url=False)[0]
        return ApiError(400, f"{'.'.join(map(str, first['loc']))}: {first['msg']}")
    err = check_request(chat)
    return err if err is not None else chat

"""OpenAI's Responses API (`POST /v1/responses`) on the chat route's engine path: the input
items (after a stored earlier turn's conversation, with `previous_response_id`) become chat
messages, the answer becomes output items (an assistant message, function calls), and a
stream is the Responses API's typed events (`response.created` ... `response.completed`).
The request's conversion and checks are in server/responses_input.py, the response as it runs
in responses_run.py, its stream in responses_stream.py, a background one in background.py.
"""

from __future__ import annotations

import asyncio
import dataclasses

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from eagleserve.server.background import BackgroundResponses
from eagleserve.server.chat import chat_text, start_chat
from eagleserve.server.protocol import ChatCompletionRequest, ChatMessage
from eagleserve.server.respond import Endpoint, respond, stream_events
from eagleserve.server.response_store import ResponseStore
from eagleserve.server.responses_input import chat_request, check_responses, input_messages
from eagleserve.server.responses_protocol import ResponseObject, ResponsesRequest
from eagleserve.server.responses_run import ResponseRun
from eagleserve.server.responses_stream import ResponseStream
from eagleserve.server.serving import ApiError, Serving
from eagleserve.server.tool_calls import tool_setup

# The chat request's fields that the Responses API names otherwise.
RESPONSES_NAMES = {"response_format": "text.format", "max_tokens": "max_output_tokens",
                   "messages": "input"}  # fmt: skip


def as_responses_error(err: ApiError) -> ApiError:
    """A 400 of the chat request the response runs as, naming the Responses API's field."""
    head, dot, rest = (err.param or "").partition(".")
    name = RESPONSES_NAMES.get(head)
    if name is None:
        return err
    # A message's index counts the instructions and earlier turns: only `input` is named.
    param = name if head == "messages" else name + dot + rest
    return dataclasses.replace(err, param=param, message=err.message.replace(head, name, 1))


def auto_truncated(
    serving: Serving, body: ResponsesRequest, conversation: list[ChatMessage]
) -> ChatCompletionRequest | ApiError:
    """`truncation: "auto"`: the chat request of the conversation less as few of its oldest
    turns as let its prompt and max_output_tokens fit the context. As OpenAI drops input items
    in the middle: the instructions and leading system messages stay, and what is kept starts
    at a user message (the stored conversation keeps every turn)."""
    lead = 0
    while lead < len(conversation) and conversation[lead].role in ("system", "developer"):
        lead += 1
    room = serving.client.max_context_len - (body.max_output_tokens or 1)
    starts = [lead, *(i for i in range(lead + 1, len(conversation))
                      if conversation[i].role == "user")]  # fmt: skip
    for start in starts:
        chat = chat_request(body, [*conversation[:lead], *conversation[start:]])
        if isinstance(chat, ApiError):
            return chat
        tools = tool_setup(chat, serving.tool_format)
        if isinstance(tools, ApiError):
            return tools
        text = chat_text(serving.tokenizer, chat, tools, serving.tool_format)
        ids = text if isinstance(text, ApiError) else serving.encode(text, chat.add_special_tokens)
        if isinstance(ids, ApiError):
            return ids
        if len(ids) <= room:
            return chat
    return chat  # the last turn alone is over the context: a 400 as without truncation


async def create_response(
    serving: Serving,
    store: ResponseStore,
    background: BackgroundResponses,
    body: ResponsesRequest,
    request: Request,
) -> Response:
    err = check_responses(body)
    if err is not None:
        return err.response()
    if body.background and store.capacity <= 0:
        msg = "background responses are stored, and --responses-store-size is 0"
        return ApiError(400, msg, "background").response()
    history: tuple[ChatMessage, ...] = ()
    if body.previous_response_id is not None:
        prev = store.get(body.previous_response_id)
        if prev is None:
            msg = f"Previous response with id '{body.previous_response_id}' not found."
            return ApiError(
                400, msg, "previous_response_id", "previous_response_not_found"
            ).response()
        status = prev.response["status"]
        if status in ("queued", "in_progress", "failed"):
            msg = f"Previous response '{body.previous_response_id}' is {status}: no answer yet"
            return ApiError(400, msg, "previous_response_id").response()
        history = prev.conversation
    given = input_messages(body)
    if isinstance(given, ApiError):
        return given.response()
    conversation = [*history, *given]
    if body.truncation == "auto":  # renders and tokenizes: off the event loop
        chat = await asyncio.to_thread(auto_truncated, serving, body, conversation)
    else:
        chat = chat_request(body, conversation)
    if isinstance(chat, ApiError):
        return as_responses_error(chat).response()
    call = await start_chat(serving, chat, "responses")
    if isinstance(call, ApiError):
        return as_responses_error(call).response()
    run = ResponseRun(serving, body, call, conversation, body.store and store.capacity > 0)
    events = ResponseStream(run)

    def whole() -> ResponseObject:
        run.store_into(store)
        return run.finished()

    # No usage chunk: the final event's response holds the usage.
    endpoint = Endpoint(
        events.prelude,
        events.delta,
        lambda usage: "",
        whole,
        epilogue=lambda: events.epilogue(store),
        failure=events.failure,
    )
    if not run.background:
        return await respond(serving, request, call.reqs, call.tracker, body, endpoint)
    stream = serving.client.generate(call.reqs)
    sse = stream_events(stream, call.tracker, endpoint, include_usage=False)
    rids = [r.rid for r in call.reqs]
    background.start(run, rids, sse, lambda: call.tracker.close(stream))
    if body.stream:  # the client follows the kept events: its leaving ends nothing
        return StreamingResponse(background.follow(run.id, 0), media_type="text/event-stream")
    return JSONResponse(run.response("queued").model_dump())

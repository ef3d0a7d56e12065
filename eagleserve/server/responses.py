"""OpenAI's Responses API (`POST /v1/responses`) on the chat route's engine path: the input
items (after a stored earlier turn's conversation, with `previous_response_id`) become chat
messages, the answer becomes output items (an assistant message, function calls), and a
stream is the Responses API's typed events (`response.created` ... `response.completed`).
The request's conversion and checks are in server/responses_input.py.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from eagleserve.messages import TokenOutput
from eagleserve.server.background import BackgroundResponses
from eagleserve.server.chat import ChatCall, start_chat
from eagleserve.server.choices import ChoiceState, usage_of
from eagleserve.server.protocol import ChatMessage, now
from eagleserve.server.respond import Endpoint, respond, stream_events
from eagleserve.server.response_store import ResponseStore, StoredResponse
from eagleserve.server.responses_input import (
    chat_request,
    check_responses,
    input_messages,
    listed_input_items,
)
from eagleserve.server.responses_protocol import (
    FunctionCall,
    IncompleteDetails,
    InputTokensDetails,
    Item,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    Status,
    item_id,
)
from eagleserve.server.serving import ApiError, Serving

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


def status_of(reason: str | None) -> Status:
    if reason == "length":
        return "incomplete"
    return "cancelled" if reason == "abort" else "completed"


class ResponseRun:
    """One response's output items, object and stream events, from its chat call's choice."""

    def __init__(
        self,
        serving: Serving,
        body: ResponsesRequest,
        call: ChatCall,
        conversation: list[ChatMessage],
        stored: bool,
    ) -> None:
        self.body, self.call, self.conversation, self.stored = body, call, conversation, stored
        self.id, self.message_id, self.created = item_id("resp"), item_id("msg"), now()
        self.model = serving.model_name
        self.sequence = 0
        self._finished: ResponseObject | None = None
        self.error: ApiError | None = None
        # A background response is queued until its first output, and keeps its stream's
        # events (a client may read them again, from any point: server/background.py).
        self.background = bool(body.background)
        self.status: Status = "queued" if self.background else "in_progress"
        self.log: list[str] | None = [] if self.background and body.stream else None
        # Free text streams token by token into one message; tool calls and a reasoning
        # model's thinking are parsed whole, their items sent at the end.
        self.live = call.streams_text and call.reasoning is None

    @property
    def choice(self) -> ChoiceState:
        return self.call.tracker.ordered[0]

    def event(self, kind: str, **fields: Any) -> str:
        """One server-sent event, numbered in the stream's order."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        event = f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
        if self.log is not None:
            self.log.append(event)
        return event

    def logprobs(self, only_new: bool = False) -> list[Any] | None:
        if not self.call.body.logprobs:
            return None
        return self.choice.chat_logprobs(only_new=only_new).content or []

    def response(
        self,
        status: Status,
        output: list[Item] | None = None,
        error: ApiError | None = None,
    ) -> ResponseObject:
        body, usage = self.body, None
        if status not in ("queued", "in_progress"):
            u = usage_of(self.call.tracker.ordered)
            details = InputTokensDetails(cached_tokens=u.prompt_tokens_details.cached_tokens)
            usage = ResponseUsage(
                input_tokens=u.prompt_tokens,
                input_tokens_details=details,
                output_tokens=u.completion_tokens,
                total_tokens=u.total_tokens,
            )
        text = body.text.model_dump(by_alias=True) if body.text else {"format": {"type": "text"}}
        failed = (
            None if error is None else ResponseError(code="server_error", message=error.message)
        )
        cut = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        return ResponseObject(
            id=self.id,
            created_at=self.created,
            status=status,
            background=self.background,
            model=self.model,
            output=output or [],
            usage=usage,
            instructions=body.instructions,
            error=failed,
            incomplete_details=cut,
            max_output_tokens=body.max_output_tokens,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            previous_response_id=body.previous_response_id,
            store=self.stored,
            temperature=body.temperature,
            top_p=body.top_p,
            text=text,
            tool_choice=body.tool_choice if body.tool_choice is not None else "auto",
            tools=body.tools or [],
            top_logprobs=body.top_logprobs,
            user=body.user,
            metadata=body.metadata or {},
        )

    def finished(self) -> ResponseObject:
        """The finished response (made once: its function calls get their ids once)."""
        if self._finished is not None:
            return self._finished
        answer = self.call.answer(self.choice)
        content, calls = answer.content, answer.tool_calls
        status = status_of(self.choice.finish_reason)
        item_status: Status = "incomplete" if status == "incomplete" else "completed"
        output: list[Item] = []
        if answer.reasoning:
            thought = [ReasoningText(text=answer.reasoning)]
            output.append(ReasoningItem(id=item_id("rs"), content=thought, status=item_status))
        if content or not calls:
            text = OutputText(text=content or "", logprobs=self.logprobs())
            output.append(OutputMessage(id=self.message_id, status=item_status, content=[text]))
        output += [
            FunctionCall(
                id=item_id("fc"),
                call_id=c["id"],
                name=c["function"]["name"],
                arguments=c["function"]["arguments"],
                status=item_status,
            )
            for c in calls
        ]
        self._finished = self.response(status, output)
        self.status = status
        return self._finished

    def stored_entry(self) -> StoredResponse:
        """The response as kept now: failed, still queued or in progress (a background one;
        no answer to continue from yet), or finished, its answer after its conversation."""
        listed = listed_input_items(self.body)
        if self.error is not None or not self.choice.finished:
            now_ = self.response(self.status, error=self.error).model_dump()
            return StoredResponse(now_, tuple(self.conversation), listed)
        resp = self.finished()
        text = "".join(
            p.text for m in resp.output if isinstance(m, OutputMessage) for p in m.content
        )
        tool_calls = [
            {
                "id": f.call_id,
                "type": "function",
                "function": {"name": f.name, "arguments": f.arguments},
            }
            for f in resp.output
            if isinstance(f, FunctionCall)
        ]
        answer = ChatMessage(role="assistant", content=text or None, tool_calls=tool_calls or None)
        events = None if self.log is None else tuple(self.log)
        return StoredResponse(resp.model_dump(), (*self.conversation, answer), listed, events)

    def store_into(self, store: ResponseStore) -> None:
        """Keeps the response and its conversation for a later turn."""
        if self.stored:
            store.put(self.stored_entry())

    # ---- the stream ----

    def prelude(self) -> list[str]:
        created = self.response(self.status).model_dump()
        events = [self.event("response.created", response=created)]
        if self.background:  # in progress at its first output (`delta`)
            return [*events, self.event("response.queued", response=created)]
        return [*events, *self.started()]

    def started(self) -> list[str]:
        self.status = "in_progress"
        events = [
            self.event("response.in_progress", response=self.response("in_progress").model_dump())
        ]
        return [*events, *self.message_start()] if self.live else events

    def message_start(self) -> list[str]:
        item = OutputMessage(id=self.message_id, status="in_progress", content=[])
        part = OutputText(text="")
        return [
            self.event("response.output_item.added", output_index=0, item=item.model_dump()),
            self.event(
                "response.content_part.added",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                part=part.model_dump(exclude_none=True),
            ),
        ]

    def delta(self, c: ChoiceState, text: str, out: TokenOutput) -> str | None:
        started = self.started() if self.status == "queued" else []
        lp = self.logprobs(only_new=True) if self.live else None
        if not (self.live and (text or lp)):
            return "".join(started) or None
        return "".join(started) + self.event(
            "response.output_text.delta",
            item_id=self.message_id,
            output_index=0,
            content_index=0,
            delta=text,
            logprobs=[e.model_dump() for e in lp or []],
        )

    def item_events(self, index: int, item: Item) -> list[str]:
        """An output item's events after the added one (its text or arguments whole, except a
        streamed message's, whose deltas went before)."""
        if isinstance(item, FunctionCall):
            at = {"item_id": item.id, "output_index": index}
            return [
                self.event("response.function_call_arguments.delta", delta=item.arguments, **at),
                self.event("response.function_call_arguments.done", arguments=item.arguments, **at),
            ]
        if isinstance(item, ReasoningItem):
            thought = item.content[0].text
            at = {"item_id": item.id, "output_index": index, "content_index": 0}
            return [
                self.event("response.reasoning_text.delta", delta=thought, **at),
                self.event("response.reasoning_text.done", text=thought, **at),
            ]
        part = item.content[0]
        at = {"item_id": item.id, "output_index": index, "content_index": 0}
        lps = [e.model_dump() for e in part.logprobs or []]
        events = []
        if not self.live and part.text:
            events.append(
                self.event("response.output_text.delta", delta=part.text, logprobs=lps, **at)
            )
        return [
            *events,
            self.event("response.output_text.done", text=part.text, logprobs=lps, **at),
            self.event("response.content_part.done", part=part.model_dump(exclude_none=True), **at),
        ]

    def epilogue(self, store: ResponseStore) -> list[str]:
        resp = self.finished()
        events = []
        for index, item in enumerate(resp.output):
            if not self.live:
                started = item.model_copy(update={"status": "in_progress"})
                if isinstance(started, FunctionCall):
                    started.arguments = ""
                else:
                    started.content = []
                events.append(
                    self.event(
                        "response.output_item.added", output_index=index, item=started.model_dump()
                    )
                )
                if isinstance(item, OutputMessage):
                    part = OutputText(text="").model_dump(exclude_none=True)
                    events.append(
                        self.event(
                            "response.content_part.added",
                            item_id=item.id,
                            output_index=index,
                            content_index=0,
                            part=part,
                        )
                    )
            events += self.item_events(index, item)
            events.append(
                self.event("response.output_item.done", output_index=index, item=item.model_dump())
            )
        if not self.background:  # one is stored as it changes (server/background.py)
            self.store_into(store)
        # A cancelled response (/abort_request) ends as an incomplete one does: no answer whole.
        kind = "response.completed" if resp.status == "completed" else "response.incomplete"
        return [*events, self.event(kind, response=resp.model_dump())]

    def failure(self, err: ApiError) -> list[str]:
        self.error, self.status = err, "failed"
        return [
            self.event("response.failed", response=self.response("failed", error=err).model_dump())
        ]


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
    chat = chat_request(body, conversation)
    if isinstance(chat, ApiError):
        return as_responses_error(chat).response()
    call = await start_chat(serving, chat, "responses")
    if isinstance(call, ApiError):
        return as_responses_error(call).response()
    run = ResponseRun(serving, body, call, conversation, body.store and store.capacity > 0)

    def whole() -> ResponseObject:
        run.store_into(store)
        return run.finished()

    # No usage chunk: the final event's response holds the usage.
    endpoint = Endpoint(
        run.prelude,
        run.delta,
        lambda usage: "",
        whole,
        epilogue=lambda: run.epilogue(store),
        failure=run.failure,
    )
    if not run.background:
        return await respond(serving, request, call.reqs, call.tracker, body, endpoint)
    stream = serving.client.generate(call.reqs)
    events = stream_events(stream, call.tracker, endpoint, include_usage=False)
    rids = [r.rid for r in call.reqs]
    background.start(run, rids, events, lambda: call.tracker.close(stream))
    if body.stream:  # the client follows the kept events: its leaving ends nothing
        return StreamingResponse(background.follow(run.id, 0), media_type="text/event-stream")
    return JSONResponse(run.response("queued").model_dump())

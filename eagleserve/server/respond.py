"""What the generation handlers (OpenAI's two, SGLang's /generate) share: one JSON body or a
stream of server-sent events, the engine's requests aborted however the response ends."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from eagleserve.messages import GenerateReqInput, TokenOutput
from eagleserve.server.choices import ChoiceState, usage_of
from eagleserve.server.serving import (
    ApiError,
    OutputStream,
    Serving,
    Tracker,
    run_to_end,
    unless_client_leaves,
)

CLIENT_CLOSED = 499


class StreamOptions(Protocol):
    """What `respond` reads of a request body."""

    @property
    def stream(self) -> bool: ...

    @property
    def include_usage(self) -> bool: ...


class AbortingStreamingResponse(StreamingResponse):
    """Runs `on_close` however the response ends (finished, client gone, cancelled)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(obj: Any) -> str:
    data = obj.model_dump() if hasattr(obj, "model_dump") else obj
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


@dataclass
class Endpoint:
    """What differs between the handlers; `respond` is the path they share."""

    prelude: Callable[[], list[str]]  # SSE events before any token (echo, the role)
    delta: Callable[[ChoiceState, str, TokenOutput], str | None]  # new text -> an SSE event
    usage_event: Callable[[Any], str]  # the usage chunk of `stream_options.include_usage`
    whole: Callable[[], Any]  # the non-streamed response body (a pydantic model, or JSON data)
    # A stream's last events once every choice finished, and its events for a failure; None:
    # the chat completions form (the usage chunk asked for, then `[DONE]`; an error event,
    # then `[DONE]`). The Responses API ends its streams with events of its own.
    epilogue: Callable[[], list[str]] | None = None
    failure: Callable[[ApiError], list[str]] | None = None


async def stream_events(
    stream: AsyncIterable[TokenOutput], tracker: Tracker, endpoint: Endpoint, include_usage: bool
) -> AsyncIterator[str]:
    """A stream's server-sent events, from the prelude to [DONE] or the endpoint's epilogue
    (an engine fault or a cut at shutdown ends it with an error event first)."""
    for event in endpoint.prelude():
        yield event
    async for out in stream:
        c, text = tracker.feed(out)
        if tracker.error is not None:  # engine fault, engine gone, or cut at the drain
            if endpoint.failure is not None:
                for event in endpoint.failure(tracker.error):
                    yield event
                return
            yield sse(tracker.error.response_body())
            yield "data: [DONE]\n\n"
            return
        event = endpoint.delta(c, text, out)
        if event is not None:
            yield event
    tracker.done()
    if endpoint.epilogue is not None:
        for event in endpoint.epilogue():
            yield event
        return
    if include_usage:
        yield endpoint.usage_event(usage_of(tracker.ordered))
    yield "data: [DONE]\n\n"


async def respond(
    serving: Serving,
    request: Request,
    reqs: list[GenerateReqInput],
    tracker: Tracker,
    body: StreamOptions,
    endpoint: Endpoint,
    stream: OutputStream | None = None,
) -> Response:
    """Runs the requests; answers one JSON body, or a stream of events (`stream_events`)."""
    if stream is None:  # else the requests run in it (beam search)
        stream = serving.client.generate(reqs)
    if not body.stream:
        if not await run_to_end(request, stream, tracker):
            return Response(status_code=CLIENT_CLOSED)
        if tracker.error is not None:
            return tracker.error.response()
        whole = endpoint.whole()
        return JSONResponse(whole.model_dump() if isinstance(whole, BaseModel) else whole)

    # The status line waits for the first output: a request the engine turns away before it
    # starts (a full queue, a drain, an engine fault) is answered with its HTTP status, which
    # a balancer can retry elsewhere (deploy/nginx.conf retries a 503), not a 200 whose body
    # is one error event.
    first = await first_output(request, stream)
    if first is None:
        tracker.close(stream)
        return Response(status_code=CLIENT_CLOSED)
    if first.error is not None:
        tracker.feed(first)  # its metrics and log line
        tracker.close(stream)
        return ApiError(first.error_code or 500, first.error).response()
    events = stream_events(chained(first, stream), tracker, endpoint, body.include_usage)
    return AbortingStreamingResponse(events, lambda: tracker.close(stream))


async def first_output(request: Request, stream: OutputStream) -> TokenOutput | None:
    """The stream's first output; None if the client leaves first."""
    first = await unless_client_leaves(request, anext(stream))
    return None if first is None else first.result()


async def chained(first: TokenOutput, rest: OutputStream) -> AsyncIterator[TokenOutput]:
    yield first
    async for out in rest:
        yield out

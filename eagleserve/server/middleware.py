"""An ASGI middleware that knows which HTTP requests are in progress and how each one ended.

The drain on SIGTERM waits for `HttpStats.active` to reach 0: that covers requests still being
read or tokenized (not yet in the engine) as well as streams still being sent. Every response's
status code goes to `on_status` (the 4xx/5xx metrics).

A request's `X-Request-Id` header (a proxy's or a client's trace id) becomes its
`request.state.request_id`, which names its completion (`cmpl-ID`, `chatcmpl-ID`, as vLLM's);
with `--enable-request-id-headers` (vLLM's flag) every answer carries it back, a new one where
the request had none.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send


@dataclass
class HttpStats:
    active: int = 0  # requests entered and not yet answered to the end
    on_status: Callable[[str, int], None] | None = None  # (path, status) of each response


REQUEST_ID_HEADER = b"x-request-id"


class HttpTrackerMiddleware:
    def __init__(self, app: ASGIApp, stats: HttpStats, request_id_headers: bool = False) -> None:
        self.app = app
        self.stats = stats
        self.request_id_headers = request_id_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        stats = self.stats
        sent_id = dict(scope.get("headers", ())).get(REQUEST_ID_HEADER)
        request_id = sent_id.decode("latin-1") if sent_id else None
        if request_id is None and self.request_id_headers:
            request_id = uuid.uuid4().hex
        if request_id is not None:
            scope.setdefault("state", {})["request_id"] = request_id

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                if stats.on_status is not None:
                    stats.on_status(scope.get("path", ""), int(message["status"]))
                if self.request_id_headers and request_id is not None:
                    headers = [*message.get("headers", ()),
                               (REQUEST_ID_HEADER, request_id.encode("latin-1"))]  # fmt: skip
                    message = {**message, "headers": headers}
            await send(message)

        stats.active += 1
        try:
            await self.app(scope, receive, send_status)
        finally:
            stats.active -= 1

"""An ASGI middleware that knows which HTTP requests are in progress and how each one ended.

The drain on SIGTERM waits for `HttpStats.active` to reach 0: that covers requests still being
read or tokenized (not yet in the engine) as well as streams still being sent. Every response's
status code goes to `on_status` (the 4xx/5xx metrics).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send


@dataclass
class HttpStats:
    active: int = 0  # requests entered and not yet answered to the end
    on_status: Callable[[str, int], None] | None = None  # (path, status) of each response


class HttpTrackerMiddleware:
    def __init__(self, app: ASGIApp, stats: HttpStats) -> None:
        self.app = app
        self.stats = stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        stats = self.stats

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start" and stats.on_status is not None:
                stats.on_status(scope.get("path", ""), int(message["status"]))
            await send(message)

        stats.active += 1
        try:
            await self.app(scope, receive, send_status)
        finally:
            stats.active -= 1

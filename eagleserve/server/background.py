"""Background responses (OpenAI's `background: true` on /v1/responses): answered at once,
queued, then run in this process whatever the client does; read by polling `GET
/v1/responses/{id}` (queued until the first output, in progress, then finished), ended by
`POST /v1/responses/{id}/cancel`. A streamed one keeps its events, so a client that lost its
stream reads it again from any sequence number (`GET /v1/responses/{id}?stream=true
&starting_after=N`), while it runs and once it finished.

The entry in the response store is the truth a client reads: a run writes it when it starts,
whenever its status changes, and when it ends; a deleted run writes nothing more.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from eagleserve.server.engine_client import EngineClient
from eagleserve.server.response_store import ResponseStore, StoredResponse
from eagleserve.server.serving import ApiError

logger = logging.getLogger("eagleserve.server")


class BackgroundJob(Protocol):
    """What a background run reads of its response (responses.py `ResponseRun`)."""

    id: str
    status: str
    log: list[str] | None  # the stream's events so far; None: not streamed

    def stored_entry(self) -> StoredResponse: ...

    def fail(self, err: ApiError) -> None: ...


@dataclass
class BackgroundRun:
    job: BackgroundJob
    rids: list[str]  # its engine requests
    task: asyncio.Task[None] | None = None
    # Set (and replaced) at each new event and at the end: what followers of the stream wait on.
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    deleted: bool = False

    def wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", "response_id")


class BackgroundResponses:
    """The background responses still running, by id; finished ones live in the store only."""

    def __init__(self, store: ResponseStore, client: EngineClient) -> None:
        self.store, self.client = store, client
        self.runs: dict[str, BackgroundRun] = {}

    def start(
        self,
        job: BackgroundJob,
        rids: list[str],
        events: AsyncIterator[str],
        close: Callable[[], None],
    ) -> None:
        """Stores the queued response and runs `events` (the response's whole stream) to the
        end in a task of its own; `close` ends its engine requests however the task ends."""
        run = BackgroundRun(job, rids)
        self.runs[job.id] = run
        self.store.put(job.stored_entry())
        run.task = asyncio.create_task(self._drive(run, events, close))

    async def _drive(
        self, run: BackgroundRun, events: AsyncIterator[str], close: Callable[[], None]
    ) -> None:
        status = run.job.status
        try:
            async for _ in events:
                if run.job.status != status:
                    status = run.job.status
                    self._record(run)
                run.wake()
        except Exception as exc:  # a bug of ours: the response fails, the server goes on
            logger.exception("background response %s failed", run.job.id)
            run.job.fail(ApiError(500, f"{type(exc).__name__}: {exc}"))
        finally:
            close()
            del self.runs[run.job.id]
            self._record(run)
            run.wake()

    def _record(self, run: BackgroundRun) -> None:
        if not run.deleted:
            self.store.put(run.job.stored_entry())

    def stream(self, response_id: str, starting_after: int | None) -> AsyncIterator[str] | ApiError:
        """The stored stream's events after sequence number `starting_after` (all if None),
        then the live ones until it ends; or why there are none (404, 400)."""
        run = self.runs.get(response_id)
        entry = self.store.get(response_id)
        if run is None and entry is None:
            return not_found(response_id)
        streamed = run.job.log is not None if run is not None else entry.events is not None
        if not streamed:
            msg = "only a background response created with stream true can be streamed"
            return ApiError(400, msg, "stream")
        return self.follow(response_id, 0 if starting_after is None else starting_after + 1)

    async def follow(self, response_id: str, sent: int) -> AsyncIterator[str]:
        """The stream's events from sequence number `sent` on, live until it ends."""
        while True:
            run = self.runs.get(response_id)
            if run is None:  # finished (or deleted): what the store kept
                entry = self.store.get(response_id)
                for event in (entry.events or ())[sent:] if entry is not None else ():
                    yield event
                return
            changed, log = run.changed, run.job.log or []
            while sent < len(log):
                yield log[sent]
                sent += 1
            await changed.wait()

    async def cancel(self, response_id: str) -> dict[str, Any] | ApiError:
        """Ends a running background response (its answer so far kept, status cancelled);
        again, the cancelled response; any other response is a 400 (OpenAI's answers)."""
        run = self.runs.get(response_id)
        if run is None:
            entry = self.store.get(response_id)
            if entry is None:
                return not_found(response_id)
            status = entry.response["status"]
            if not entry.response.get("background"):
                return ApiError(400, "Cannot cancel a synchronous response.", "response_id")
            if status == "cancelled":
                return entry.response
            msg = f"Cannot cancel a response that is already {status}."
            return ApiError(400, msg, "response_id")
        await self._end(run)
        return run.job.stored_entry().response

    async def delete(self, response_id: str) -> bool:
        """Forgets a response, ending it first if it runs in the background."""
        run = self.runs.get(response_id)
        if run is not None:
            run.deleted = True
            await self._end(run)
        return self.store.delete(response_id)

    async def _end(self, run: BackgroundRun) -> None:
        for rid in run.rids:  # each gets a final output with finish reason abort
            self.client.abort_matching(rid)
        if run.task is not None:
            await asyncio.shield(run.task)

    async def close(self) -> None:
        """At shutdown: stops the runs left (the drain let them finish, or cut them)."""
        tasks = [r.task for r in self.runs.values() if r.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

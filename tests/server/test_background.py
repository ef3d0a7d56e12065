"""server/background.py's registry on its own (the HTTP path: test_responses_background.py): a
follower that starts at any sequence number, before or while the run makes its events, reads
exactly the events from there and ends with the run; a run whose event source raises is stored
as failed and the followers end (no hang)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

from eagleserve.server.background import BackgroundResponses
from eagleserve.server.response_store import ResponseStore, StoredResponse
from eagleserve.server.serving import ApiError


@dataclass
class Job:
    id: str
    status: str = "queued"
    log: list[str] | None = field(default_factory=list)
    error: ApiError | None = None

    def stored_entry(self) -> StoredResponse:  # as responses_run.py's: the events so far
        events = None if self.log is None else tuple(self.log)
        return StoredResponse({"id": self.id, "status": self.status, "background": True}, (),
                              events=events)  # fmt: skip

    def fail(self, err: ApiError) -> None:
        self.error, self.status = err, "failed"


async def source(job: Job, n: int, fail: bool) -> Any:
    """`n` events, made with pauses between them (as a stream's arrive)."""
    assert job.log is not None
    for i in range(n):
        await asyncio.sleep(random.uniform(0, 0.002))
        job.status = "in_progress"
        job.log.append(f"event {i}")
        yield job.log[-1]
    if fail:
        raise RuntimeError("boom")
    job.status = "completed"


async def follow_from(bg: BackgroundResponses, rid: str, after: int | None) -> list[str]:
    await asyncio.sleep(random.uniform(0, 0.01))  # some join late, some before the first event
    events = bg.stream(rid, after)
    assert not isinstance(events, ApiError)
    return [e async for e in events]


def test_followers_read_from_any_point_and_end_with_the_run() -> None:
    async def main(fail: bool) -> None:
        store = ResponseStore(16)
        bg = BackgroundResponses(store, client=None)  # type: ignore[arg-type]  # no cancels here
        job, n = Job(f"resp_{random.getrandbits(32)}"), random.randint(5, 40)
        bg.start(job, [], source(job, n, fail), lambda: None)
        starts = [None, *(random.randrange(-1, n + 2) for _ in range(6))]
        got = await asyncio.wait_for(
            asyncio.gather(*(follow_from(bg, job.id, s) for s in starts)), timeout=10
        )
        want = [f"event {i}" for i in range(n)]
        for s, events in zip(starts, got):
            assert events == want[0 if s is None else s + 1 :]
        entry = store.get(job.id)
        assert entry is not None and entry.response["status"] == ("failed" if fail else "completed")
        assert job.id not in bg.runs and (job.error is not None) == fail

    for fail in (False, True):
        asyncio.run(main(fail))

"""The host side of the FutureMap's publish: how many verifies the forward thread has published,
so the scheduler thread can wait for a given one."""

from __future__ import annotations

import threading


class HostPublishCounter:
    """Counts publishes so another thread can wait for a specific one (a threading.Event that
    can be re-armed without a clear/set race). `expect()`: the thread that hands a forward to
    the forward thread; `done()`: the forward thread at publish time. `wait(ticket)` returns
    once `ticket` publishes happened."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._expected = 0
        self._published = 0

    def expect(self) -> int:
        with self._cond:
            self._expected += 1
            return self._expected

    def done(self) -> None:
        with self._cond:
            self._published += 1
            self._cond.notify_all()

    def wait(self, ticket: int | None, timeout: float | None) -> None:
        with self._cond:
            target = self._expected if ticket is None else ticket
            if not self._cond.wait_for(lambda: self._published >= target, timeout=timeout):
                raise TimeoutError(
                    f"FutureMap: publish #{target} not reached after {timeout}s "
                    f"(published {self._published}); a forward that expect_publish() announced "
                    "never called publish()"
                )

    @property
    def published(self) -> int:
        with self._cond:
            return self._published

"""The waiting queue and priority scheduling (SGLang's `--enable-priority-scheduling`).

Requests are admitted in queue order. First come, first served by default; with priority
scheduling, by each request's `priority` (higher values first, as SGLang's default; lower values
first with `--schedule-low-priority-values-first`, vLLM's order), then by arrival. A request keeps
its arrival number when it is retracted, so it goes back ahead of those that came after it: in
first-come order that is the head of the queue, where a retraction has always put it.

Preemption: a waiting request that cannot start (no request slot, no KV memory) retracts the
running request ranked last, where it outranks that one by more than
`--priority-scheduling-preemption-threshold` (SGLang's rule and default). A retraction is lossless:
the request re-prefills from its cached positions and goes on with the same tokens.

A bounded queue (SGLang's `--max-queued-requests`): a request that arrives at a full queue is
turned away (503), unless priority scheduling is on and it outranks a waiting request that has
not started, which is turned away in its place. A retracted request is never turned away: part
of its answer is out already.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from eagleserve.core import Req


@dataclass(frozen=True)
class PriorityPolicy:
    """How requests are ordered: `enabled` false is first come, first served."""

    enabled: bool = False
    low_values_first: bool = False
    preemption_threshold: int = 10

    def rank(self, priority: int) -> int:
        """A priority's place in line: smaller ranks go first."""
        if not self.enabled:
            return 0
        return priority if self.low_values_first else -priority

    def queue_key(self, req: Req) -> tuple[int, int]:
        return self.rank(req.priority), req.arrival_index

    def outranks(self, incoming: Req, running: Req) -> bool:
        """Whether `incoming` may preempt `running`: it is ahead by more than the threshold."""
        gap = self.rank(running.priority) - self.rank(incoming.priority)
        return self.enabled and gap > self.preemption_threshold


def retraction_victim(running: Sequence[Req], policy: PriorityPolicy) -> Req | None:
    """The running request to retract first when memory runs short: the one ranked last (by
    priority when that is on), the newest among equals. None when nothing runs."""
    if not running:
        return None
    return max(running, key=policy.queue_key)


def preemption_victim(running: Sequence[Req], incoming: Req, policy: PriorityPolicy) -> Req | None:
    """The running request that `incoming`, which cannot start, retracts: the one ranked last,
    if `incoming` outranks it by more than the threshold; else None."""
    if not policy.enabled:  # checked each step a full batch leaves requests waiting
        return None
    victim = retraction_victim(running, policy)
    return victim if victim is not None and policy.outranks(incoming, victim) else None


class WaitingQueue:
    """The requests waiting for a prefill, kept in admission order (`policy.queue_key`)."""

    def __init__(self, policy: PriorityPolicy) -> None:
        self.policy = policy
        self._reqs: list[Req] = []
        self._next_arrival = 0

    def push(self, req: Req) -> None:
        """Queues a new request (numbered on its first arrival) or a retracted one."""
        if req.arrival_index < 0:
            req.arrival_index = self._next_arrival
            self._next_arrival += 1
        bisect.insort(self._reqs, req, key=self.policy.queue_key)

    def turned_away(self, incoming: Req, capacity: int | None) -> Req | None:
        """The request a queue of at most `capacity` turns away when `incoming` arrives (it,
        or the waiting request it replaces); None while there is room."""
        if capacity is None or len(self._reqs) < capacity:
            return None
        fresh = [r for r in self._reqs if not r.retract_count]
        if self.policy.enabled and fresh:
            last = max(fresh, key=self.policy.queue_key)
            if self.policy.rank(incoming.priority) < self.policy.rank(last.priority):
                return last
        return incoming

    def popleft(self) -> Req:
        return self._reqs.pop(0)

    def remove(self, req: Req) -> None:
        del self._reqs[next(i for i, r in enumerate(self._reqs) if r is req)]

    def __getitem__(self, i: int) -> Req:
        return self._reqs[i]

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Req]:
        return iter(self._reqs)

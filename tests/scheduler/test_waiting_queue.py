"""The waiting queue's order and the choice of whom to retract or preempt (scheduler/
waiting_queue.py), on random request sets: what a deployment relying on priorities sees."""

from __future__ import annotations

import random

import pytest

from eagleserve.core import Req, SamplingParams
from eagleserve.scheduler.waiting_queue import (
    PriorityPolicy,
    WaitingQueue,
    preemption_victim,
    retraction_victim,
)

POLICIES = {
    "fcfs": PriorityPolicy(),
    "high-first": PriorityPolicy(enabled=True),
    "low-first": PriorityPolicy(enabled=True, low_values_first=True),
}


def req(i: int, priority: int) -> Req:
    return Req(f"r{i}", [1, 2, 3], SamplingParams(), priority=priority)


def expected_rank(policy: PriorityPolicy, r: Req) -> tuple[int, int]:
    """The order each policy promises, written from its definition."""
    if not policy.enabled:
        return (0, r.arrival_index)
    return (r.priority if policy.low_values_first else -r.priority, r.arrival_index)


@pytest.mark.parametrize("name", POLICIES)
def test_requests_leave_in_the_policys_order_through_retractions(name: str) -> None:
    """Random pushes, pops, retractions (a popped request pushed back) and removals: each pop
    is the waiting request that comes first by priority (when on), then arrival."""
    policy = POLICIES[name]
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    queue = WaitingQueue(policy)
    waiting: list[Req] = []
    popped: list[Req] = []
    arrived = 0
    for i in range(400):
        action = rng.random()
        if action < 0.45 or not waiting:
            r = req(i, rng.randint(-3, 3))
            queue.push(r)
            waiting.append(r)
            assert r.arrival_index == arrived
            arrived += 1
        elif action < 0.8:
            r = queue.popleft()
            assert r is min(waiting, key=lambda w: expected_rank(policy, w)), f"seed {seed}"
            waiting.remove(r)
            popped.append(r)
        elif action < 0.92 and popped:
            r = popped.pop(rng.randrange(len(popped)))
            before = r.arrival_index
            queue.push(r)  # retracted: keeps its place in arrival order
            assert r.arrival_index == before
            waiting.append(r)
        else:
            r = waiting.pop(rng.randrange(len(waiting)))
            queue.remove(r)
        assert len(queue) == len(waiting)
        assert [w.rid for w in queue] == [
            w.rid for w in sorted(waiting, key=lambda w: expected_rank(policy, w))
        ], f"seed {seed}"


def test_a_retracted_request_goes_back_to_the_head_first_come_first_served() -> None:
    """FCFS: running requests arrived before every waiting one, so a retracted one is served
    next, as it always was."""
    queue = WaitingQueue(POLICIES["fcfs"])
    running = [req(i, 0) for i in range(3)]
    for r in running:
        queue.push(r)
    for _ in running:
        queue.popleft()
    for i in range(3, 7):
        queue.push(req(i, 0))
    queue.push(running[1])
    assert queue[0] is running[1]


def test_remove_takes_that_request_not_an_equal_one() -> None:
    queue = WaitingQueue(POLICIES["high-first"])
    a, b = req(0, 1), req(0, 1)  # equal fields but for the arrival number
    queue.push(a)
    queue.push(b)
    queue.remove(b)
    assert list(queue) == [a] and list(queue)[0] is a


@pytest.mark.parametrize("name", POLICIES)
def test_retraction_takes_the_request_ranked_last(name: str) -> None:
    policy = POLICIES[name]
    rng = random.Random()
    queue = WaitingQueue(policy)
    running = [req(i, rng.randint(-5, 5)) for i in range(rng.randint(1, 12))]
    for r in running:
        queue.push(r)
    rng.shuffle(running)  # a batch's order is not arrival order after merges
    victim = retraction_victim(running, policy)
    assert victim is max(running, key=lambda r: expected_rank(policy, r))
    if not policy.enabled:
        assert victim.arrival_index == max(r.arrival_index for r in running)  # the newest
    assert retraction_victim([], policy) is None


@pytest.mark.parametrize("threshold", [0, 3, 10])
@pytest.mark.parametrize("low_first", [False, True])
def test_preemption_only_past_the_threshold(threshold: int, low_first: bool) -> None:
    """An incoming request preempts the running one ranked last exactly when it is ahead of it
    by more than the threshold; never with priority scheduling off."""
    policy = PriorityPolicy(True, low_first, threshold)
    rng = random.Random()
    sign = -1 if low_first else 1  # +gap: `incoming` is ahead by gap
    for _ in range(200):
        queue = WaitingQueue(policy)
        running = [req(i, rng.randint(-20, 20)) for i in range(rng.randint(1, 6))]
        incoming = req(99, rng.randint(-20, 20))
        for r in [*running, incoming]:
            queue.push(r)
        last = max(running, key=lambda r: expected_rank(policy, r))
        gap = sign * (incoming.priority - last.priority)
        got = preemption_victim(running, incoming, policy)
        assert got is (last if gap > threshold else None), (gap, threshold)
        off = PriorityPolicy(False, low_first, threshold)
        assert preemption_victim(running, incoming, off) is None


@pytest.mark.parametrize("name", POLICIES)
def test_a_full_queue_turns_away_the_newcomer_or_one_it_outranks(name: str) -> None:
    """Below capacity nothing is turned away; at it, the newcomer, unless priority scheduling
    ranks it ahead of a waiting request that has not started: then the last-ranked of those."""
    policy = POLICIES[name]
    rng = random.Random()
    for trial in range(100):
        queue = WaitingQueue(policy)
        waiting = [req(i, rng.randint(-3, 3)) for i in range(rng.randint(0, 6))]
        for r in waiting:
            r.retract_count = int(rng.random() < 0.3)
            queue.push(r)
        incoming = req(99, rng.randint(-3, 3))
        assert queue.turned_away(incoming, None) is None
        assert queue.turned_away(incoming, len(waiting) + 1) is None
        got = queue.turned_away(incoming, len(waiting))
        fresh = [r for r in waiting if not r.retract_count]
        want = incoming
        if policy.enabled and fresh:
            last = max(fresh, key=lambda r: expected_rank(policy, r))
            if expected_rank(policy, incoming)[0] < expected_rank(policy, last)[0]:
                want = last
        assert got is want, trial
        assert got is incoming or not got.retract_count

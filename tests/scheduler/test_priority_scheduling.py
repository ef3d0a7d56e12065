"""Priority scheduling (`--enable-priority-scheduling`, scheduler/waiting_queue.py and
retraction.py) through a real scheduler: waiting requests start in priority order, a request
that outranks a running one by more than the threshold preempts it at once, a KV shortage
retracts the lowest priority first, and every request still gets the tokens it gets alone."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from conftest import random_prompts
from test_scheduler import OVERLAP, collect, greedy, run_alone

from eagleserve.core import Req, SamplingParams
from eagleserve.messages import GenerateReqInput
from eagleserve.scheduler.scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("torch_threads")


def add(sched: Scheduler, rid: str, prompt: list[int], params: SamplingParams, pri: int) -> Req:
    sched.add_request(GenerateReqInput(rid, list(prompt), params, stream=True, priority=pri))
    return next(r for r in sched.waiting if r.rid == rid)


def run(sched: Scheduler, tokens: dict[str, list[int]], order: list[str]) -> None:
    """Steps to the end; `order` gets the requests in the order they finish."""
    done: dict[str, str] = {}
    for _ in range(5000):
        if not sched.has_work():
            return
        before = set(done)
        collect(sched.step(), tokens, done)
        order.extend(r for r in done if r not in before)
    raise AssertionError("the scheduler did not drain")


@OVERLAP
def test_an_outranking_request_preempts_a_running_one_and_no_tokens_change(
    tiny_model_dir: str, make_scheduler: Callable[..., Scheduler], overlap: bool
) -> None:
    """Two slots, both decoding priority-0 requests, one more waiting: a priority-5 request
    takes the newest running one's slot at once (its first token within two steps, where
    waiting for a slot takes tens), finishes before every request still waiting, and the
    preempted request resumes to the same tokens."""
    seed = random.randrange(1 << 20)
    prompts = random_prompts(4, [12, 9, 15, 7], seed=seed)
    params = greedy(24)
    flags = dict(max_running_requests=2, max_total_tokens=1024,
                 disable_overlap_schedule=not overlap, enable_priority_scheduling=True,
                 priority_scheduling_preemption_threshold=0)  # fmt: skip
    want = run_alone(make_scheduler(tiny_model_dir, **flags), prompts, params)
    sched = make_scheduler(tiny_model_dir, **flags)
    low = [add(sched, f"low{i}", p, params, 0) for i, p in enumerate(prompts[:3])]
    tokens: dict[str, list[int]] = {}
    done: dict[str, str] = {}
    while len(tokens.get("low1", [])) < 4:
        collect(sched.step(), tokens, done)
    high = add(sched, "high", prompts[3], params, 5)
    for _ in range(2):
        collect(sched.step(), tokens, done)
    assert tokens.get("high"), f"seed {seed}: the high-priority request waited for a slot"
    assert [r.rid for r in sched.waiting] == ["low1", "low2"], "the preempted one lost its place"
    order: list[str] = []
    run(sched, tokens, order)
    assert (low[0].retract_count, low[1].retract_count, low[2].retract_count) == (0, 1, 0)
    assert high.retract_count == 0 and sched.num_retracted == 1
    assert order.index("high") < min(order.index("low1"), order.index("low2")), order
    for i, rid in enumerate(["low0", "low1", "low2", "high"]):
        assert tokens[rid] == want[i], f"seed {seed}: {rid}"


@pytest.mark.parametrize("low_first", [False, True], ids=["high-first", "low-first"])
def test_waiting_requests_start_by_priority_then_arrival(
    tiny_model_dir: str, make_scheduler: Callable[..., Scheduler], low_first: bool
) -> None:
    """One slot: requests queued behind a running one start (and so finish) in priority order,
    ties by arrival; a gap within the threshold preempts nothing."""
    rng = random.Random()
    priorities = [rng.randint(-4, 4) for _ in range(6)]
    prompts = random_prompts(7, [rng.randint(3, 12) for _ in range(7)], seed=rng.randrange(99))
    sched = make_scheduler(tiny_model_dir, max_running_requests=1, max_total_tokens=1024,
                           enable_priority_scheduling=True,
                           schedule_low_priority_values_first=low_first)  # fmt: skip
    params = greedy(6)
    add(sched, "first", prompts[0], params, 0)
    tokens: dict[str, list[int]] = {}
    while not tokens.get("first"):
        collect(sched.step(), tokens, {})
    for i, pri in enumerate(priorities):  # all within the default threshold (10) of 0
        add(sched, f"r{i}", prompts[i + 1], params, pri)
    order: list[str] = []
    run(sched, tokens, order)
    sign = 1 if low_first else -1
    want = ["first"] + [f"r{i}" for i in sorted(range(6), key=lambda i: (sign * priorities[i], i))]
    assert order == want, priorities
    assert sched.num_retracted == 0


@OVERLAP
def test_a_kv_shortage_retracts_the_lowest_priority_first(
    tiny_model_dir: str, make_scheduler: Callable[..., Scheduler], overlap: bool
) -> None:
    """Two requests that outgrow the pool together, the higher-priority one admitted later
    (so last in the running batch, where first come, first served retracts): the lower one is
    retracted, waits without preempting back, and both keep their tokens."""
    seed = random.randrange(1 << 20)
    prompts = random_prompts(2, [30, 30], seed=seed)
    params = greedy(40)
    flags = dict(max_running_requests=2, disable_overlap_schedule=not overlap,
                 enable_priority_scheduling=True)  # fmt: skip
    want = run_alone(make_scheduler(tiny_model_dir, max_total_tokens=1024, **flags), prompts,
                     params)  # fmt: skip
    sched = make_scheduler(tiny_model_dir, max_total_tokens=100, **flags)
    older = add(sched, "r0", prompts[0], params, 0)
    tokens: dict[str, list[int]] = {}
    while not tokens.get("r0"):
        collect(sched.step(), tokens, {})
    newer = add(sched, "r1", prompts[1], params, 1)
    order: list[str] = []
    run(sched, tokens, order)
    assert older.retract_count > 0 and newer.retract_count == 0, f"seed {seed}"
    assert order == ["r1", "r0"], f"seed {seed}"
    assert [tokens["r0"], tokens["r1"]] == want, f"seed {seed}"


def test_mixed_chunks_are_refused_with_priority_scheduling(
    tiny_model_dir: str, make_scheduler: Callable[..., Scheduler]
) -> None:
    with pytest.raises(ValueError, match="--enable-mixed-chunk"):
        make_scheduler(tiny_model_dir, enable_mixed_chunk=True, enable_priority_scheduling=True)


def test_a_priority_without_priority_scheduling_is_refused(
    tiny_model_dir: str, make_scheduler: Callable[..., Scheduler]
) -> None:
    sched = make_scheduler(tiny_model_dir, max_total_tokens=256)
    sched.add_request(GenerateReqInput("p", [5, 6, 7], greedy(4), priority=-2))
    (out,) = sched.step()
    assert out.error_code == 400 and "--enable-priority-scheduling" in (out.error or "")
    assert not sched.waiting and not sched.has_work()


@pytest.mark.parametrize("priorities", [False, True], ids=["fcfs", "priority"])
def test_a_full_queue_answers_503_and_a_priority_takes_a_place(
    tiny_model_dir: str, make_scheduler: Callable[..., Scheduler], priorities: bool
) -> None:
    """--max-queued-requests 2 behind one running request: a third waiting request is a 503;
    with priority scheduling one that outranks a waiting request takes its place, and that one
    gets the 503; the rest finish with their tokens."""
    prompts = random_prompts(5, seed=random.randrange(1 << 20))
    params = greedy(4)
    sched = make_scheduler(tiny_model_dir, max_running_requests=1, max_queued_requests=2,
                           max_total_tokens=1024,
                           enable_priority_scheduling=priorities)  # fmt: skip
    finished: dict[str, tuple[int | None, int]] = {}
    order: list[str] = []

    def step() -> None:
        for out in sched.step():
            if out.finished:
                finished[out.rid] = (out.error_code, out.completion_tokens)
                order.append(out.rid)

    sched.add_request(GenerateReqInput("r0", prompts[0], params))
    while not sched.running_batch:
        step()
    for i, pri in ((1, 0), (2, 1 if priorities else 0), (3, 0), (4, 5 if priorities else 0)):
        sched.add_request(GenerateReqInput(f"r{i}", prompts[i], params, priority=pri))
    while sched.has_work():
        step()
    refused = {"r3", "r1"} if priorities else {"r3", "r4"}
    assert {rid for rid, (code, _) in finished.items() if code == 503} == refused
    assert all(n == 4 for rid, (_, n) in finished.items() if rid not in refused)
    assert order[-3:] == (["r0", "r4", "r2"] if priorities else ["r0", "r1", "r2"])

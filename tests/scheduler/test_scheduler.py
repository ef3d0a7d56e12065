"""Continuous batching gives every request the tokens it would get alone.

Drives the `Scheduler` directly: requests arrive at different steps while others decode, the KV
pool can be far smaller than the total demand (requests wait, and running ones are retracted and
re-prefilled later), and requests can be aborted while waiting or running. Greedy tokens must not
depend on any of that. Every scheduler made here is checked afterwards for leaked KV or request
slots (conftest `check_pools_free`).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from conftest import random_prompts, run_scheduler_to_completion

from eagleserve.core import Req, SamplingParams
from eagleserve.messages import GenerateReqInput, TokenOutput
from eagleserve.scheduler.scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("torch_threads")

OVERLAP = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


def add(sched: Scheduler, rid: str, prompt: list[int], params: SamplingParams) -> Req:
    """Queues a streamed request: its tokens come as they are made."""
    sched.add_request(GenerateReqInput(rid, list(prompt), params, stream=True))
    req = sched.waiting[-1]
    assert req.rid == rid
    return req


def collect(outs: list[TokenOutput], tokens: dict[str, list[int]], done: dict[str, str]) -> None:
    for out in outs:
        assert out.error is None, out.error
        tokens.setdefault(out.rid, []).extend(out.new_token_ids)
        if out.finished:
            assert out.rid not in done, f"{out.rid} finished twice"
            done[out.rid] = out.finish_reason


def run_alone(
    sched: Scheduler, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    """Each prompt on its own, one after the other, through the same scheduler."""
    result = []
    for i, prompt in enumerate(prompts):
        tokens: dict[str, list[int]] = {}
        done: dict[str, str] = {}
        add(sched, f"alone-{i}", prompt, params)
        while sched.has_work():
            collect(sched.step(), tokens, done)
        assert done == {f"alone-{i}": "length"}
        result.append(tokens[f"alone-{i}"])
    return result


@OVERLAP
def test_batch_invariance_with_staggered_arrival(
    tiny_model_dir: str, make_scheduler: Callable[..., Scheduler], overlap: bool
) -> None:
    """8 prompts of different lengths: alone, and together while arriving every few steps."""
    lengths = [5, 31, 12, 3, 47, 20, 8, 26]
    prompts = random_prompts(8, lengths, seed=101)
    params = greedy(40)
    sched = make_scheduler(
        tiny_model_dir,
        max_running_requests=8,
        max_total_tokens=1024,
        disable_overlap_schedule=not overlap,
    )
    alone = run_alone(sched, prompts, params)
    # Different prompts do give different outputs (else invariance would be vacuous).
    assert len({tuple(t) for t in alone}) == len(prompts)

    tokens: dict[str, list[int]] = {}
    done: dict[str, str] = {}
    arrival = {3 * i + (i % 2): i for i in range(len(prompts))}  # steps 0, 4, 6, 10, ...
    max_batch = 0
    step = 0
    while len(done) < len(prompts):
        if step in arrival:
            i = arrival[step]
            add(sched, f"r{i}", prompts[i], params)
        collect(sched.step(), tokens, done)
        if sched.running_batch is not None:
            max_batch = max(max_batch, sched.running_batch.batch_size)
        step += 1
        assert step < 2000
    run_scheduler_to_completion(sched)
    assert max_batch >= 6, f"requests barely overlapped (max batch {max_batch})"
    for i in range(len(prompts)):
        assert done[f"r{i}"] == "length"
        assert tokens[f"r{i}"] == alone[i], f"prompt {i} changed when batched"


@OVERLAP
def test_small_kv_pool_waits_and_retracts_with_same_tokens(
    tiny_model_dir: str, make_scheduler: Callable[..., Scheduler], overlap: bool
) -> None:
    """A KV pool just above one request's need, 8 requests: all finish with unchanged tokens."""
    max_new = 32
    lengths = [28, 9, 14, 6, 19, 11, 23, 7]  # request 0 needs exactly the whole pool (60)
    prompts = random_prompts(8, lengths, seed=202)
    kv_tokens = lengths[0] + max_new
    params = greedy(max_new)

    big = make_scheduler(
        tiny_model_dir,
        max_running_requests=8,
        max_total_tokens=4096,
        disable_overlap_schedule=not overlap,
    )
    want = run_alone(big, prompts, params)

    small = make_scheduler(
        tiny_model_dir,
        max_running_requests=8,
        max_total_tokens=kv_tokens,
        disable_overlap_schedule=not overlap,
    )
    assert small.max_context_len == kv_tokens
    reqs = [add(small, f"r{i}", p, params) for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {}
    done: dict[str, str] = {}
    max_waiting_while_running = 0
    for _ in range(5000):
        if not small.has_work():
            break
        collect(small.step(), tokens, done)
        assert small.kv_pool.available_size() >= 0
        if small.running_batch is not None:
            max_waiting_while_running = max(max_waiting_while_running, len(small.waiting))
    assert not small.has_work()
    assert max_waiting_while_running > 0, "no request ever had to wait"
    retracted = [r.rid for r in reqs if r.retract_count > 0]
    assert retracted, "the pool never ran out: retraction was not exercised"
    assert small.stats().num_retracted_total == sum(r.retract_count for r in reqs)
    for i in range(len(prompts)):
        assert done[f"r{i}"] == "length"
        assert tokens[f"r{i}"] == want[i], f"request {i} (retracted: {reqs[i].retract_count})"


@OVERLAP
def test_a_retracted_request_comes_back_to_its_cached_positions(
    tiny_model_dir: str, make_scheduler: Callable[..., Scheduler], overlap: bool
) -> None:
    """Retraction puts the request's computed positions into the prefix cache, whose eviction
    takes only the tail that the running request needs: the request comes back to the rest
    (prefix hits on prompts that share nothing) and still gets its alone-tokens."""
    seed = random.randrange(1 << 20)
    prompts = random_prompts(2, [30, 30], seed=seed)
    params = greedy(40)
    flags = dict(max_running_requests=2, disable_overlap_schedule=not overlap)
    want = run_alone(make_scheduler(tiny_model_dir, max_total_tokens=1024, **flags), prompts,
                     params)  # fmt: skip
    sched = make_scheduler(tiny_model_dir, max_total_tokens=100, **flags)
    reqs = [add(sched, f"r{i}", p, params) for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {}
    done: dict[str, str] = {}
    for _ in range(2000):
        if not sched.has_work():
            break
        collect(sched.step(), tokens, done)
    assert done == {"r0": "length", "r1": "length"}, f"seed {seed}"
    assert reqs[1].retract_count > 0 and reqs[0].retract_count == 0, f"seed {seed}"
    # The 30 + 40 positions of r0 take 70 of 100 slots: r1 keeps about 30 of its own cached.
    assert sched.prefix_cache.hit_tokens >= 20, f"seed {seed}"
    assert [tokens["r0"], tokens["r1"]] == want, f"seed {seed}"


@OVERLAP
def test_abort_frees_slots_and_spares_others(
    tiny_model_dir: str, make_scheduler: Callable[..., Scheduler], overlap: bool
) -> None:
    """Aborting a running and a waiting request frees their slots; the rest are unaffected."""
    prompts = random_prompts(4, [10, 17, 5, 12], seed=303)
    params = greedy(24)
    sched = make_scheduler(
        tiny_model_dir,
        max_running_requests=2,
        max_total_tokens=512,
        disable_overlap_schedule=not overlap,
    )
    want = run_alone(sched, prompts, params)
    for i, p in enumerate(prompts):
        add(sched, f"r{i}", p, params)
    tokens: dict[str, list[int]] = {}
    done: dict[str, str] = {}
    for _ in range(5):
        collect(sched.step(), tokens, done)
    assert [r.rid for r in sched.running_batch.reqs] == ["r0", "r1"]
    assert [r.rid for r in sched.waiting] == ["r2", "r3"]
    sched.abort_request("r1")  # running
    sched.abort_request("r3")  # waiting
    while sched.has_work():
        collect(sched.step(), tokens, done)
    assert done == {"r0": "length", "r1": "abort", "r2": "length", "r3": "abort"}
    assert tokens["r0"] == want[0] and tokens["r2"] == want[2]
    assert tokens["r3"] == []
    assert tokens["r1"] == want[1][: len(tokens["r1"])]


@OVERLAP
@pytest.mark.parametrize("mixed", [False, True], ids=["chunks", "mixed-chunks"])
def test_running_request_outlasting_a_chunked_prefill_gets_its_slots(
    tiny_model_dir: str, make_scheduler: Callable[..., Scheduler], overlap: bool, mixed: bool
) -> None:
    """A chunked prefill holds KV for its whole prompt from its first chunk, while the running
    request decodes once between chunks; when the pool runs out with one request running, the
    part-way prefill gives its slots back and starts again later, and both get their tokens."""
    seed = random.randrange(1 << 20)
    running, long = random_prompts(2, [40, 50], seed=seed)
    params = greedy(50)
    flags = dict(max_running_requests=4, chunked_prefill_size=4, enable_mixed_chunk=mixed,
                 disable_overlap_schedule=not overlap)  # fmt: skip
    # Alone on another scheduler: nothing of the prompts is cached on this one.
    want = run_alone(make_scheduler(tiny_model_dir, max_total_tokens=1024, **flags),
                     [running, long], params)  # fmt: skip
    sched = make_scheduler(tiny_model_dir, max_total_tokens=100, **flags)
    tokens: dict[str, list[int]] = {}
    done: dict[str, str] = {}
    add(sched, "running", running, params)
    while len(tokens.get("running", [])) < 2:  # the long prompt then just fits the pool
        collect(sched.step(), tokens, done)
    late = add(sched, "long", long, params)
    for _ in range(2000):
        if not sched.has_work():
            break
        collect(sched.step(), tokens, done)
    assert done == {"running": "length", "long": "length"}, f"seed {seed}"
    assert late.retract_count > 0, f"seed {seed}: the pool never ran out"
    # Back from the chunks it had computed, it reports no cached prompt tokens (nothing else
    # held its prompt).
    assert late.cached_tokens == 0, f"seed {seed}"
    assert tokens["running"] == want[0] and tokens["long"] == want[1], f"seed {seed}"

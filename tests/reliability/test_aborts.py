"""Aborts at every point of a request's life give back all its slots and disturb no one else.

Offline, on the `Scheduler` itself: abort while waiting, right after the prefill was launched,
and right after a decode (with EAGLE: draft + verify) was launched; with overlap on, that is
inside the overlap window, while the forward still runs. Target and draft KV share one slot
allocator and the FutureMap is indexed by request slot, so `kv_pool` and `req_to_token_pool`
both back to full size covers all three. The other requests' tokens must be exact, and a new
request that reuses the freed slots too. Then through HTTP: a client hanging up frees the KV.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from conftest import assert_kv_accounted
from rel_fixtures import (  # noqa: F401 (fixtures)
    SPEC_FLAGS,
    Server,
    completion,
    spec_server_fixture,
    tiny_dirs_fixture,
    wait_kv_free,
)

from eagleserve import SamplingParams
from eagleserve.messages import GenerateReqInput
from eagleserve.scheduler.scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("torch_threads")
PARAMS = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = {f"r{i}": [3 + (11 * i + 5 * j) % 250 for j in range(6 + 7 * i)] for i in range(3)}
VICTIM = [40 + j for j in range(30)]
NEWCOMER = [7, 8, 9, 10, 11]


def spec_kwargs(head: str) -> dict[str, Any]:
    return dict(speculative_algorithm="EAGLE", speculative_draft_model_path=head,
                speculative_num_steps=3, speculative_eagle_topk=1,
                speculative_num_draft_tokens=4)  # fmt: skip


def drain(sched: Scheduler, toks: dict[str, list[int]], reasons: dict[str, str]) -> None:
    while sched.has_work():
        collect(sched.step(), toks, reasons)


def collect(outs: list, toks: dict[str, list[int]], reasons: dict[str, str]) -> None:
    for o in outs:
        assert o.error is None, o.error
        toks.setdefault(o.rid, []).extend(o.new_token_ids)
        if o.finished:
            reasons[o.rid] = o.finish_reason


def reference(sched: Scheduler) -> dict[str, list[int]]:
    toks: dict[str, list[int]] = {}
    for rid, p in {**PROMPTS, "new": NEWCOMER}.items():
        sched.add_request(GenerateReqInput(rid, p, PARAMS))
    drain(sched, toks, {})
    return toks


# When to abort the victim: before any step (waiting), right after the step that launched its
# prefill, or right after a step that launched a decode holding it.
POINTS = ["waiting", "prefill", "decode"]


@pytest.mark.parametrize("spec", [False, True], ids=["target", "eagle"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("point", POINTS)
def test_abort_frees_slots(
    make_scheduler: Callable[..., Scheduler],
    tiny_dirs: tuple[str, str],
    spec: bool,
    overlap: bool,
    point: str,
) -> None:
    target, head = tiny_dirs
    kw = dict(max_total_tokens=1024, max_running_requests=8, disable_overlap_schedule=not overlap)
    sched = make_scheduler(target, **kw, **(spec_kwargs(head) if spec else {}))
    want = reference(sched)
    toks: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for rid, p in PROMPTS.items():
        sched.add_request(GenerateReqInput(rid, p, PARAMS))
    if point != "waiting":  # the others run first; the victim joins a busy batch
        for _ in range(3):
            collect(sched.step(), toks, reasons)
    sched.add_request(GenerateReqInput("victim", VICTIM, PARAMS))
    if point in ("prefill", "decode"):
        collect(sched.step(), toks, reasons)  # launches (overlap) or runs the victim's prefill
    if point == "decode":
        collect(sched.step(), toks, reasons)  # launches a decode (draft + verify) with it
        assert sched.running_batch is not None
        assert "victim" in [r.rid for r in sched.running_batch.reqs]
        if overlap:
            assert sched.inflight is not None, "no forward in flight: not the overlap window"
    sched.abort_request("victim")
    sched.add_request(GenerateReqInput("new", NEWCOMER, PARAMS))
    drain(sched, toks, reasons)
    assert reasons["victim"] == "abort"
    assert_kv_accounted(sched)
    for rid in [*PROMPTS, "new"]:
        assert toks[rid] == want[rid], rid  # exact, including the slot reuser "new"
        assert reasons[rid] == "length"


def test_abort_twice_and_unknown_is_harmless(
    make_scheduler: Callable[..., Scheduler], tiny_dirs: tuple[str, str]
) -> None:
    sched = make_scheduler(tiny_dirs[0], max_total_tokens=1024, max_running_requests=4)
    sched.add_request(GenerateReqInput("a", NEWCOMER, PARAMS))
    sched.step()
    sched.abort_request("a")
    sched.abort_request("a")
    sched.abort_request("no-such-request")
    reasons: dict[str, str] = {}
    drain(sched, {}, reasons)
    assert reasons == {"a": "abort"}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_http_disconnect_frees_kv(spec_server: Server, stream: bool) -> None:
    url = spec_server.url
    prompt = [9] * 20
    t0 = time.monotonic()
    full = completion(url, prompt, 480, ignore_eos=True)
    assert full.status_code == 200
    t_full = time.monotonic() - t0  # the whole request, when nobody hangs up
    body = {"prompt": prompt, "max_tokens": 480, "ignore_eos": True, "stream": stream}
    if stream:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
            seen = 0
            for line in resp.iter_lines():
                seen += line.startswith("data: ")
                if seen == 2:
                    break
        assert seen == 2
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=min(0.5, t_full / 4))
    t_gone = time.monotonic()
    wait_kv_free(url, timeout=20)
    # Freed by the abort, not by finishing: well before the request could have run to its end.
    assert time.monotonic() - t_gone < max(0.6 * t_full, 1.0) or t_full < 1.0, t_full
    again = completion(url, prompt, 480, ignore_eos=True)
    assert again.json()["choices"][0]["text"] == full.json()["choices"][0]["text"]

"""Server lifecycle: graceful SIGTERM, engine faults through HTTP, engine death ends the CLI."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import httpx
from conftest import assert_kv_accounted
from rel_fixtures import (  # noqa: F401 (fixtures)
    FAULT_TOKEN,
    Server,
    completion,
    fault_server_fixture,
    sse_events,
    start_server,
    tiny_dirs_fixture,
    wait_kv_free,
)

from eagleserve import SamplingParams
from eagleserve.config import ServerArgs
from eagleserve.messages import GenerateReqInput
from eagleserve.scheduler.scheduler import Scheduler


def engine_pids(server: Server) -> list[int]:
    pid = server.proc.pid
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_forward_fault_fails_only_its_batch(fault_server: Server) -> None:
    """The fault hook makes every forward holding a FAULT_TOKEN prompt raise: that request gets
    a 500 with an OpenAI error body, concurrent ones finish exactly, the server keeps serving."""
    url = fault_server.url
    good = [5, 6, 7, 8, 9, 10]
    want = completion(url, good, 40, ignore_eos=True).json()["choices"][0]["text"]
    results: dict[str, httpx.Response] = {}

    def run(name: str, prompt: list[int]) -> None:
        results[name] = completion(url, prompt, 40, ignore_eos=True)

    threads = [threading.Thread(target=run, args=(f"good{i}", good)) for i in range(3)]
    threads.append(threading.Thread(target=run, args=("bad", [FAULT_TOKEN, 5, 6])))
    for t in threads:
        t.start()
        time.sleep(0.05)  # the bad one joins while the good ones decode
    for t in threads:
        t.join(120)
    bad = results["bad"]
    assert bad.status_code == 500, bad.text
    err = bad.json()["error"]
    assert err["type"] == "server_error" and "injected fault" in err["message"]
    for i in range(3):
        r = results[f"good{i}"]
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    stream = httpx.post(
        url + "/v1/completions",
        json={"prompt": [FAULT_TOKEN, 1], "max_tokens": 5, "stream": True},
        timeout=60,
    )
    assert '"error"' in stream.text and "injected fault" in stream.text
    assert httpx.get(url + "/health").status_code == 200
    assert completion(url, good, 40, ignore_eos=True).json()["choices"][0]["text"] == want
    wait_kv_free(url)


def test_sigterm_drains_then_exits_0(tiny_dirs: tuple[str, str]) -> None:
    srv = start_server(
        tiny_dirs[0], ["--max-total-tokens", "8192"], {"EAGLESERVE_DRAIN_TIMEOUT_S": "4"}
    )
    url = srv.url
    longs = [f"long{i}" for i in range(16)]  # 16 x 508 tokens fit the 8192-token pool
    try:
        results: dict[str, httpx.Response | Exception] = {}
        short_events: list[str] = []
        streaming = threading.Event()

        def run(name: str, max_tokens: int) -> None:
            try:
                results[name] = completion(url, [5] * 8, max_tokens, ignore_eos=True)
            except httpx.HTTPError as exc:
                results[name] = exc

        def run_short() -> None:
            body = {"prompt": [5] * 8, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
            short_events.extend(sse_events(url, body, streaming))

        # "short" is streaming when the SIGTERM comes (it waits for its first event, so a slow
        # machine cannot send the signal before the request arrived) and finishes within the
        # drain; the long ones (near the context, sharing the engine) keep it busy past the
        # SIGTERM and may be cut off by the drain timeout.
        threads = [threading.Thread(target=run, args=(name, 500)) for name in longs]
        threads.append(threading.Thread(target=run_short))
        for t in threads:
            t.start()
        assert streaming.wait(60), "the short request never streamed"
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        refused = completion(url, [5, 6], 2)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(url + "/health").status_code == 503
        rc = srv.proc.wait(30)
        took = time.monotonic() - t0
        for t in threads:
            t.join(10)
    finally:
        srv.stop()
    assert rc == 0, srv.log_tail()
    assert took < 4 + 5 + 5, took  # drain timeout + uvicorn's graceful timeout + slack
    assert short_events[-1] == "[DONE]" and not any('"error"' in e for e in short_events)
    assert len(short_events) > 2, short_events  # it streamed tokens, then finished
    assert all(name in results for name in longs)  # answered or cut off, not left hanging


def test_engine_death_exits_nonzero(tiny_dirs: tuple[str, str]) -> None:
    srv = start_server(tiny_dirs[0], ["--max-total-tokens", "1024"])
    try:
        children = engine_pids(srv)
        assert children, "no engine process found"
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        rc = srv.proc.wait(20)
        took = time.monotonic() - t0
    finally:
        srv.stop()
    assert rc not in (0, None) and rc > 0, rc
    assert took < 10, took


def test_spec_overlap_fault_does_not_hang(tiny_dirs: tuple[str, str]) -> None:
    """EAGLE + overlap: a forward that raises must fail its batch, not hang the engine.

    The failed forward must still publish (the next step's resolve_seq_lens_cpu waits for it)
    and leave harmless rows in the FutureMap for the batch launched after it."""
    target, head = tiny_dirs
    args = ServerArgs(model=target, device="cpu", dtype="float32", max_total_tokens=1024,
                      max_running_requests=4, speculative_algorithm="EAGLE",
                      speculative_draft_model_path=head, speculative_num_steps=3,
                      speculative_eagle_topk=1, speculative_num_draft_tokens=4)  # fmt: skip
    sched = Scheduler(args)  # not tracked: a hung one keeps its slots
    real = sched.worker.forward_batch_generation

    fired: list[str] = []

    def faulty(batch: Any, *a: Any, **kw: Any) -> Any:
        # One-shot (a transient fault): the batch launched right after the failed one still
        # holds "bad"; a fault that fired there too would fail "good" with it, by design.
        if not fired and any(r.rid == "bad" for r in batch.reqs):
            fired.append(batch.mode)
            raise RuntimeError("injected fault")
        return real(batch, *a, **kw)

    sched.worker.forward_batch_generation = faulty
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    errors: dict[str, int | None] = {}
    tokens: dict[str, int] = {}

    def step() -> None:
        for o in sched.step():
            tokens[o.rid] = tokens.get(o.rid, 0) + len(o.new_token_ids)
            if o.error:
                errors[o.rid] = o.error_code

    def run() -> None:
        sched.add_request(GenerateReqInput("good", [5, 6, 7], params))
        for _ in range(3):
            step()
        sched.add_request(GenerateReqInput("bad", [8, 9], params))
        while sched.has_work():
            step()

    worker = threading.Thread(target=run, daemon=True)  # daemon: a hung one must not block exit
    worker.start()
    worker.join(15)
    assert not worker.is_alive(), "the scheduler hangs after a failed EAGLE forward (overlap)"
    assert errors == {"bad": 500}
    assert tokens["good"] == 12
    assert_kv_accounted(sched)

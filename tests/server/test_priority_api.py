"""Priority scheduling over HTTP: the `priority` field of /v1/completions, /v1/chat/completions
and /generate reaches the engine where the server runs with --enable-priority-scheduling, and is
a 400 naming it where the server serves first come, first served; --max-queued-requests answers
503 to a request that finds the queue full."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from server_fixtures import (  # noqa: F401 (fixtures)
    ServerProcess,
    http_fixture,
    metric,
    server_fixture,
)

LONG = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 300,
        "temperature": 0, "ignore_eos": True}  # fmt: skip


@pytest.fixture(scope="module", name="priority_server")
def priority_server_fixture() -> Iterator[ServerProcess]:
    srv = ServerProcess(["--enable-priority-scheduling", "--max-running-requests", "1",
                         "--priority-scheduling-preemption-threshold", "0",
                         "--max-queued-requests", "1"])  # fmt: skip
    yield srv
    srv.stop()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "priority": 3}),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "priority": -1}),
        ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}, "priority": 2}),
    ],
)  # fmt: skip
def test_a_priority_is_400_where_priority_scheduling_is_off(
    http: httpx.Client, path: str, body: dict
) -> None:
    resp = http.post(path, json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "priority" and "--enable-priority-scheduling" in err["message"]
    assert http.post(path, json={**body, "priority": 0}).status_code == 200


@pytest.mark.parametrize("route", ["chat", "generate"])
def test_a_higher_priority_request_overtakes_a_running_one(
    priority_server: ServerProcess, route: str
) -> None:
    """One request slot, a long answer streaming at priority 0: a short request at priority 1
    preempts it and is answered while the long one is still streaming; the long answer then
    goes on to the same text as when it runs alone."""
    chunks: list[str] = []
    first, done = threading.Event(), threading.Event()

    def stream_long() -> None:
        with httpx.Client(base_url=priority_server.url, timeout=120) as client:
            body = {**LONG, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:])["choices"][0]["text"])
                        first.set()
        done.set()

    worker = threading.Thread(target=stream_long)
    worker.start()
    with httpx.Client(base_url=priority_server.url, timeout=120) as http:
        assert first.wait(60)
        if route == "chat":
            short = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
                "temperature": 0, "priority": 1})  # fmt: skip
        else:
            short = http.post("/generate", json={
                "text": "Say hi.", "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                "priority": 1})  # fmt: skip
        assert short.status_code == 200, short.text
        assert not done.is_set(), "the short request waited for the long one's slot"
        worker.join(120)
        alone = http.post("/v1/completions", json=LONG).json()["choices"][0]["text"]
    assert "".join(chunks) == alone


def test_a_request_that_finds_the_queue_full_is_a_503(priority_server: ServerProcess) -> None:
    """One slot, a queue of one: behind a running request, the first request waits and the
    second, of the same priority, is answered 503 at once, streamed or not (the status itself,
    which a balancer retries elsewhere, not a 200 stream with an error event); the waiting one
    is then served."""
    results: dict[str, httpx.Response] = {}

    def post(name: str, body: dict) -> None:
        with httpx.Client(base_url=priority_server.url, timeout=120) as client:
            results[name] = client.post("/v1/completions", json=body)

    short = {"prompt": "Hi", "max_tokens": 3, "temperature": 0}
    with httpx.Client(base_url=priority_server.url, timeout=120) as http:
        long = threading.Thread(target=post, args=("long", LONG))
        long.start()
        waiting = threading.Thread(target=post, args=("waiting", short))
        deadline = time.monotonic() + 60
        while metric(http, "eagleserve_num_requests_running") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        waiting.start()
        while metric(http, "eagleserve_num_requests_waiting") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        streamed = {"stream": True}
        for path, body in [("/v1/completions", short), ("/v1/completions", {**short, **streamed}),
                           ("/v1/chat/completions", {**chat, **streamed}),
                           ("/generate", {"text": "Hi", **streamed})]:  # fmt: skip
            full = http.post(path, json=body)
            assert full.status_code == 503, (path, body, full.text)
            assert "--max-queued-requests 1" in full.json()["error"]["message"]
        assert long.is_alive(), "the running request ended before the queue was tested"
        for t in (long, waiting):
            t.join(120)
    assert results["long"].status_code == 200 and results["waiting"].status_code == 200


def test_a_stream_whose_client_leaves_while_it_waits_gives_up_its_place(
    priority_server: ServerProcess,
) -> None:
    """A streamed request waiting behind a running one has sent no status line yet (that waits
    for its first output): a client that gives up then frees its place in the queue at once,
    and the queue takes the next request."""
    results: dict[str, httpx.Response] = {}

    def post_long() -> None:
        with httpx.Client(base_url=priority_server.url, timeout=120) as client:
            results["long"] = client.post("/v1/completions", json=LONG)

    with httpx.Client(base_url=priority_server.url, timeout=120) as http:
        long = threading.Thread(target=post_long)
        long.start()
        deadline = time.monotonic() + 60
        while metric(http, "eagleserve_num_requests_running") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        body = {"prompt": "Hi", "max_tokens": 3, "stream": True}
        with pytest.raises(httpx.ReadTimeout):
            with httpx.stream("POST", priority_server.url + "/v1/completions", json=body,
                              timeout=httpx.Timeout(120, read=1.0)) as resp:  # fmt: skip
                resp.read()
        while metric(http, "eagleserve_num_requests_waiting") > 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert long.is_alive(), "the running request ended before the queue was checked"
        queued = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
        assert queued.status_code == 200, queued.text  # the queue of one had room again
        long.join(120)
    assert results["long"].status_code == 200

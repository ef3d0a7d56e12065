"""Background responses (`background: true` on /v1/responses) through the `openai` client on
the default model: answered at once as queued, polled to the same answer a foreground request
gets (greedy, token for token), streamed events that outlive the client's connection and are
read again from any sequence number, cancelled (output so far kept, the engine's slot freed) and
deleted while they run; and OpenAI's refusals (a synchronous response cannot be cancelled, a
running one cannot be continued)."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import httpx
import openai
import pytest
from server_fixtures import (  # noqa: F401 (fixtures)
    MODEL,
    base_url_fixture,
    http_fixture,
    server_fixture,
    wait_kv_free,
)

QUESTIONS = ["Count to five.", "Name three colours.", "What is the capital of France?",
             "Write a haiku about rain.", "Say hello in Spanish.", "List four fruits."]  # fmt: skip
RUNNING = ("queued", "in_progress")


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def wait_until(client: openai.OpenAI, rid: str, done: Any, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        resp = client.responses.retrieve(rid)
        if done(resp):
            return resp
        time.sleep(0.05)
    raise AssertionError(f"{rid} stayed {resp.status}")


def long_body() -> dict[str, Any]:
    """A request that runs for many seconds unless it is ended."""
    return {"model": MODEL, "input": random.choice(QUESTIONS), "max_output_tokens": 3000,
            "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip


def test_polled_answer_equals_the_foreground_one(client: openai.OpenAI) -> None:
    question = random.choice(QUESTIONS)
    n_tokens = random.randint(8, 24)
    body = {"model": MODEL, "input": question, "max_output_tokens": n_tokens, "temperature": 0}
    queued = client.responses.create(**body, background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    assert queued.usage is None
    done = wait_until(client, queued.id, lambda r: r.status not in RUNNING)
    want = client.responses.create(**body)
    assert done.output_text == want.output_text and done.status == want.status
    assert done.usage.output_tokens == want.usage.output_tokens and done.background is True
    assert want.background is False
    # A finished background response is a turn like any other.
    follow_up = client.responses.create(model=MODEL, input="Thanks.", max_output_tokens=4,
                                        previous_response_id=done.id, temperature=0)  # fmt: skip
    assert follow_up.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as exc:  # OpenAI's: already finished
        client.responses.cancel(done.id)
    assert done.status in exc.value.message


def events_of(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: ")]


def test_stream_outlives_the_client_and_is_read_again(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    body = {"model": MODEL, "input": random.choice(QUESTIONS), "background": True,
            "stream": True, "max_output_tokens": random.randint(30, 60), "temperature": 0.8,
            "seed": random.randrange(10**6), "ignore_eos": True}  # fmt: skip
    cut_after = random.randint(4, 8)
    first: list[dict[str, Any]] = []
    with http.stream("POST", "/v1/responses", json=body) as resp:
        assert resp.status_code == 200
        for event in events_of(list(_lines(resp, cut_after))):
            first.append(event)
    # The client left after `cut_after` events; the response runs on.
    rid = first[0]["response"]["id"]
    assert [e["type"] for e in first[:3]] == ["response.created", "response.queued",
                                               "response.in_progress"]  # fmt: skip
    assert first[0]["response"]["status"] == "queued" and first[0]["response"]["background"]
    rest = read_stream(http, rid, first[-1]["sequence_number"])
    events = first + rest
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]
    assert final["type"] == "response.incomplete"  # ignore_eos: cut at max_output_tokens
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    stored = client.responses.retrieve(rid)
    assert text == stored.output_text == final["response"]["output"][0]["content"][0]["text"]
    assert stored.usage.output_tokens == body["max_output_tokens"]
    # Once finished, the whole stream again, from any point; the client reads it too.
    assert read_stream(http, rid, None) == events
    start = random.randrange(len(events))
    assert read_stream(http, rid, start) == events[start + 1 :]
    typed = list(client.responses.retrieve(rid, stream=True, starting_after=start))
    assert [e.type for e in typed] == [e["type"] for e in events[start + 1 :]]


def read_stream(http: httpx.Client, rid: str, after: int | None) -> list[dict[str, Any]]:
    params = {"stream": "true"} if after is None else {"stream": "true", "starting_after": after}
    with http.stream("GET", f"/v1/responses/{rid}", params=params) as resp:
        assert resp.status_code == 200
        return events_of(list(resp.iter_lines()))


def _lines(resp: httpx.Response, n_events: int) -> Any:
    seen = 0
    for line in resp.iter_lines():
        yield line
        seen += line.startswith("data: ")
        if seen == n_events:
            return


def test_cancel_keeps_the_output_so_far_and_frees_the_slot(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    queued = client.responses.create(**long_body(), background=True)
    running = wait_until(
        client, queued.id, lambda r: r.status == "in_progress", timeout=60
    )  # fmt: skip
    assert running.output == []
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.id == queued.id
    assert 0 < cancelled.usage.output_tokens < 3000
    assert client.responses.cancel(queued.id) == cancelled  # again: idempotent
    assert client.responses.retrieve(queued.id) == cancelled
    wait_kv_free(http, timeout=5)  # the 3,000 tokens would take far longer
    # Not running: a synchronous response, an unknown one.
    sync = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.cancel(sync.id)
    assert "synchronous" in exc.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_" + "0" * 32)


def test_a_running_response_cannot_be_continued_and_is_deleted(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    queued = client.responses.create(**long_body(), background=True)
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=MODEL, input="Go on.", previous_response_id=queued.id)
    assert exc.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as exc:  # not streamed: nothing to read again
        list(client.responses.retrieve(queued.id, stream=True))
    assert exc.value.body["param"] == "stream"
    start = time.monotonic()
    deleted = http.delete(f"/v1/responses/{queued.id}")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    # Ended, not run to its end: the 3,000 tokens would take far longer.
    assert time.monotonic() - start < 5
    wait_kv_free(http, timeout=5)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(queued.id)


def test_background_needs_the_store(http: httpx.Client) -> None:
    resp = http.post("/v1/responses", json={"input": "Hi", "background": True, "store": False})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "background"

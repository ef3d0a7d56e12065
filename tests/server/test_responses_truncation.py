"""`truncation: "auto"` on /v1/responses (server/responses.py `auto_truncated`): a conversation
over the context loses as few of its oldest turns as make it fit (the instructions stay, what
is kept starts at a user message) and is answered as the chat route answers that part; without
it the same request is a 400; the stored conversation keeps every turn."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_fixtures import ServerProcess

CONTEXT = 192
WORDS = ("river stone light garden window music paper silver morning cloud quiet letter "
         "orange forest bridge candle winter market").split()  # fmt: skip


def words(n: int) -> str:
    return " ".join(random.choices(WORDS, k=n))


@pytest.fixture(scope="module", name="http")
def http_fixture() -> Iterator[httpx.Client]:
    srv = ServerProcess(["--context-length", str(CONTEXT)])
    with httpx.Client(base_url=srv.url, timeout=120) as http:
        yield http
    srv.stop()


def prompt_len(http: httpx.Client, messages: list[dict[str, str]]) -> int:
    return http.post("/tokenize", json={"messages": messages}).json()["count"]


def test_the_oldest_turns_are_dropped_to_fit(http: httpx.Client) -> None:
    turns: list[dict[str, Any]] = []
    for _ in range(random.randint(5, 8)):
        turns += [{"role": "user", "content": words(random.randint(8, 20))},
                  {"role": "assistant", "content": words(random.randint(8, 20))}]  # fmt: skip
    turns.append({"role": "user", "content": words(6)})
    system = [{"role": "system", "content": "Answer briefly."}]
    n_out = random.randint(4, 12)
    body = {"input": turns, "instructions": system[0]["content"], "max_output_tokens": n_out,
            "temperature": 0}  # fmt: skip
    assert prompt_len(http, system + turns) + n_out > CONTEXT  # the test's premise
    refused = http.post("/v1/responses", json=body)
    assert refused.status_code == 400, refused.text
    resp = http.post("/v1/responses", json={**body, "truncation": "auto"}).json()
    assert resp["truncation"] == "auto" and resp["status"] in ("completed", "incomplete")
    # The longest tail that starts at a user message and fits.
    starts = [i for i, t in enumerate(turns) if t["role"] == "user"]
    kept = next(system + turns[i:] for i in starts
                if prompt_len(http, system + turns[i:]) + n_out <= CONTEXT)  # fmt: skip
    assert resp["usage"]["input_tokens"] == prompt_len(http, kept)
    chat = http.post("/v1/chat/completions", json={"messages": kept, "max_tokens": n_out,
                                                    "temperature": 0}).json()  # fmt: skip
    assert resp["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    # The stored response keeps the whole conversation: a next turn goes on from it.
    listed = http.get(f"/v1/responses/{resp['id']}/input_items", params={"limit": 100}).json()
    assert len(listed["data"]) == len(turns)
    follow_up = {"input": words(4), "previous_response_id": resp["id"], "max_output_tokens": 4,
                 "truncation": "auto"}  # fmt: skip
    more = http.post("/v1/responses", json=follow_up)
    assert more.status_code == 200, more.text


def test_a_last_turn_over_the_context_is_still_a_400(http: httpx.Client) -> None:
    body = {"input": words(CONTEXT * 2), "max_output_tokens": 4, "truncation": "auto"}
    resp = http.post("/v1/responses", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "input"

"""X-Request-Id (server/middleware.py): a request's header names its completion (`cmpl-ID`,
`chatcmpl-ID`, every chunk of a stream too, as vLLM's), and with --enable-request-id-headers
(the shared server's) every answer carries it back, errors included, a new id where the
request sent none (which then names the completion); without the flag no header comes back."""

from __future__ import annotations

import json
import uuid

import httpx
from server_fixtures import (  # noqa: F401 (fixtures)
    API_KEY,
    ServerProcess,
    http_fixture,
    key_server_fixture,
    server_fixture,
)

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def test_the_sent_id_names_the_call_and_comes_back(http: httpx.Client) -> None:
    sent = f"trace-{uuid.uuid4().hex[:12]}"
    chat = http.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": sent})
    assert chat.json()["id"] == f"chatcmpl-{sent}" and chat.headers["x-request-id"] == sent
    cmpl = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3},
                     headers={"X-Request-Id": sent})  # fmt: skip
    assert cmpl.json()["id"] == f"cmpl-{sent}" and cmpl.headers["x-request-id"] == sent
    lines = http.post("/v1/chat/completions", json={**CHAT, "stream": True},
                      headers={"X-Request-Id": sent}).text  # fmt: skip
    ids = {json.loads(x[6:])["id"] for x in lines.splitlines() if x.startswith("data: {")}
    assert ids == {f"chatcmpl-{sent}"}
    missing = http.get("/v1/models/no-such-model", headers={"X-Request-Id": sent})
    assert missing.status_code == 404 and missing.headers["x-request-id"] == sent


def test_a_new_id_where_none_was_sent(http: httpx.Client) -> None:
    first = http.post("/v1/chat/completions", json=CHAT)
    second = http.post("/v1/chat/completions", json=CHAT)
    made = [r.headers["x-request-id"] for r in (first, second)]
    assert made[0] != made[1]
    assert [r.json()["id"] for r in (first, second)] == [f"chatcmpl-{m}" for m in made]


def test_no_header_back_without_the_flag(key_server: ServerProcess) -> None:
    sent = f"trace-{uuid.uuid4().hex[:12]}"
    headers = {"X-Request-Id": sent, "Authorization": f"Bearer {API_KEY}"}
    resp = httpx.post(key_server.url + "/v1/chat/completions", json=CHAT, timeout=120,
                      headers=headers)  # fmt: skip
    assert resp.status_code == 200 and "x-request-id" not in resp.headers
    assert resp.json()["id"] == f"chatcmpl-{sent}"  # the id still names the call

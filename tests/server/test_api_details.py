"""Small things clients trip over (issue #20 item 9): top_k 0 means off, one `created` per
completions stream, the Bearer scheme in any case, and `param` naming fields only."""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest
from server_fixtures import (  # noqa: F401 (fixtures)
    API_KEY,
    ServerProcess,
    http_fixture,
    key_server_fixture,
    server_fixture,
)


def test_top_k_0_is_off_like_minus_1(http: httpx.Client) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 7}
    texts = []
    for top_k in (0, -1, None):
        resp = http.post("/v1/completions", json={**body, "top_k": top_k})
        assert resp.status_code == 200, resp.text
        texts.append(resp.json()["choices"][0]["text"])
    assert texts[0] == texts[1] == texts[2]


def test_one_created_per_completions_stream(http: httpx.Client) -> None:
    """The stream crosses a wall-clock second, so a `created` taken per chunk would change.

    Chunk counts vary (speculation emits several tokens at once), so the precondition is
    checked on the clock the server's `created` is read from, not on the number of chunks."""
    body = {"prompt": "Count:", "max_tokens": 300, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    chunks, seconds = [], set()
    with http.stream("POST", "/v1/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                seconds.add(int(time.time()))
    assert len(seconds) > 1, "the stream ended within one second: nothing to check"
    assert len({c["created"] for c in chunks}) == 1
    assert len({c["id"] for c in chunks}) == 1


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_bearer_scheme_is_case_insensitive(key_server: ServerProcess, scheme: str) -> None:
    headers = {"Authorization": f"{scheme} {API_KEY}"}
    assert httpx.get(key_server.url + "/v1/models", headers=headers).status_code == 200
    wrong = {"Authorization": f"{scheme} not-the-key"}
    assert httpx.get(key_server.url + "/v1/models", headers=wrong).status_code == 401
    basic = {"Authorization": f"Basic {API_KEY}"}
    assert httpx.get(key_server.url + "/v1/models", headers=basic).status_code == 401


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
         "messages.0.content.0.text"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop"),
    ],
)  # fmt: skip
def test_param_names_fields_not_union_branches(http: httpx.Client, body: dict, param: str) -> None:
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(
    http: httpx.Client, path: str
) -> None:
    """vLLM's stream_options.continuous_usage_stats: each chunk with choices carries the usage so
    far (completion tokens never fewer, none past the final usage chunk's); without it only the
    last chunk has usage."""
    n_tokens = random.randint(8, 20)
    base = {"max_tokens": n_tokens, "ignore_eos": True, "stream": True, "n": 2,
            "temperature": 0.7, "seed": random.randrange(1000)}  # fmt: skip
    base |= {"prompt": "Count:"} if "chat" not in path else {
        "messages": [{"role": "user", "content": "Count:"}]}  # fmt: skip
    for continuous in (True, False):
        opts = {"include_usage": True, "continuous_usage_stats": continuous}
        resp = http.post(path, json={**base, "stream_options": opts})
        chunks = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        final = chunks[-1]
        assert final["choices"] == [] and final["usage"]["completion_tokens"] == 2 * n_tokens
        with_choices = [c for c in chunks if c["choices"]]
        if not continuous:
            assert all(c["usage"] is None for c in with_choices)
            continue
        counts = [c["usage"]["completion_tokens"] for c in with_choices]
        assert counts == sorted(counts) and counts[-1] == 2 * n_tokens
        assert all(c["usage"]["prompt_tokens"] == final["usage"]["prompt_tokens"]
                   for c in with_choices[-2:])  # fmt: skip

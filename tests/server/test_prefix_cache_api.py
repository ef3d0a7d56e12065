"""The prefix cache through the API: a second turn reports its cached prompt tokens in
`usage.prompt_tokens_details.cached_tokens` (as OpenAI does), and /metrics counts the hits."""

from __future__ import annotations

import random

import httpx
from server_fixtures import (  # noqa: F401 (fixtures)
    http_fixture,
    metric,
    server_fixture,
)


def test_second_turn_reports_cached_tokens_and_metrics_count_them(http: httpx.Client) -> None:
    words = random.sample(["river", "stone", "lamp", "cloud", "maple", "harbor", "violet"], 5)
    system = {"role": "system", "content": "You answer briefly. Topic words: " + " ".join(words)}
    first = [system, {"role": "user", "content": "Name one of the topic words."}]
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    hits0 = metric(http, "eagleserve_prefix_cache_hit_tokens_total")
    queried0 = metric(http, "eagleserve_prefix_cache_queried_tokens_total")
    one = http.post("/v1/chat/completions", json={**body, "messages": first}).json()
    reply = {"role": "assistant", "content": one["choices"][0]["message"]["content"]}
    second = [*first, reply, {"role": "user", "content": "And another one?"}]
    two = http.post("/v1/chat/completions", json={**body, "messages": second}).json()
    assert one["usage"]["prompt_tokens_details"]["cached_tokens"] < 10  # a fresh system prompt
    cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert one["usage"]["prompt_tokens"] - 1 <= cached < two["usage"]["prompt_tokens"]
    hits = metric(http, "eagleserve_prefix_cache_hit_tokens_total") - hits0
    queried = metric(http, "eagleserve_prefix_cache_queried_tokens_total") - queried0
    assert hits >= cached
    assert queried == one["usage"]["prompt_tokens"] + two["usage"]["prompt_tokens"]
    assert 0 < metric(http, "eagleserve_prefix_cache_hit_rate") <= 1
    assert metric(http, "eagleserve_kv_cached_tokens") >= cached

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


def test_a_salted_request_shares_no_cached_prefix(http: httpx.Client) -> None:
    """vLLM's cache_salt: a salted request finds none of a cached prompt, leaves nothing of its
    own prompt for others, and answers as an unsalted one does."""
    words = " ".join(random.sample(["river", "stone", "lamp", "cloud", "maple", "harbor"], 5))
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    cached = lambda r: r["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    plain = http.post("/v1/completions", json={**body, "prompt": f"Words: {words}."}).json()
    salted = http.post("/v1/completions", json={**body, "prompt": f"Words: {words}.",
                                                "cache_salt": "tenant-a"}).json()  # fmt: skip
    assert cached(salted) == 0 and salted["choices"][0]["text"] == plain["choices"][0]["text"]
    again = http.post("/v1/completions", json={**body, "prompt": f"Words: {words}."}).json()
    assert cached(again) >= plain["usage"]["prompt_tokens"] - 1  # the unsalted one's KV
    secret = f"Secret {random.randrange(10**9)}: {words}"
    http.post("/v1/completions", json={**body, "prompt": secret, "cache_salt": "tenant-b"})
    probe = http.post("/v1/completions", json={**body, "prompt": secret}).json()
    assert cached(probe) < 3  # nothing of the salted prompt was cached
    bad = http.post("/v1/completions", json={**body, "prompt": "x", "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"

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


def test_a_salted_request_shares_its_cache_with_its_salt_only(http: httpx.Client) -> None:
    """vLLM's cache_salt: a salted request finds nothing that an unsalted or differently salted
    one cached, and what it cached serves its own salt only; answers are those of an unsalted
    request."""
    words = " ".join(random.sample(["river", "stone", "lamp", "cloud", "maple", "harbor"], 5))
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    cached = lambda r: r["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731

    def ask(prompt: str, salt: str | None = None) -> dict:
        salted = {} if salt is None else {"cache_salt": salt}
        return http.post("/v1/completions", json={**body, "prompt": prompt, **salted}).json()

    prompt = f"Words: {words}."
    plain = ask(prompt)
    first = ask(prompt, "tenant-a")
    assert cached(first) == 0 and first["choices"][0]["text"] == plain["choices"][0]["text"]
    assert cached(ask(prompt, "tenant-a")) >= plain["usage"]["prompt_tokens"] - 1
    assert cached(ask(prompt)) >= plain["usage"]["prompt_tokens"] - 1  # the unsalted one's
    secret = f"Secret {random.randrange(10**9)}: {words}"
    ask(secret, "tenant-b")
    assert cached(ask(secret)) < 3 and cached(ask(secret, "tenant-c")) < 3
    bad = http.post("/v1/completions", json={**body, "prompt": "x", "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"

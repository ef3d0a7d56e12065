"""vLLM's `return_token_ids` through the HTTP server: each choice's prompt ids are what the model
read (/tokenize's, or the ids sent) and its token ids decode to its text and count as its
completion tokens; a stream sends the prompt's ids once (a choice's first chunk on
/v1/completions, the first chunk on chat) and each chunk's new ids, which join to the whole
answer's; without it the answer has neither key."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
from server_fixtures import (  # noqa: F401 (fixtures)
    ServerProcess,
    http_fixture,
    server_fixture,
    spec_server_fixture,
    tokenizer_fixture,
)

PROMPTS = ["The days of the week are", "Write a short poem about the sea.", "1, 2, 3, 4,"]
QUESTIONS = ["Name three colours.", "What is the capital of France?", "Count to five."]


def chunks(http: httpx.Client, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    text = http.post(route, json={**body, "stream": True}).text
    return [json.loads(x[6:]) for x in text.splitlines() if x.startswith("data: {")]


def sampled(n_tokens: int) -> dict[str, Any]:
    return {"max_tokens": n_tokens, "temperature": 1.0, "seed": random.randrange(10**6),
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip


def test_completions(http: httpx.Client, tokenizer: Any) -> None:
    texts = random.sample(PROMPTS, 2)
    as_ids = random.random() < 0.5  # a list of texts, or of token id lists
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts] if as_ids else texts
    n = random.randint(1, 2)
    body = {"prompt": prompts, "n": n, **sampled(random.randint(4, 20))}
    whole = http.post("/v1/completions", json=body).json()
    read = [p if as_ids else http.post("/tokenize", json={"prompt": p}).json()["tokens"]
            for p in prompts]  # fmt: skip
    want_prompts = [read[0]] * n + [read[1]] * n
    assert [c["prompt_token_ids"] for c in whole["choices"]] == want_prompts
    for c in whole["choices"]:
        assert tokenizer.decode(c["token_ids"], skip_special_tokens=True) == c["text"]
    assert sum(len(c["token_ids"]) for c in whole["choices"]) == whole["usage"][
        "completion_tokens"]  # fmt: skip
    streamed = chunks(http, "/v1/completions", body)
    for c in whole["choices"]:
        mine = [x["choices"][0] for x in streamed if x["choices"]
                and x["choices"][0]["index"] == c["index"]]  # fmt: skip
        assert [x.get("prompt_token_ids") for x in mine] == [c["prompt_token_ids"]] + [None] * (
            len(mine) - 1)  # fmt: skip
        assert sum((x["token_ids"] for x in mine), []) == c["token_ids"]
        assert "".join(x["text"] for x in mine) == c["text"]
    plain = http.post("/v1/completions", json={**body, "return_token_ids": False}).json()
    assert not {"prompt_token_ids", "token_ids"} & set(plain["choices"][0])


def test_chat(http: httpx.Client, tokenizer: Any) -> None:
    messages = [{"role": "user", "content": random.choice(QUESTIONS)}]
    body = {"messages": messages, "n": random.randint(1, 2), **sampled(random.randint(4, 20))}
    whole = http.post("/v1/chat/completions", json=body).json()
    read = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert whole["prompt_token_ids"] == read
    for c in whole["choices"]:
        content = c["message"]["content"]
        assert tokenizer.decode(c["token_ids"], skip_special_tokens=True) == content
    streamed = chunks(http, "/v1/chat/completions", body)
    assert [x.get("prompt_token_ids") for x in streamed] == [read] + [None] * (len(streamed) - 1)
    for c in whole["choices"]:
        mine = [x["choices"][0] for x in streamed if x["choices"]
                and x["choices"][0]["index"] == c["index"]]  # fmt: skip
        assert sum((x.get("token_ids") or [] for x in mine), []) == c["token_ids"]
    plain = http.post("/v1/chat/completions", json={**body, "return_token_ids": None}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_not_on_responses(http: httpx.Client) -> None:
    resp = http.post("/v1/responses", json={"input": "Hi", "return_token_ids": True})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "return_token_ids"


def test_a_verify_s_tokens_come_in_one_chunk(
    http: httpx.Client, spec_server: ServerProcess
) -> None:
    """With EAGLE (the shipped head, a 3-step chain), a chunk holds the tokens one verify
    accepted; the ids join to target-only's greedy ids (the shared server's)."""
    several = False
    for prompt in random.sample(PROMPTS, 2):
        body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        want = http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
        with httpx.Client(base_url=spec_server.url, timeout=120) as spec_http:
            got = chunks(spec_http, "/v1/completions", body)
        ids = [c["choices"][0]["token_ids"] for c in got if c["choices"]]
        assert sum(ids, []) == want
        several |= any(len(x) > 1 for x in ids)
    assert several, "no chunk held several tokens: the stream's ids went untested"

"""vLLM's allowed_token_ids, bad_words, prompt_logprobs and return_tokens_as_token_ids through
the HTTP server (the default model, its shipped speculative config): each changes the answer
as vLLM's does. The engine-side masks are tested in tests/constrained and
tests/spec/test_token_constraint_lossless.py."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest
from server_fixtures import (  # noqa: F401 (fixtures)
    base_url_fixture,
    http_fixture,
    server_fixture,
    tokenizer_fixture,
)

PROMPTS = ["The days of the week are", "Write a short poem about the sea.", "1, 2, 3, 4,"]


def ids_of(choice: dict[str, Any]) -> list[int]:
    """The generated ids, from logprobs that name tokens `token_id:N`."""
    tokens = choice["logprobs"]["tokens"]
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.split(":")[1]) for t in tokens]


def complete(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    body = {"max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True, **fields}  # fmt: skip
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def test_tokens_named_by_id_are_the_generated_ids(http: httpx.Client, tokenizer: Any) -> None:
    """return_tokens_as_token_ids: the logprobs' tokens and top alternatives are `token_id:N`,
    the ids decode to the text, and text_offset is as without it."""
    prompt = random.choice(PROMPTS)
    named = complete(http, prompt=prompt, logprobs=2)
    plain = complete(http, prompt=prompt, logprobs=2, return_tokens_as_token_ids=False)
    assert (
        tokenizer.decode(ids_of(named), skip_special_tokens=True) == named["text"] == plain["text"]
    )
    assert named["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
    assert named["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    for top in named["logprobs"]["top_logprobs"]:
        assert len(top) == 2 and all(k.startswith("token_id:") for k in top)
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 6, "temperature": 0,
        "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True,
    }).json()  # fmt: skip
    entries = chat["choices"][0]["logprobs"]["content"]
    ids = [int(e["token"].removeprefix("token_id:")) for e in entries]
    assert (
        tokenizer.decode(ids, skip_special_tokens=True) == chat["choices"][0]["message"]["content"]
    )
    assert all(e["bytes"] == list(e["token"].encode()) for e in entries)  # vLLM's bytes


def test_allowed_token_ids_hold_every_generated_token(http: httpx.Client) -> None:
    prompt = random.choice(PROMPTS)
    free = ids_of(complete(http, prompt=prompt))
    seen = sorted(set(free))
    allowed = random.sample(seen, len(seen) // 2) + random.sample(range(1000, 40000), 6)
    got = ids_of(complete(http, prompt=prompt, allowed_token_ids=allowed))
    assert len(got) == 16 and set(got) <= set(allowed) and got != free
    stream = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "temperature": 0.9,
        "seed": random.randrange(1000), "ignore_eos": True, "stream": True, "logprobs": True,
        "return_tokens_as_token_ids": True, "allowed_token_ids": allowed})  # fmt: skip
    events = [json.loads(line[6:]) for line in stream.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    entries = [e for ev in events for c in ev["choices"] if c["logprobs"]
               for e in c["logprobs"]["content"]]  # fmt: skip
    streamed = [int(e["token"].removeprefix("token_id:")) for e in entries]
    assert len(streamed) == 8 and set(streamed) <= set(allowed)


def vllm_sequences(tokenizer: Any, word: str) -> list[list[int]]:
    """vLLM's bad-word sequences: the bare word, and the word after a space when that encodes
    to as many tokens with another first one."""
    bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
    spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
    return [bare] + ([spaced] if len(spaced) == len(bare) and spaced[0] != bare[0] else [])


def holds_any(ids: list[int], seqs: list[list[int]]) -> bool:
    return any(ids[j : j + len(s)] == s for s in seqs for j in range(len(ids)))


def test_bad_words_never_appear_as_their_tokens(http: httpx.Client, tokenizer: Any) -> None:
    """Words of the free answer, banned: none of their sequences is in the answer any more
    (vLLM's rule: a word's last token is banned after the rest of it), and the answer changes."""
    prompt = random.choice(PROMPTS)
    free = complete(http, prompt=prompt, max_tokens=24)
    words = {w.strip(".,;:!?") for w in free["text"].split()} - {""}
    words = [w for w in sorted(words) if holds_any(ids_of(free), vllm_sequences(tokenizer, w))]
    assert words, free["text"]
    banned = random.sample(words, min(2, len(words)))
    got = complete(http, prompt=prompt, max_tokens=24, bad_words=banned)
    for w in banned:
        assert not holds_any(ids_of(got), vllm_sequences(tokenizer, w)), (w, got["text"])
    assert got["text"] != free["text"]


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_in_vllms_form(http: httpx.Client, tokenizer: Any, k: int) -> None:
    """Per prompt token: None first, then the token's own entry (its rank: 1 + the tokens more
    likely) and the top k with ranks 1..k; the numbers are the echo's."""
    prompt = random.choice(PROMPTS)
    ids = tokenizer.encode(prompt)
    got = complete(http, prompt=prompt, max_tokens=2, prompt_logprobs=k)
    echo = complete(http, prompt=prompt, max_tokens=2, echo=True, logprobs=max(k, 1),
                    return_tokens_as_token_ids=False)["logprobs"]  # fmt: skip
    scores = got["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    for j, (token, entry) in enumerate(zip(ids[1:], scores[1:], strict=True), start=1):
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(echo["token_logprobs"][j], abs=1e-5)
        assert own["decoded_token"] == tokenizer.decode([token])
        top = sorted((e for t, e in entry.items() if t != str(token) or e["rank"] <= k),
                     key=lambda e: e["rank"])  # fmt: skip
        assert [e["rank"] for e in top] == list(range(1, k + 1))
        values = [e["logprob"] for e in top]
        assert values == sorted(values, reverse=True)
        assert own["rank"] == 1 + sum(e["logprob"] > own["logprob"] for e in top) or own["rank"] > k
    assert "prompt_logprobs" not in complete(http, prompt=prompt, max_tokens=1)
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 2, "n": 2,
        "prompt_logprobs": 1}).json()  # fmt: skip
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert chat["prompt_logprobs"][0] is None and all(chat["prompt_logprobs"][1:])

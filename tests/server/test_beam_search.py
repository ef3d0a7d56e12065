"""vLLM's beam search (server/beam_search.py): its step and ranking as pure functions on fresh
random beams, and through the HTTP server on the default model: width 1 is greedy decoding,
each beam's logprobs are the model's own for its tokens, choices come best first by the
length-penalized score, and what beam search does not take is a 400 naming it."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest
from server_fixtures import (  # noqa: F401 (fixtures)
    http_fixture,
    server_fixture,
    tokenizer_fixture,
)

from eagleserve.server.beam_search import Beam, advance_beams, beam_score, best_beams


def random_beams(rng: random.Random, n: int) -> list[Beam]:
    """n beams, each with tokens of its own (its index last)."""
    return [Beam([rng.randrange(50) for _ in range(rng.randint(1, 5))] + [100 + i],
                 -rng.random() * 5) for i in range(n)]  # fmt: skip


def test_a_step_keeps_the_best_extensions_and_completes_eos_ones() -> None:
    rng = random.Random()
    for _ in range(50):
        width, eos = rng.randint(1, 4), rng.choice([None, 7])
        beams = random_beams(rng, rng.randint(1, width))
        cands = [[(rng.randrange(12), -rng.random() * 3) for _ in range(2 * width)] for _ in beams]
        kept, done = advance_beams(beams, cands, width, eos)
        every = [(b.tokens + [t], b.cum_logprob + lp) for b, cs in zip(beams, cands)
                 for t, lp in cs]  # fmt: skip
        going = sorted((c for t, c in every if t[-1] != eos), reverse=True)[:width]
        assert [b.cum_logprob for b in kept] == pytest.approx(going)
        assert sorted(b.cum_logprob for b in done) == pytest.approx(
            sorted(c for t, c in every if t[-1] == eos))  # fmt: skip
        assert all(b.ended_by_eos and b.tokens[-1] == eos for b in done)
        for b in kept:
            assert len(b.logprobs) == len(b.candidates) and b.cum_logprob == pytest.approx(
                next(x.cum_logprob for x in beams if x.tokens == b.tokens[:-1]) + b.logprobs[-1]
            )  # fmt: skip


def test_ranking_divides_by_the_length_without_eos() -> None:
    rng = random.Random()
    beams = random_beams(rng, 6)
    beams[0].ended_by_eos = True
    for penalty in (0.0, 1.0, rng.uniform(0.2, 3.0)):
        ranked = best_beams(beams, 4, penalty)
        scores = [b.cum_logprob / (len(b.tokens) - b.ended_by_eos) ** penalty for b in ranked]
        assert scores == sorted(scores, reverse=True) and len(ranked) == 4
        assert beam_score(ranked[0], penalty) == pytest.approx(scores[0])


def beam_ids(choice: dict[str, Any]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


def search(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    body = {"use_beam_search": True, "temperature": 0, "logprobs": 1,
            "return_tokens_as_token_ids": True, **fields}  # fmt: skip
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):"]


def test_width_one_is_greedy_decoding(http: httpx.Client) -> None:
    prompt = random.choice(PROMPTS)
    beam = search(http, prompt=prompt, n=1, max_tokens=8, ignore_eos=True)["choices"][0]
    plain = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    greedy = http.post("/v1/completions", json=plain).json()
    assert beam["text"] == greedy["choices"][0]["text"]


def test_beams_are_the_models_own_and_best_first(http: httpx.Client, tokenizer: Any) -> None:
    """n = 3 beams: distinct; each token's logprob is what the model gives it scoring the beam
    as a prompt; ranked by cumulative logprob / length ** length_penalty."""
    prompt, penalty = random.choice(PROMPTS), random.choice([0.0, 1.0, 1.7])
    ids = tokenizer.encode(prompt)
    got = search(http, prompt=prompt, n=3, max_tokens=5, length_penalty=penalty)
    choices = got["choices"]
    beams = [beam_ids(c) for c in choices]
    assert len(choices) == 3 and len({tuple(b) for b in beams}) == 3
    scores = []
    for c, beam in zip(choices, beams, strict=True):
        lps = c["logprobs"]["token_logprobs"]
        scoring = {"prompt": ids + beam, "max_tokens": 0, "echo": True, "logprobs": 0}
        scored = http.post("/v1/completions", json=scoring).json()
        forced = scored["choices"][0]["logprobs"]["token_logprobs"][len(ids) :]
        assert lps == pytest.approx(forced, abs=1e-3)
        ended = c["finish_reason"] == "stop"
        scores.append(sum(lps) / (len(ids) + len(beam) - ended) ** penalty)
    assert scores == sorted(scores, reverse=True)
    assert got["usage"]["completion_tokens"] == sum(len(b) for b in beams)
    streamed = http.post("/v1/completions", json={"prompt": prompt, "n": 3, "max_tokens": 5,
                                                  "use_beam_search": True, "stream": True,
                                                  "length_penalty": penalty})  # fmt: skip
    texts = {}
    for line in streamed.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert [texts[i] for i in range(3)] == [c["text"] for c in choices]


def test_chat_beams_end_at_eos(http: httpx.Client) -> None:
    resp = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 40, "n": 2,
        "use_beam_search": True}).json()  # fmt: skip
    assert len(resp["choices"]) == 2
    for c in resp["choices"]:
        assert c["finish_reason"] in ("stop", "length")
        assert "<|im_end|>" not in c["message"]["content"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"length_penalty": 0.5}, "length_penalty"),
     ({"use_beam_search": True, "n": 11}, "n"),
     ({"use_beam_search": True, "stop": ["."]}, "stop"),
     ({"use_beam_search": True, "frequency_penalty": 0.5}, "frequency_penalty"),
     ({"use_beam_search": True, "regex": "[a-z]+"}, "regex"),
     ({"use_beam_search": True, "echo": True}, "echo")],
)  # fmt: skip
def test_what_beam_search_does_not_take_is_a_400(
    http: httpx.Client, extra: dict[str, Any], param: str
) -> None:
    resp = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **extra})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    neutral = {"prompt": "x", "max_tokens": 2, "n": 2, "use_beam_search": True, "stop": [],
               "frequency_penalty": 0, "response_format": {"type": "text"}}  # fmt: skip
    ok = http.post("/v1/completions", json=neutral)
    assert ok.status_code == 200, ok.text

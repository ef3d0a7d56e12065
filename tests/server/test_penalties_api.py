"""Penalties, logit_bias, min_tokens and prompt logprobs through the HTTP API (SmolLM2, the
`openai` client): each changes the output as defined, equals the offline Engine with the same
fields, and echo + logprobs scores the prompt exactly as a plain transformers forward does."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import openai
import pytest
import torch
from conftest import forward_tokens
from server_fixtures import (  # noqa: F401 (fixtures)
    MODEL,
    base_url_fixture,
    engine_fixture,
    http_fixture,
    server_fixture,
    tokenizer_fixture,
    wait_kv_free,
)

from eagleserve.sampling_params import SamplingParams

COUNTING = "Count: 1, 2, 3, 4,"
PROMPTS = ["The capital of France is", "Once upon a time", "My favourite food is",
           "Water boils at"]  # fmt: skip


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def prompt_scores(engine: Any, ids: list[int]) -> torch.Tensor:
    """Logprobs after every prompt token from one plain forward of the served model (the
    offline engine's runner: the same packed weights), all logits rows, in fresh slots."""
    runner = engine.scheduler.worker.runner
    n = len(ids)
    loc = runner.token_to_kv_pool.alloc(n)
    slot = runner.req_to_token_pool.alloc()
    try:
        runner.req_to_token_pool.req_to_token[slot, :n] = loc
        req, start, length = torch.tensor([slot]), torch.tensor([0]), torch.tensor([n])
        out = forward_tokens(runner, "extend", torch.tensor(ids), torch.arange(n), loc, req,
                             start, length)  # fmt: skip
    finally:
        runner.token_to_kv_pool.free(loc)
        runner.req_to_token_pool.free(slot)
    return torch.log_softmax(out.logits.double(), dim=-1)


def test_logit_bias_bans_a_token(client: openai.OpenAI, tokenizer: Any) -> None:
    comma = tokenizer.encode(",", add_special_tokens=False)
    assert len(comma) == 1
    plain = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=8, temperature=0)
    assert "," in plain.choices[0].text
    banned = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=8, temperature=0,
                                       logit_bias={str(comma[0]): -100})  # fmt: skip
    assert "," not in banned.choices[0].text and banned.usage.completion_tokens == 8
    forced = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=4, temperature=0,
                                       logit_bias={str(comma[0]): 100})  # fmt: skip
    assert forced.choices[0].text == ",,,,"


def test_penalties_equal_the_offline_engine(client: openai.OpenAI, engine: Any) -> None:
    rng = random.Random()
    fields = dict(presence_penalty=round(rng.uniform(0.5, 2), 3),
                  frequency_penalty=round(rng.uniform(0.5, 2), 3),
                  repetition_penalty=round(rng.uniform(1.2, 2), 3))  # fmt: skip
    for prompt in PROMPTS[:2]:
        want = engine.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0,
                                                        ignore_eos=True, **fields))[0]  # fmt: skip
        plain = engine.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0,
                                                         ignore_eos=True))[0]  # fmt: skip
        assert want["token_ids"] != plain["token_ids"], "the penalties should change the text"
        rep = {"repetition_penalty": fields["repetition_penalty"]}
        got = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
            presence_penalty=fields["presence_penalty"],
            frequency_penalty=fields["frequency_penalty"],
            extra_body={"ignore_eos": True, **rep},
        )  # fmt: skip
        assert got.choices[0].text == want["text"]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=6,
        temperature=0, presence_penalty=fields["presence_penalty"], extra_body=rep,
    )  # fmt: skip
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_min_tokens_defers_stop_strings(client: openai.OpenAI, tokenizer: Any) -> None:
    plain = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=12, temperature=0,
                                      stop=[","])  # fmt: skip
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens <= 3
    full = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=12, temperature=0)
    held = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=12, temperature=0,
                                     stop=[","], extra_body={"min_tokens": 6})  # fmt: skip
    text = held.choices[0].text
    assert held.usage.completion_tokens >= 7
    first_six = tokenizer.decode(tokenizer.encode(full.choices[0].text,
                                                  add_special_tokens=False)[:6])  # fmt: skip
    assert text.startswith(first_six) and "," in first_six  # a comma inside min_tokens stays
    assert full.choices[0].text.startswith(text)


def test_echo_logprobs_score_the_prompt(client: openai.OpenAI, tokenizer: Any, engine: Any) -> None:
    prompt = random.choice(PROMPTS)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    ref = prompt_scores(engine, ids)
    for max_tokens in (0, 3):
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                         temperature=0, echo=True, logprobs=2)  # fmt: skip
        choice = resp.choices[0]
        lp = choice.logprobs
        assert choice.text.startswith(prompt) and len(lp.tokens) == len(ids) + max_tokens
        assert resp.usage.completion_tokens == max_tokens and choice.finish_reason == "length"
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = [ref[j, ids[j + 1]].item() for j in range(len(ids) - 1)]
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=1e-4)
        for j in range(1, len(ids)):
            top_ids = ref[j - 1].topk(2).indices.tolist()
            assert list(lp.top_logprobs[j]) == [tokenizer.decode([t]) for t in top_ids]
        assert "".join(lp.tokens[: len(ids)]) == prompt and lp.text_offset[0] == 0
    if max_tokens:
        assert all(v <= 0 for v in lp.token_logprobs[len(ids) :])


def test_echo_logprobs_stream_equals_non_stream(http: httpx.Client) -> None:
    body = {"prompt": [PROMPTS[0], PROMPTS[1]], "max_tokens": 4, "temperature": 0, "echo": True,
            "logprobs": 1}  # fmt: skip
    whole = http.post("/v1/completions", json=body).json()
    texts = ["", ""]
    tokens: list[list[str]] = [[], []]
    values: list[list[float | None]] = [[], []]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] += c["text"]
                if c["logprobs"]:
                    tokens[c["index"]] += c["logprobs"]["tokens"]
                    values[c["index"]] += c["logprobs"]["token_logprobs"]
    for i, c in enumerate(whole["choices"]):
        assert texts[i] == c["text"] and c["text"].startswith(PROMPTS[i])
        assert tokens[i] == c["logprobs"]["tokens"]
        assert values[i] == pytest.approx(c["logprobs"]["token_logprobs"], abs=1e-6)


def test_scoring_without_logprobs_returns_the_prompt(http: httpx.Client) -> None:
    resp = http.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 0,
                                              "echo": True})  # fmt: skip
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["text"] == PROMPTS[2] and choice["logprobs"] is None
    assert resp.json()["usage"]["completion_tokens"] == 0
    wait_kv_free(http)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logit_bias": {"49152": 1}}, "logit_bias"),  # past SmolLM2's vocabulary
        ({"logit_bias": {"1" * 5000: 1}}, "logit_bias"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"repetition_penalty": 1e9}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),  # without echo
    ],
)
def test_out_of_range_values_are_400_naming_the_field(
    http: httpx.Client, extra: dict[str, Any], param: str
) -> None:
    resp = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **extra})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param

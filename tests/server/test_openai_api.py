"""The OpenAI-compatible server, end to end: a real `eagleserve serve` process and the `openai`
client (plus raw httpx for what the client cannot send)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from server_fixtures import (  # noqa: F401 (fixtures)
    MODEL,
    base_url_fixture,
    engine_fixture,
    http_fixture,
    metric,
    server_fixture,
    tokenizer_fixture,
    wait_kv_free,
)

from eagleserve.core import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
           "My favourite food is", "The quick brown fox", "In 1969, astronauts",
           "Water boils at", "A haiku about autumn:"]  # fmt: skip


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def greedy(engine: Any, prompts: list[Any], max_tokens: int, **kw: Any) -> list[dict]:
    return engine.generate(prompts, SamplingParams(max_new_tokens=max_tokens, temperature=0, **kw))


def test_health_and_models(http: httpx.Client, client: openai.OpenAI) -> None:
    assert http.get("/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(MODEL + "-other")


def test_completion_greedy_equals_engine(client: openai.OpenAI, engine: Any) -> None:
    want = greedy(engine, PROMPTS[:2], 12)
    for prompt, w in zip(PROMPTS[:2], want, strict=True):
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert resp.object == "text_completion"
        assert resp.choices[0].text == w["text"]
        assert resp.choices[0].finish_reason == w["finish_reason"]
        assert resp.usage.completion_tokens == len(w["token_ids"])
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_token_id_prompts_and_echo(client: openai.OpenAI, tokenizer: Any) -> None:
    ids = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    by_text = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=6, temperature=0)
    assert [c.text for c in by_ids.choices] == [by_text.choices[0].text] * 2
    echo = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True
    )
    assert echo.choices[0].text == PROMPTS[0] + by_text.choices[0].text


def test_chat_greedy_equals_engine(client: openai.OpenAI, engine: Any, tokenizer: Any) -> None:
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    want = greedy(engine, [ids], 10)[0]
    resp = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == want["text"]
    assert resp.usage.prompt_tokens == len(ids)
    resp2 = client.chat.completions.create(
        model=MODEL, messages=msgs, max_completion_tokens=10, temperature=0
    )
    assert resp2.choices[0].message.content == want["text"]


@pytest.mark.parametrize("chat", [False, True])
def test_stream_equals_non_stream_for_a_seed(client: openai.OpenAI, chat: bool) -> None:
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=14, temperature=0.9, seed=1234)
    if chat:
        kw["messages"] = [{"role": "user", "content": "Tell me a story."}]
        full = client.chat.completions.create(**kw).choices[0].message.content
        chunks = list(client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kw
        ))  # fmt: skip
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        kw["prompt"] = PROMPTS[1]
        full = client.completions.create(**kw).choices[0].text
        chunks = list(client.completions.create(
            stream=True, stream_options={"include_usage": True}, **kw
        ))  # fmt: skip
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 14


def test_n2(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=8, n=2, temperature=1.0, seed=5
    )
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.usage.completion_tokens == 16
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, n=2, seed=3
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=8, n=2, temperature=1.0, seed=5, stream=True
    )
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in resp.choices]  # seed + i per choice, same as non-streamed


def test_logprobs(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == resp.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the top one
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_stop_strings(client: openai.OpenAI, engine: Any) -> None:
    full = greedy(engine, [PROMPTS[3]], 16)[0]["text"]
    words = full.split()
    stop = words[len(words) // 2]
    want = full[: full.find(stop)]
    for stop_arg in (stop, [stop, "zzzz-not-there"]):
        resp = client.completions.create(
            model=MODEL, prompt=PROMPTS[3], max_tokens=16, temperature=0, stop=stop_arg
        )
        assert resp.choices[0].text == want
        assert resp.choices[0].finish_reason == "stop"
    chunks = client.completions.create(
        model=MODEL, prompt=PROMPTS[3], max_tokens=16, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want


def test_32_concurrent_streams(base_url: str, engine: Any, http: httpx.Client) -> None:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    want = {p: r["text"] for p, r in zip(PROMPTS, greedy(engine, PROMPTS, 8), strict=True)}

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run_all() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(aclient, p) for p in prompts))

    before = metric(http, "eagleserve_requests_total", endpoint="completions")
    got = asyncio.run(run_all())
    assert got == [want[p] for p in prompts]
    assert metric(http, "eagleserve_requests_total", endpoint="completions") == before + 32
    wait_kv_free(http)

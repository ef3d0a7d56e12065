"""`--reasoning-parser` (server/reasoning.py): the thinking apart from the answer, whole and
streamed. On random texts of tag pieces, a stream cut at random places splits as the whole
text does; DeepSeek-R1's format thinks from the first token, Qwen3's only after a leading
`<think>`. Through the server: the chat answer is the raw output's split (the raw output is
what `separate_reasoning: false` gives), streamed deltas join to it, `include_reasoning: false`
drops the thinking, a response has a reasoning item, and a constraint over the whole output is
a 400 naming it."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_fixtures import ServerProcess, tokenizer_fixture  # noqa: F401 (fixtures)

from eagleserve.server.reasoning import (
    PARSERS,
    ReasoningStream,
    reasoning_format,
    split_reasoning,
)

PIECES = ["<think>", "</think>", "<th", "</", "think", ">", "a", "b c", "\n", " ", "<", "/"]


def random_text() -> str:
    return "".join(random.choices(PIECES, k=random.randint(0, 12)))


def streamed(name: str, text: str) -> tuple[str, str]:
    split = ReasoningStream(PARSERS[name])
    cuts = sorted(random.sample(range(len(text) + 1), random.randint(0, len(text) + 1)))
    thinking, answer = "", ""
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        t, c = split.feed(text[a:b])
        thinking, answer = thinking + t, answer + c
    t, c = split.flush()
    return thinking + t, answer + c


@pytest.mark.parametrize("name", list(PARSERS))
def test_a_stream_splits_as_the_whole_text(name: str) -> None:
    for _ in range(300):
        text = random_text()
        whole = split_reasoning(PARSERS[name], text)
        assert streamed(name, text) == (whole[0] or "", whole[1] or ""), text


def test_the_formats() -> None:
    r1, qwen3 = reasoning_format("deepseek_r1"), reasoning_format("qwen3")
    thought, answer = "".join(random.choices("abc ", k=8)), "".join(random.choices("xyz ", k=8))
    for fmt in (r1, qwen3):
        assert split_reasoning(fmt, f"<think>{thought}</think>{answer}") == (thought, answer)
        assert split_reasoning(fmt, f"<think>{thought}") == (thought, None)  # cut by length
    assert split_reasoning(r1, f"{thought}</think>{answer}") == (thought, answer)
    assert split_reasoning(r1, answer) == (answer, None)  # R1 thinks until it says otherwise
    assert split_reasoning(qwen3, f"{thought}</think>{answer}") == (
        None, f"{thought}</think>{answer}")  # fmt: skip
    with pytest.raises(ValueError, match="deepseek-r1"):
        reasoning_format("o1")


@pytest.fixture(scope="module", name="server")
def server_fixture() -> Iterator[ServerProcess]:
    srv = ServerProcess(["--reasoning-parser", "deepseek-r1"])
    yield srv
    srv.stop()


def chat(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]


def test_answers_are_the_raw_outputs_split(server: ServerProcess, tokenizer: Any) -> None:
    # "</think>"'s tokens and one more, and a prompt to repeat them: sampled answers hold the
    # end tag, and some end inside it.
    allowed = tokenizer.encode("</think> ok", add_special_tokens=False)
    ask = [{"role": "user", "content": "Repeat exactly: </think> ok </think> ok </think> ok"}]
    r1 = PARSERS["deepseek-r1"]
    answered = split_deltas = 0
    with httpx.Client(base_url=server.url, timeout=120) as http:
        # Seeds until both cases came (at least 4, at most 24: each alone comes in most).
        for i, seed in enumerate(random.sample(range(10**6), 24)):
            if i >= 4 and answered and split_deltas:
                break
            body = {"messages": ask, "max_tokens": 24, "temperature": 1.0, "seed": seed,
                    "ignore_eos": True, "allowed_token_ids": allowed}  # fmt: skip
            raw = chat(http, {**body, "separate_reasoning": False})
            assert "reasoning_content" not in raw
            thinking, answer = split_reasoning(r1, raw["content"])
            got = chat(http, body)
            assert (got.get("reasoning_content"), got["content"]) == (thinking, answer)
            answered += answer is not None
            assert chat(http, {**body, "include_reasoning": False}).get("reasoning_content") is None
            lines = http.post("/v1/chat/completions", json={**body, "stream": True}).text
            deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in lines.splitlines()
                      if x.startswith("data: {")]  # fmt: skip
            assert "".join(d.get("reasoning_content") or "" for d in deltas) == (thinking or "")
            assert "".join(d.get("content") or "" for d in deltas) == (answer or "")
            resp = http.post("/v1/responses", json={
                "input": body["messages"], "max_output_tokens": 24, "temperature": 1.0,
                "seed": seed, "ignore_eos": True, "allowed_token_ids": allowed}).json()  # fmt: skip
            kinds = [item["type"] for item in resp["output"]]
            assert kinds == ["reasoning", "message"][int(thinking is None) :]
            if thinking is not None:
                assert resp["output"][0]["content"][0]["text"] == thinking
            assert resp["output"][-1]["content"][0]["text"] == (answer or "")
            split_deltas += streamed_response(http, body, seed, resp, thinking, answer)
    assert answered, "no sampled answer reached the end tag: the split went untested"
    assert split_deltas, "no streamed response sent its thinking in more than one delta"
    # An answer that ends inside a tag: the stream's last piece is what it held back.
    body = {"messages": ask, "max_tokens": random.randint(1, 4), "ignore_eos": True,
            "allowed_token_ids": allowed[:1], "stream": True}  # fmt: skip
    lines = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).text
    deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in lines.splitlines()
              if x.startswith("data: {")]  # fmt: skip
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "</" * body["max_tokens"]


def streamed_response(
    http: httpx.Client, body: dict[str, Any], seed: int, whole: dict[str, Any],
    thinking: str | None, answer: str | None,
) -> bool:  # fmt: skip
    """A streamed response's thinking and answer arrive as they are made, as the reasoning
    item's deltas (closed when the answer begins) and then the message's; they join to the
    whole response's items. True if the thinking came in more than one delta."""
    lines = http.post("/v1/responses", json={
        "input": body["messages"], "max_output_tokens": 24, "temperature": 1.0, "seed": seed,
        "ignore_eos": True, "allowed_token_ids": body["allowed_token_ids"],
        "stream": True}).text  # fmt: skip
    events = [json.loads(x[6:]) for x in lines.splitlines() if x.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    thoughts = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    texts = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(thoughts) == (thinking or "") and "".join(texts) == (answer or "")
    final = events[-1]["response"]
    assert [i["content"][0]["text"] for i in final["output"]] == [
        i["content"][0]["text"] for i in whole["output"]]  # fmt: skip
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == [i["type"] for i in final["output"]]
    if thoughts and texts:  # the thinking is whole before the answer's first delta
        assert kinds.index("response.output_item.done") < kinds.index("response.output_text.delta")
        assert done[0]["status"] == final["output"][0]["status"] == "completed"
    message_at = {
        e["output_index"] for e in events if e.get("item_id") == final["output"][-1]["id"]
    }
    assert message_at == {len(final["output"]) - 1}
    return len(thoughts) > 1


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"response_format": {"type": "json_object"}}, "response_format"),
     ({"regex": "[a-z]+"}, "regex"),
     ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
      "tool_choice")],
)  # fmt: skip
def test_whole_output_constraints_are_refused(
    server: ServerProcess, extra: dict[str, Any], param: str
) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param
    ok = httpx.post(server.url + "/v1/chat/completions", json={**body, "separate_reasoning": False},
                    timeout=120)  # fmt: skip
    assert ok.status_code == 200, ok.text
    if param == "response_format":  # a response's constraint is its text.format
        resp = httpx.post(server.url + "/v1/responses", timeout=60, json={
            "input": "Hi", "text": {"format": {"type": "json_object"}}})  # fmt: skip
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "text.format"

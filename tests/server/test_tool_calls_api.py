"""Tool calls through the HTTP API (SmolLM2, the `openai` client): `required` and a named
function (one call) and parallel calls (streamed) give `tool_calls` whose arguments validate
against the tool's parameter schema; `none` gives text; bad tool fields are 400s; an earlier
call in the conversation is accepted. The parsing itself: tests/server/test_tool_calls.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_fixtures import (  # noqa: F401 (fixtures)
    MODEL,
    ServerProcess,
    base_url_fixture,
    http_fixture,
    server_fixture,
)

from eagleserve.server.tool_formats import LLAMA3

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 24}},
    "required": ["timezone"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a timezone",
                                      "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_calls_validate(client: openai.OpenAI, choice: str) -> None:
    """One call (parallel calls off), its arguments valid for the chosen tool."""
    tc: Any = "required" if choice == "required" else {
        "type": "function", "function": {"name": "get_time"}}  # fmt: skip
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tc,
                                         parallel_tool_calls=False, max_tokens=80,
                                         temperature=0)  # fmt: skip
    c = out.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    assert len(c.message.tool_calls or []) == 1
    check_calls(c.message.tool_calls or [], {"get_time"} if choice == "named" else set(SCHEMAS))
    assert c.message.content is None


def test_streamed_tool_calls_validate(client: openai.OpenAI) -> None:
    """Sampled and streamed, the calls' deltas add up to calls that validate. A sampled answer
    may ramble inside an argument until max_tokens (the small model's doing, whatever the
    seed's luck): the first of a few seeds whose stream finishes with its calls is checked."""
    for seed in range(1, 6):
        stream = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
            temperature=0.7, seed=seed, stream=True, parallel_tool_calls=True,
        )  # fmt: skip
        calls: dict[int, dict[str, str]] = {}
        reasons = []
        for chunk in stream:
            for c in chunk.choices:
                reasons.append(c.finish_reason)
                for d in c.delta.tool_calls or []:
                    entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                    entry["name"] += d.function.name or ""
                    entry["arguments"] += d.function.arguments or ""
        assert reasons[-1] in ("tool_calls", "length")
        if reasons[-1] == "tool_calls":
            break
    assert reasons[-1] == "tool_calls" and calls, "no seed finished its calls"
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])


def test_a_cut_output_reports_length_with_its_whole_calls(client: openai.OpenAI) -> None:
    """max_tokens ending the output inside its last call: finish_reason "length" (not
    "tool_calls", which would hide the cut), the calls completed before it kept as they were."""
    ask: Any = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                    parallel_tool_calls=True, temperature=0)  # fmt: skip
    full = client.chat.completions.create(max_tokens=400, **ask)
    assert full.choices[0].finish_reason == "tool_calls" and full.usage is not None
    # Three tokens short: inside the last call's closing `</tool_call>` (the last one is EOS).
    cut = client.chat.completions.create(max_tokens=full.usage.completion_tokens - 3, **ask)
    c = cut.choices[0]
    assert c.finish_reason == "length"
    kept = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
    whole = [(t.function.name, t.function.arguments) for t in full.choices[0].message.tool_calls]
    assert kept == whole[: len(whole) - 1]
    assert c.message.content  # the cut call's text


def test_tool_choice_none_is_text_and_history_is_accepted(client: openai.OpenAI) -> None:
    args = '{"city": "Paris", "unit": "celsius"}'
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]  # fmt: skip
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                         tool_choice="none", max_tokens=12,
                                         temperature=0)  # fmt: skip
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "always"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
         "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "objx"}}}], "tool_choice": "required"}, "tools"),
        ({"response_format": {"type": "json_object"}, "tool_choice": "required"}, "tools"),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_400s(http: httpx.Client, extra: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, "tools": TOOLS, **extra}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


@pytest.fixture(scope="module", name="llama3_server")
def llama3_server_fixture() -> Iterator[ServerProcess]:
    srv = ServerProcess(["--tool-call-parser", "llama3_json", "--served-model-name", MODEL])
    yield srv
    srv.stop()


def test_llama3_calls_are_written_and_read_in_llama3s_format(
    llama3_server: ServerProcess,
) -> None:
    """--tool-call-parser llama3_json: the output is Llama 3's JSON calls (the answer's raw
    text, its logprobs' tokens, reads as them) and comes back as calls that validate, with
    parallel calls on or off."""
    client = openai.OpenAI(base_url=llama3_server.url + "/v1", api_key="x", max_retries=0)
    for parallel in (False, True):
        out = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=parallel, max_tokens=120, temperature=0, logprobs=True,
        )  # fmt: skip
        c = out.choices[0]
        assert c.finish_reason == "tool_calls", c.message
        check_calls(c.message.tool_calls or [], set(SCHEMAS))
        raw = "".join(t.token for t in (c.logprobs.content or []))
        assert raw.startswith('{"name": "'), raw
        assert LLAMA3.parse(raw)[1] == [
            (t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls or []
        ]

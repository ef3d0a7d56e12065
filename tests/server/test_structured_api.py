"""Structured output through the HTTP API (SmolLM2, the `openai` client): every json_schema
answer parses and validates, greedy and sampled; json_object, regex and EBNF hold; invalid
specs are 400s naming the field; a schema cut by max_tokens finishes with `length`; grammar
compiles and cache hits show in /metrics. Tool calls: tests/server/test_tool_calls_api.py."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_fixtures import (  # noqa: F401 (fixtures)
    MODEL,
    base_url_fixture,
    http_fixture,
    metric,
    server_fixture,
)

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "location": {
                "type": "object",
                "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                "required": ["lat", "lon"],
            },
        },
        "required": ["city", "location"],
    },
    "enum_and_bool": {
        "type": "object",
        "properties": {
            "planet": {"enum": ["Mercury", "Venus", "Earth", "Mars"]},
            "has_moons": {"type": "boolean"},
        },
        "required": ["planet", "has_moons"],
    },
    "array": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["colors"],
    },
    "numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "height_m": {"type": "number"},
        },
        "required": ["age", "height_m"],
    },
}
ASK = "Describe a thing as JSON."


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}


@pytest.mark.parametrize(
    ("name", "sampled"), [(n, False) for n in SCHEMAS] + [("nested", True), ("array", True)]
)
def test_json_schema_answers_validate(client: openai.OpenAI, name: str, sampled: bool) -> None:
    """Greedy answers finish and validate. Sampled ones validate wherever they finish: one may
    ramble inside a number or string until max_tokens (the small model's doing, whatever the
    seed's luck), so of four seeds, those that stop are checked, and most must stop."""
    schema = SCHEMAS[name]
    finished = 0
    for seed in range(3, 7 if sampled else 4):
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"{ASK} ({name})"}],
            max_tokens=80, temperature=0.8 if sampled else 0, seed=seed,
            response_format=schema_format(schema),
        )  # fmt: skip
        choice = out.choices[0]
        if choice.finish_reason == "length" and sampled:
            continue
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), schema)
        finished += 1
    assert finished >= (2 if sampled else 1)


def test_json_object_and_streaming(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, max_tokens=80, temperature=0, stream=True,
        messages=[{"role": "user", "content": 'Is 2 > 1? Reply in JSON with one key, "answer", '
                   'whose value is "yes" or "no".'}],
        response_format={"type": "json_object"},
    )  # fmt: skip
    parts, reasons = [], []
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert isinstance(json.loads("".join(parts)), dict)
    assert reasons[-1] == "stop"


def test_regex_and_ebnf_through_extra_body(client: openai.OpenAI) -> None:
    regex = r"(yes|no), because [a-z ]{3,20}\."
    out = client.completions.create(model=MODEL, prompt="Is the sky blue?", max_tokens=40,
                                    temperature=0, extra_body={"regex": regex})  # fmt: skip
    assert re.fullmatch(regex, out.choices[0].text), out.choices[0].text
    ebnf = 'root ::= "Answer: " digit digit? "!"\ndigit ::= [0-9]'
    out = client.completions.create(model=MODEL, prompt="2 + 2 =", max_tokens=10,
                                    temperature=0, extra_body={"ebnf": ebnf})  # fmt: skip
    assert re.fullmatch(r"Answer: [0-9]{1,2}!", out.choices[0].text), out.choices[0].text
    # ignore_eos cannot run the output past a completed grammar: it stops there.
    out = client.completions.create(model=MODEL, prompt="2 + 2 =", max_tokens=30, temperature=0,
                                    extra_body={"ebnf": ebnf, "ignore_eos": True})  # fmt: skip
    assert re.fullmatch(r"Answer: [0-9]{1,2}!", out.choices[0].text), out.choices[0].text
    assert out.choices[0].finish_reason == "stop"


def test_vllms_guided_fields_hold(client: openai.OpenAI) -> None:
    """vLLM's older (guided_*) and newer (structured_outputs) forms, each onto the same
    grammars as response_format and regex."""
    schema = SCHEMAS["enum_and_bool"]
    msgs = [{"role": "user", "content": "Which planet do we live on? Answer in JSON."}]
    for extra in (
        {"guided_json": schema},
        {"guided_json": json.dumps(schema)},
        {"structured_outputs": {"json": schema}},
        {"json_schema": json.dumps(schema)},
    ):  # SGLang's, as text; fmt: skip
        out = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60,
                                             temperature=0, extra_body=extra)  # fmt: skip
        jsonschema.validate(json.loads(out.choices[0].message.content or ""), schema)
    choices = ["red", "green", 'blue, or "teal"']
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        out = client.completions.create(model=MODEL, prompt="My favourite colour is", max_tokens=12,
                                        temperature=0.8, seed=3, extra_body=extra)  # fmt: skip
        assert out.choices[0].text in choices, out.choices[0].text
    for extra in ({"guided_regex": r"[0-9]{2}"}, {"structured_outputs": {"regex": r"[0-9]{2}"}}):
        out = client.completions.create(model=MODEL, prompt="A number:", max_tokens=8,
                                        temperature=0, extra_body=extra)  # fmt: skip
        assert re.fullmatch(r"[0-9]{2}", out.choices[0].text), out.choices[0].text
    ebnf = 'root ::= "Answer: " [0-9] "!"'
    out = client.completions.create(model=MODEL, prompt="2 + 2 =", max_tokens=10, temperature=0,
                                    extra_body={"guided_grammar": ebnf})  # fmt: skip
    assert re.fullmatch(r"Answer: [0-9]!", out.choices[0].text), out.choices[0].text
    yes_no = [{"role": "user", "content": 'Is 2 > 1? Reply in JSON with one key, "answer", '
                                          'whose value is "yes" or "no".'}]  # fmt: skip
    out = client.chat.completions.create(
        model=MODEL, messages=yes_no, max_tokens=80, temperature=0,
        extra_body={"structured_outputs": {"json_object": True}},
    )  # fmt: skip
    assert isinstance(json.loads(out.choices[0].message.content or ""), dict)


def test_unsatisfiable_within_max_tokens_finishes_with_length(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=4, temperature=0,
        response_format=schema_format(SCHEMAS["nested"]),
    )  # fmt: skip
    assert out.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(out.choices[0].message.content or "")


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objx"}},
                }
            },
            "response_format",
            "objx",
        ),  # fmt: skip
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "schema",
        ),  # fmt: skip
        ({"regex": "[a-"}, "regex", "regex"),
        ({"regex": "(?<=a)b"}, "regex", "Lookbehind"),
        ({"ebnf": "root ::= foo"}, "ebnf", "foo"),
        ({"regex": "a+", "ebnf": 'root ::= "a"'}, "ebnf", "cannot be combined"),
        ({"json_schema": "{not json"}, "json_schema", "not a JSON schema"),
        ({"json_schema": '{"type": 3}'}, "json_schema", "invalid json_schema"),
    ],
)
def test_invalid_specs_are_400s_naming_the_problem(
    http: httpx.Client, extra: dict[str, Any], param: str, words: str
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = http.post("/v1/chat/completions", json={**body, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_grammar_metrics(client: openai.OpenAI, http: httpx.Client) -> None:
    fmt = schema_format({"type": "object", "properties": {"ok": {"type": "boolean"}},
                         "required": ["ok"]})  # fmt: skip
    before = metric(http, "eagleserve_grammar_cache_hits_total")
    compiles = metric(http, "eagleserve_grammar_compiles_total")
    for _ in range(2):
        msgs = [{"role": "user", "content": "ok?"}]
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0,
                                       response_format=fmt)  # fmt: skip
    assert metric(http, "eagleserve_grammar_compiles_total") >= compiles + 1
    assert metric(http, "eagleserve_grammar_cache_hits_total") >= before + 1
    assert metric(http, "eagleserve_grammar_compile_seconds_total") > 0


def test_min_tokens_with_a_grammar_is_a_400(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "min_tokens": 2, "regex": "a+"}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


def test_structural_tags_in_both_forms(client: openai.OpenAI, http: httpx.Client) -> None:
    """response_format structural_tag (SGLang's and vLLM's): xgrammar's own form holds the
    output to the tag; the older form (structures and triggers) compiles to the triggered tags
    xgrammar's own converter makes of it; /generate takes both as text."""
    import xgrammar as xgr

    from eagleserve.server.structured import structural_tag_spec

    number = {"type": "integer", "minimum": 0, "maximum": 99}
    schema = {"type": "object", "properties": {"n": number}, "required": ["n"]}
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<answer>", "end": "</answer>",
        "content": {"type": "json_schema", "json_schema": schema}}}  # fmt: skip
    out = client.completions.create(model=MODEL, prompt="Give a number:", max_tokens=60,
                                    temperature=0, extra_body={"response_format": tag})  # fmt: skip
    text = out.choices[0].text
    assert text.startswith("<answer>") and text.endswith("</answer>"), text
    jsonschema.validate(json.loads(text[len("<answer>") : -len("</answer>")]), schema)
    sampling = {"temperature": 0, "max_new_tokens": 60, "structural_tag": json.dumps(tag)}
    native = http.post("/generate", json={"text": "Give a number:", "sampling_params": sampling})
    assert native.json()["text"] == text
    begin = f"<f={random.randrange(100)}>"
    legacy = {"type": "structural_tag", "triggers": ["<f="],
              "structures": [{"begin": begin, "schema": schema, "end": "</f>"}]}  # fmt: skip
    ours = structural_tag_spec(legacy)
    assert not isinstance(ours, str)
    theirs = xgr.StructuralTag.from_legacy_structural_tag(
        [xgr.StructuralTagItem(begin=begin, schema=schema, end="</f>")], ["<f="]
    )
    assert xgr.StructuralTag.from_json(ours.value) == theirs
    resp = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "response_format": legacy})  # fmt: skip
    assert resp.status_code == 200, resp.text

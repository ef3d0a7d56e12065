"""OpenAI's Responses API (/v1/responses) end to end, through the `openai` client's
`responses` resource on the default model: the answer equals the chat route's for the same
conversation (greedy, token for token), a stream's events hold it and end in the response
object, `previous_response_id` continues a stored conversation (and equals sending it whole),
stored responses are read and deleted, function calls and `text.format` follow their schemas,
logprobs come when `include` asks, and what is not served is a 400 naming the field."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_fixtures import (  # noqa: F401 (fixtures)
    MODEL,
    base_url_fixture,
    http_fixture,
    server_fixture,
)

QUESTIONS = ["Count to five.", "Name three colours.", "What is the capital of France?",
             "Write a haiku about rain.", "Say hello in Spanish."]  # fmt: skip
INSTRUCTIONS = ["Answer briefly.", "You are a helpful assistant.", "Reply in one sentence."]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"],
}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": WEATHER}  # fmt: skip


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def chat_answer(client: openai.OpenAI, messages: list[dict[str, Any]], n_tokens: int) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=n_tokens,
        temperature=0,  # type: ignore[arg-type]
    )


def test_answer_equals_the_chat_route(client: openai.OpenAI) -> None:
    question, system = random.choice(QUESTIONS), random.choice(INSTRUCTIONS)
    n_tokens = random.randint(6, 20)
    resp = client.responses.create(model=MODEL, input=question, instructions=system,
                                   max_output_tokens=n_tokens, temperature=0)  # fmt: skip
    want = chat_answer(client, [{"role": "system", "content": system},
                                {"role": "user", "content": question}], n_tokens)  # fmt: skip
    assert resp.output_text == want.choices[0].message.content
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == MODEL
    message = resp.output[0]
    assert message.type == "message" and message.role == "assistant"
    assert resp.usage.input_tokens == want.usage.prompt_tokens
    assert resp.usage.output_tokens == want.usage.completion_tokens
    assert resp.usage.total_tokens == want.usage.total_tokens
    cut = want.choices[0].finish_reason == "length"
    assert resp.status == ("incomplete" if cut else "completed")
    assert (resp.incomplete_details is not None) == cut and message.status == resp.status
    if cut:
        assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.instructions == system and resp.max_output_tokens == n_tokens


def test_stream_events_build_the_answer(client: openai.OpenAI) -> None:
    body = {"model": MODEL, "input": random.choice(QUESTIONS), "max_output_tokens": 16,
            "temperature": 0.9,
            "extra_body": {"seed": random.randrange(10**6), "ignore_eos": True}}  # fmt: skip
    whole = client.responses.create(**body)
    events = list(client.responses.create(**body, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text and events[-4].text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == "incomplete"
    assert final.usage.output_tokens == whole.usage.output_tokens == 16
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first_q, second_q = random.sample(QUESTIONS, 2)
    system = random.choice(INSTRUCTIONS)
    first = client.responses.create(model=MODEL, input=first_q, instructions=system,
                                    max_output_tokens=12, temperature=0)  # fmt: skip
    second = client.responses.create(model=MODEL, input=second_q, previous_response_id=first.id,
                                     max_output_tokens=12, temperature=0)  # fmt: skip
    assert second.previous_response_id == first.id
    # OpenAI's rule: the earlier turn's instructions are not carried over.
    want = chat_answer(client, [{"role": "user", "content": first_q},
                                {"role": "assistant", "content": first.output_text},
                                {"role": "user", "content": second_q}], 12)  # fmt: skip
    assert second.output_text == want.choices[0].message.content
    assert second.usage.input_tokens == want.usage.prompt_tokens
    # The same conversation sent whole: the earlier output items replayed as input.
    parts = [{"type": "input_text", "text": second_q}]
    replayed = [{"role": "user", "content": first_q},
                *[item.model_dump() for item in first.output],
                {"role": "user", "content": parts}]  # fmt: skip
    again = client.responses.create(model=MODEL, input=replayed, max_output_tokens=12,
                                    temperature=0, store=False)  # fmt: skip
    assert again.output_text == second.output_text and again.store is False


def test_stored_responses_are_read_and_deleted(client: openai.OpenAI, http: httpx.Client) -> None:
    meta = {"k": str(random.random())}
    resp = client.responses.create(model=MODEL, input=random.choice(QUESTIONS),
                                   max_output_tokens=6, metadata=meta)  # fmt: skip
    assert resp.store is True
    got = client.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text
    assert got.metadata == resp.metadata and got.usage == resp.usage
    deleted = http.delete(f"/v1/responses/{resp.id}")
    assert deleted.status_code == 200
    assert deleted.json() == {"id": resp.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    assert http.delete(f"/v1/responses/{resp.id}").status_code == 404
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=MODEL, input="Go on.", previous_response_id=resp.id)
    assert exc.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_input_items_list_the_request_input(client: openai.OpenAI, http: httpx.Client) -> None:
    """`client.responses.input_items.list`: a stored response's input items with ids, newest
    first unless asked, paged by `after` (the client's auto-paging walks them all)."""
    texts = random.sample(QUESTIONS, 3)
    sent = [
        {"role": "user", "content": texts[0]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": texts[1]}]},
        {"role": "user", "content": [{"type": "input_text", "text": texts[2]}]},
    ]  # fmt: skip
    resp = client.responses.create(model=MODEL, input=sent, max_output_tokens=2)  # type: ignore[arg-type]
    listed = client.responses.input_items.list(resp.id, order="asc")
    assert [(i.role, i.content[0].text) for i in listed.data] == [
        ("user", texts[0]), ("assistant", texts[1]), ("user", texts[2])]  # fmt: skip
    assert listed.data[0].content[0].type == "input_text"
    ids = [i.id for i in listed.data]
    assert len(set(ids)) == 3 and all(i.startswith("msg_") for i in ids)
    newest_first = client.responses.input_items.list(resp.id)
    assert [i.id for i in newest_first.data] == ids[::-1]
    assert [i.id for i in client.responses.input_items.list(resp.id, limit=1)] == ids[::-1]
    page = http.get(f"/v1/responses/{resp.id}/input_items",
                    params={"order": "asc", "after": ids[0], "limit": 1}).json()  # fmt: skip
    assert [i["id"] for i in page["data"]] == ids[1:2] and page["has_more"] is True
    assert (page["first_id"], page["last_id"]) == (ids[1], ids[1])
    bad = http.get(f"/v1/responses/{resp.id}/input_items", params={"after": "msg_nope"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"
    single = client.responses.create(model=MODEL, input=texts[0], max_output_tokens=2)
    (item,) = client.responses.input_items.list(single.id).data
    assert (item.role, item.content[0].type, item.content[0].text) == (
        "user", "input_text", texts[0])  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")


def test_function_calls_follow_the_schema(client: openai.OpenAI) -> None:
    city = random.choice(["Paris", "Lima", "Oslo", "Cairo"])
    body: dict[str, Any] = {
        "model": MODEL, "input": f"What is the weather in {city}?", "tools": [TOOL],
        "tool_choice": random.choice(["required", {"type": "function", "name": "get_weather"}]),
        "parallel_tool_calls": False, "max_output_tokens": 40, "temperature": 0,
    }  # fmt: skip
    resp = client.responses.create(**body)
    calls = [item for item in resp.output if item.type == "function_call"]
    assert len(calls) == 1 and resp.status == "completed", resp.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    events = list(client.responses.create(**body, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == call.arguments  # greedy: the same call
    assert events[-1].type == "response.completed"
    # The call's output sent back: the conversation goes on as text.
    after = client.responses.create(
        model=MODEL, previous_response_id=resp.id, tools=[TOOL], max_output_tokens=12,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )  # fmt: skip
    assert after.output[0].type in ("message", "function_call") and after.usage.input_tokens > (
        resp.usage.input_tokens + resp.usage.output_tokens
    )


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    # Bounded so that any JSON it allows fits the token budget: the answer always completes.
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    resp = client.responses.create(
        model=MODEL, input="Describe a person as JSON.", max_output_tokens=64,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema}},
        temperature=0.7, extra_body={"seed": random.randrange(10**6)},
    )  # fmt: skip
    assert resp.status == "completed", resp.output_text
    jsonschema.validate(json.loads(resp.output_text), schema)
    assert resp.text.format.type == "json_schema"


@pytest.mark.parametrize("top", [0, 3])
def test_logprobs_when_included(client: openai.OpenAI, top: int) -> None:
    body = {"model": MODEL, "input": random.choice(QUESTIONS), "max_output_tokens": 5,
            "temperature": 0, "top_logprobs": top}  # fmt: skip
    plain = client.responses.create(**body)
    assert plain.output[0].content[0].logprobs is None
    resp = client.responses.create(**body, include=["message.output_text.logprobs"])
    lps = resp.output[0].content[0].logprobs
    assert "".join(lp.token for lp in lps) == resp.output_text == plain.output_text
    assert all(len(lp.top_logprobs) == top and lp.logprob <= 0 for lp in lps)
    if top:
        assert all(lp.top_logprobs[0].logprob >= lp.logprob for lp in lps)  # greedy: the top


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"background": True, "store": False}, "background"),
        ({"n": 2}, "n"),
        ({"reasoning": {"effort": "maximal"}}, "reasoning.effort"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input.0.content.0.type"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type"),
        ({"input": []}, "input"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)  # fmt: skip
def test_what_is_not_served_is_a_400(http: httpx.Client, extra: dict[str, Any], param: str) -> None:
    resp = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2, **extra})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param

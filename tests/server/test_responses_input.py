"""A Responses API request as the chat completion it runs as (server/responses_input.py), and
the store of answered responses (server/response_store.py): no server, random inputs."""

from __future__ import annotations

import random
import string
import uuid

from eagleserve.server.protocol import ChatMessage
from eagleserve.server.response_store import ResponseStore, StoredResponse, page_of_items
from eagleserve.server.responses_input import chat_request, input_messages
from eagleserve.server.responses_protocol import ResponsesRequest
from eagleserve.server.serving import ApiError


def words() -> str:
    return " ".join("".join(random.choices(string.ascii_lowercase, k=5)) for _ in range(3))


def test_items_become_chat_turns_with_parallel_calls_in_one() -> None:
    """A run of function_call items is one assistant turn (its calls in order), with the
    assistant's text before them where there is one, and a replayed reasoning item left out;
    each output a tool message; text parts joined; instructions the system message in front."""
    n_calls = random.randint(1, 4)
    calls = [{"type": "function_call", "call_id": f"call_{uuid.uuid4().hex[:8]}",
              "name": random.choice(["f", "g"]), "arguments": f'{{"x": {random.randrange(9)}}}'}
             for _ in range(n_calls)]  # fmt: skip
    parts = [words() for _ in range(random.randint(1, 3))]
    outputs = [{"type": "function_call_output", "call_id": c["call_id"], "output": words()}
               for c in calls]  # fmt: skip
    said = random.choice([None, words()])
    turn = [] if said is None else [{"type": "message", "role": "assistant", "content": [
        {"type": "output_text", "text": said, "annotations": []}]}]  # fmt: skip
    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": words()}]}  # fmt: skip
    items = [{"role": "user", "content": [{"type": "input_text", "text": p} for p in parts]},
             thought, *turn, *calls, *outputs]  # fmt: skip
    system = words()
    body = ResponsesRequest.model_validate({"input": items, "instructions": system})
    msgs = input_messages(body)
    assert not isinstance(msgs, ApiError)
    assert [m.role for m in msgs] == ["user", "assistant"] + ["tool"] * n_calls
    assert msgs[0].content == "".join(parts) and msgs[1].content == said
    assert [c["id"] for c in msgs[1].tool_calls or []] == [c["call_id"] for c in calls]
    assert [c["function"]["arguments"] for c in msgs[1].tool_calls or []] == [
        c["arguments"] for c in calls
    ]
    assert [m.content for m in msgs[2:]] == [o["output"] for o in outputs]
    chat = chat_request(body, msgs)
    assert not isinstance(chat, ApiError)
    assert chat.messages[0] == ChatMessage(role="system", content=system)
    assert chat.messages[1:] == msgs and chat.n == 1


def test_settings_carry_over_to_the_chat_request() -> None:
    top = random.randint(0, 20)
    n = random.randint(1, 500)
    seed = random.randrange(10**9)
    body = ResponsesRequest.model_validate({
        "input": words(), "max_output_tokens": n, "temperature": 0.5, "top_p": 0.9,
        "seed": seed, "top_logprobs": top, "include": ["message.output_text.logprobs"],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
    })  # fmt: skip
    msgs = input_messages(body)
    assert not isinstance(msgs, ApiError)
    chat = chat_request(body, msgs)
    assert not isinstance(chat, ApiError)
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.seed) == (n, 0.5, 0.9, seed)
    assert chat.logprobs and chat.top_logprobs == top
    fn = {"name": "f", "parameters": {"type": "object"}}
    assert chat.tools == [{"type": "function", "function": fn}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.parallel_tool_calls is False
    plain = chat_request(ResponsesRequest.model_validate({"input": words(), "top_logprobs": 3}),
                         msgs)  # fmt: skip
    assert not isinstance(plain, ApiError) and not plain.logprobs and plain.top_logprobs is None


def stored(key: str) -> StoredResponse:
    return StoredResponse({"id": key}, (ChatMessage(role="user", content=words()),))


def test_the_store_keeps_the_most_recently_used() -> None:
    capacity = random.randint(2, 6)
    store = ResponseStore(capacity)
    keys = [f"resp_{uuid.uuid4().hex}" for _ in range(capacity + 3)]
    for key in keys[:capacity]:
        store.put(stored(key))
    kept = random.choice(keys[:capacity])
    assert store.get(kept) is not None  # read: now the most recent
    for key in keys[capacity:]:
        store.put(stored(key))
    order = [k for k in keys[:capacity] if k != kept] + [kept] + keys[capacity:]
    alive = order[-capacity:]
    assert len(store) == capacity
    assert all(store.get(k) is not None for k in alive)
    assert all(store.get(k) is None for k in keys if k not in alive)
    assert store.delete(alive[0]) and not store.delete(alive[0]) and len(store) == capacity - 1
    off = ResponseStore(0)
    off.put(stored(keys[0]))
    assert off.get(keys[0]) is None and len(off) == 0


def test_input_item_pages_walk_every_item_once_in_order() -> None:
    """Following `after` from page to page lists every item once, in the order asked, for
    any page size; `before` stops short of its item; an unknown cursor is named."""
    rng = random.Random()
    items = tuple({"id": f"msg_{uuid.uuid4().hex}"} for _ in range(rng.randint(0, 9)))
    ids = [i["id"] for i in items]
    for order, want in (("asc", ids), ("desc", ids[::-1])):
        limit = rng.randint(1, 4)
        seen: list[str] = []
        after = None
        while True:
            page = page_of_items(items, limit, order, after, None)
            assert isinstance(page, dict) and len(page["data"]) <= limit
            seen += [i["id"] for i in page["data"]]
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert seen == want
        if want:
            cut = rng.randrange(len(want))
            page = page_of_items(items, 100, order, None, want[cut])
            assert isinstance(page, dict) and [i["id"] for i in page["data"]] == want[:cut]
    assert page_of_items(items, 5, "asc", "msg_nope", None) == "after"
    assert page_of_items(items, 5, "asc", None, "msg_nope") == "before"

"""`Engine.chat` (vLLM's `LLM.chat`): a conversation's answer is the completion of the chat
template's text with nothing added, as the server's chat route encodes it; several
conversations in one call each get their own; `continue_final_message` leaves the last message
open; a template passed in replaces the model's; a model without one is a ValueError."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from engine_fixtures import greedy, tiny_engine_fixture, tiny_fixture  # noqa: F401 (fixtures)

from eagleserve import Engine

QUESTIONS = ["Name a colour.", "Count to four.", "What is the capital of Italy?", "Say hello."]


def conversation() -> list[dict[str, str]]:
    msgs = [{"role": "user", "content": random.choice(QUESTIONS)}]
    if random.random() < 0.5:
        msgs.insert(0, {"role": "system", "content": random.choice(["Be brief.", "Be kind."])})
    return msgs


def test_chat_is_the_templates_completion(
    smollm2_dir: str, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(smollm2_dir, max_running_requests=4, max_total_tokens=2048)
    tok = engine.tokenizer
    convs = [conversation() for _ in range(3)]
    n = random.randint(4, 12)
    got = engine.chat(convs, greedy(n))
    for conv, out in zip(convs, got, strict=True):
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        want = engine.generate([tok.encode(text, add_special_tokens=False)], greedy(n))[0]
        assert out["token_ids"] == want["token_ids"] and out["text"] == want["text"]
    one = engine.chat(convs[0], greedy(n))  # one conversation: a list of messages
    assert [o["token_ids"] for o in one] == [got[0]["token_ids"]]
    # The assistant's message left open: its answer goes on from the given words.
    start = random.choice(["The answer is", "Well,", "Sure:"])
    open_conv = [*convs[1], {"role": "assistant", "content": start}]
    cont = engine.chat(open_conv, greedy(n), add_generation_prompt=False,
                       continue_final_message=True)[0]  # fmt: skip
    text = tok.apply_chat_template(open_conv, tokenize=False, continue_final_message=True)
    assert text.endswith(start)
    want = engine.generate([tok.encode(text, add_special_tokens=False)], greedy(n))[0]
    assert cont["token_ids"] == want["token_ids"]
    # A template of the caller's own.
    mark = "".join(random.choices("ABCDEFGH", k=5))
    template = "{% for m in messages %}" + mark + "{{ m.content }}\n{% endfor %}" + mark
    own = engine.chat(convs[2], greedy(n), chat_template=template)[0]
    rendered = "".join(f"{mark}{m['content']}\n" for m in convs[2]) + mark
    want = engine.generate([tok.encode(rendered, add_special_tokens=False)], greedy(n))[0]
    assert own["token_ids"] == want["token_ids"]


def test_no_template_is_a_value_error(tiny: Engine) -> None:
    assert not getattr(tiny.tokenizer, "chat_template", None)  # the tiny model ships none
    with pytest.raises(ValueError, match="chat template"):
        tiny.chat([{"role": "user", "content": "hi"}], greedy(2))

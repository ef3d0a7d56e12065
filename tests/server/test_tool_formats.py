"""The tool-call formats (server/tool_formats.py, --tool-call-parser): calls written in each
format read back as they were, around free text and next to each other; a call cut short stays
text; the grammar accepts each format's own calls and no other's; a chat template that renders
tools gets them and the earlier calls as objects."""

from __future__ import annotations

import json
import random
import string
from typing import Any

import pytest
from server_fixtures import tokenizer_fixture  # noqa: F401 (fixtures)
from test_tool_calls import TOOLS, accepts

from eagleserve.server.chat import chat_text
from eagleserve.server.protocol import ChatCompletionRequest
from eagleserve.server.tool_calls import ToolSetup, tool_setup
from eagleserve.server.tool_formats import HERMES, LLAMA3, MISTRAL, PYTHON_TAG, ToolFormat

FORMATS = [HERMES, LLAMA3, MISTRAL]


def random_args(rng: random.Random) -> dict[str, Any]:
    def word() -> str:
        return "".join(rng.choices(string.ascii_letters + ' {}[]",:;', k=rng.randint(0, 8)))

    values: list[Any] = [rng.randint(-99, 99), word(), [word(), 1.5], {"k": word()}, None, True]
    return {word() or "x": rng.choice(values) for _ in range(rng.randint(0, 3))}


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_calls_read_back_as_written(fmt: ToolFormat) -> None:
    rng = random.Random()
    for _ in range(200):
        calls = [(rng.choice(["f", "get_time", "a-b_1"]), random_args(rng))
                 for _ in range(rng.randint(1, 3))]  # fmt: skip
        text = fmt.separator.join(fmt.call_text(n, json.dumps(a)) for n, a in calls)
        lead = rng.choice(["", "Let me check. ", "ok\n"])
        assert fmt.parse(lead + text) == (lead.strip() or None, calls), lead + text
        cut = text[: rng.randrange(len(text) - 1)]  # a call that max_tokens cut short
        content, got = fmt.parse(cut)
        assert got == calls[: len(got)] and len(got) < len(calls)


def test_each_format_reads_its_other_forms() -> None:
    """Llama 3's python tag and `arguments` key; Mistral's array of several calls."""
    one = '{"name": "f", "arguments": {"n": 1}}'
    assert LLAMA3.parse(PYTHON_TAG + one) == (None, [("f", {"n": 1})])
    assert LLAMA3.parse('{"no": "call"} and text') == ('{"no": "call"} and text', [])
    two = '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"a": 2}}]'
    assert MISTRAL.parse(two) == (None, [("f", {}), ("g", {"a": 2})])
    bad = "<tool_call>\n[1, 2]\n</tool_call>"
    assert HERMES.parse(bad) == (bad, [])


def setup_in(fmt: ToolFormat, **fields: Any) -> ToolSetup:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)
    got = tool_setup(body, fmt)
    assert isinstance(got, ToolSetup)
    return got


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_the_grammar_takes_the_formats_calls_and_no_others(fmt: ToolFormat) -> None:
    required = setup_in(fmt, tools=TOOLS, tool_choice="required")
    mine = fmt.call_text("f", '{"n": 3}')
    assert accepts(required, mine)
    assert accepts(required, mine + fmt.separator + fmt.call_text("g", "{}"))
    assert not accepts(required, fmt.call_text("f", '{"n": "3"}'))
    for other in FORMATS:
        if other is not fmt:
            assert not accepts(required, other.call_text("f", '{"n": 3}')), other.name
    auto = setup_in(fmt, tools=TOOLS)
    assert accepts(auto, "hello") and accepts(auto, "let me see " + mine)


TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}CALL:{{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}{% endfor %}"
    "{% if m.get('tool_call_id') %}(for {{ m['tool_call_id'] }}){% endif %}\n{% endfor %}"
)


def test_a_template_that_renders_tools_gets_them(tokenizer: Any) -> None:
    """As vLLM passes them: the tools, and the earlier call's arguments as an object; the
    system message is the conversation's own. A template without tools gets them described in
    the format instead."""
    rng = random.Random()
    args = {"n": rng.randint(0, 999)}
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "f", "arguments": json.dumps(args)}}]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]  # fmt: skip
    body = ChatCompletionRequest(messages=messages, tools=TOOLS)
    for fmt in FORMATS:
        setup = tool_setup(body, fmt)
        assert isinstance(setup, ToolSetup)
        plain = chat_text(tokenizer, body, setup, fmt)
        assert isinstance(plain, str) and "You can call these functions" in plain
        assert fmt.call_text("f", json.dumps(args)) in plain
        original = tokenizer.chat_template
        tokenizer.chat_template = TOOL_TEMPLATE
        try:
            text = chat_text(tokenizer, body, setup, fmt)
        finally:
            tokenizer.chat_template = original
        assert isinstance(text, str)
        assert text.startswith("TOOLS:") and '"name": "f"' in text.splitlines()[0]
        assert f"CALL:f{json.dumps(args)}" in text and "(for call_1)" in text
        assert "You can call these functions" not in text

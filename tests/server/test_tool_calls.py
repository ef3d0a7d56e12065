"""Tool-call plumbing without a server (server/tool_calls.py): tool_choice and tools checks,
the grammar accepts exactly the calls each choice allows, and outputs parse into OpenAI
tool_calls (a call cut short stays text)."""

from __future__ import annotations

import json

from eagleserve.constrained.grammar import build_grammar
from eagleserve.server.protocol import ChatCompletionRequest
from eagleserve.server.serving import ApiError
from eagleserve.server.tool_calls import ToolSetup, parse_tool_calls, tool_grammar, tool_setup

PARAMS = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "g"}}]  # fmt: skip


def setup(**fields: object) -> ToolSetup | ApiError | None:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)
    return tool_setup(body)


def call(name: str, args: object) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def accepts(s: ToolSetup, text: str) -> bool:
    import xgrammar as xgr

    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["\n"])
    m = xgr.GrammarMatcher(
        xgr.GrammarCompiler(info).compile_grammar(build_grammar(tool_grammar(s)))
    )
    return m.accept_string(text) and m.is_completed()


def test_tool_choice_forms() -> None:
    assert setup() is None and setup(tools=TOOLS, tool_choice="none") is None
    auto = setup(tools=TOOLS)
    assert isinstance(auto, ToolSetup) and auto.choice == "auto" and auto.parallel
    named = setup(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}},
                  parallel_tool_calls=False)  # fmt: skip
    assert isinstance(named, ToolSetup) and [t[0] for t in named.offered()] == ["g"]
    for bad in ({"tool_choice": "required"}, {"tools": TOOLS, "tool_choice": "x"},
                {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "h"}}},
                {"tools": [{"type": "function", "function": {"name": "a b"}}]}):  # fmt: skip
        assert isinstance(setup(**bad), ApiError), bad


def test_grammar_accepts_the_allowed_calls() -> None:
    required = setup(tools=TOOLS, tool_choice="required")
    assert isinstance(required, ToolSetup)
    assert accepts(required, call("f", {"n": 3}))
    assert accepts(required, call("f", {"n": 3}) + "\n" + call("g", {}))
    assert not accepts(required, call("f", {"n": "3"}))  # arguments follow the schema
    assert not accepts(required, "hello")
    single = setup(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert isinstance(single, ToolSetup)
    assert not accepts(single, call("f", {"n": 3}) + "\n" + call("g", {}))
    auto = setup(tools=TOOLS)
    assert isinstance(auto, ToolSetup)
    assert accepts(auto, "hello") and accepts(auto, "let me see " + call("f", {"n": 1}))


def test_parse_tool_calls() -> None:
    content, calls = parse_tool_calls("ok " + call("f", {"n": 2}) + "\n" + call("g", {}))
    assert content == "ok"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"n": 2}), ("g", {})]  # fmt: skip
    assert len({c["id"] for c in calls}) == 2
    cut = call("f", {"n": 2})[:-5]
    assert parse_tool_calls(cut) == (cut, [])

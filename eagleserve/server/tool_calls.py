"""Chat tool calls: `tools`, `tool_choice` and `parallel_tool_calls` -> the tools' description
for the prompt, a grammar over the tool-call format, and the output parsed into OpenAI
`tool_calls`.

The format is the Hermes / Qwen one many chat templates use, one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`required` and a named function constrain the whole output to such blocks (one, or several
separated by newlines when parallel calls are allowed), each block's arguments to its tool's
`parameters` schema (an xgrammar structural tag). `auto` lets the model write text and
constrains every block it opens. `none` (or no tools) leaves the output free and the tools out of
the prompt. The default model is small: the point is well-formed calls, not good ones.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from eagleserve.sampling_params import GrammarSpec
from eagleserve.server.protocol import ChatCompletionRequest
from eagleserve.server.serving import ApiError

BEGIN = "<tool_call>\n"
END = "\n</tool_call>"
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
BLOCK = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSetup:
    tools: tuple[tuple[str, str, str], ...]  # (name, description, parameters as JSON text)
    choice: str  # "auto", "required", or the one function's name
    parallel: bool

    def offered(self) -> list[tuple[str, str, str]]:
        """The tools the output may call."""
        if self.choice in ("auto", "required"):
            return list(self.tools)
        return [t for t in self.tools if t[0] == self.choice]


def tool_setup(body: ChatCompletionRequest) -> ToolSetup | ApiError | None:
    """The request's tool calling, None when it has none (no tools, or tool_choice none)."""
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    named = None
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        named = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(named, str):
            msg = 'tool_choice must be "none", "auto", "required" or {"type": "function", '
            return ApiError(400, msg + '"function": {"name": ...}}', "tool_choice")
    elif choice not in ("none", "auto", "required"):
        return ApiError(
            400, f"tool_choice {choice!r} is not one of none, auto, required", "tool_choice"
        )
    if choice == "none" or (not tools and choice == "auto"):
        return None
    if not tools:
        return ApiError(400, "tool_choice needs tools", "tool_choice")
    parsed = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            return ApiError(400, f"tools.{i} must be a function with a name", f"tools.{i}")
        if not NAME.match(fn["name"]):
            msg = f"tools.{i}.function.name must be 1-64 letters, digits, _ or -"
            return ApiError(400, msg, f"tools.{i}.function.name")
        params = fn.get("parameters") or EMPTY_PARAMETERS
        if not isinstance(params, dict):
            msg = f"tools.{i}.function.parameters must be a JSON schema (an object)"
            return ApiError(400, msg, f"tools.{i}.function.parameters")
        parsed.append((fn["name"], str(fn.get("description") or ""), json.dumps(params)))
    if named is not None and named not in [t[0] for t in parsed]:
        return ApiError(400, f"tool_choice names {named!r}, which is not in tools", "tool_choice")
    parallel = body.parallel_tool_calls is not False
    return ToolSetup(tuple(parsed), named or str(choice), parallel)


def tool_grammar(setup: ToolSetup) -> GrammarSpec:
    """The structural tag the output follows (see the module docstring)."""
    tags = [
        {"type": "tag", "begin": f'{BEGIN}{{"name": {json.dumps(name)}, "arguments": ',
         "content": {"type": "json_schema", "json_schema": json.loads(params)}, "end": "}" + END}
        for name, _, params in setup.offered()
    ]  # fmt: skip
    once = not setup.parallel
    if setup.choice == "auto":
        fmt: dict[str, Any] = {
            "type": "triggered_tags",
            "triggers": ["<tool_call>"],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": once,
        }
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n",
               "at_least_one": True, "stop_after_first": once}  # fmt: skip
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))


def tool_prompt(setup: ToolSetup) -> str:
    """What the system message says about the tools (the template may know no tools)."""
    listed = [{"name": n, "description": d, "parameters": json.loads(p)}
              for n, d, p in setup.offered()]  # fmt: skip
    return (
        "You can call these functions:\n" + json.dumps(listed) + "\nTo call a function, reply "
        f'with\n{BEGIN}{{"name": <function name>, "arguments": <arguments object>}}{END}'
    )


def render_calls(calls: list[dict[str, Any]]) -> str:
    """An assistant message's earlier tool_calls, in the format, for the prompt."""
    out = []
    for call in calls:
        fn = call.get("function")
        fn = fn if isinstance(fn, dict) else {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError):
            args = fn.get("arguments")
        out.append(BEGIN + json.dumps({"name": fn.get("name"), "arguments": args}) + END)
    return "\n".join(out)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(the text outside the calls or None, the OpenAI tool_calls) of an output. A block that
    is not a whole call (cut by max_tokens) stays text."""
    calls = []
    kept = []
    at = 0
    for m in BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        kept.append(text[at : m.start()])
        at = m.end()
        calls.append({
            "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(obj.get("arguments", {}))},
        })  # fmt: skip
    content = ("".join(kept) + text[at:]).strip()
    return (content or None), calls


def tool_answer(
    text: str, finish_reason: str | None
) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """(content, tool_calls, finish_reason) of an output with tools: as OpenAI's, finish
    `tool_calls` when it made calls, unless max_tokens cut it (it says so, with the calls it
    completed)."""
    content, calls = parse_tool_calls(text)
    cut = finish_reason == "length"
    return content, calls, "tool_calls" if calls and not cut else finish_reason

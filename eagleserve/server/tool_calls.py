"""Chat tool calls: `tools`, `tool_choice` and `parallel_tool_calls` -> the tools' description
for the prompt, a grammar over the tool-call format, and the output parsed into OpenAI
`tool_calls`.

The format is `--tool-call-parser`'s (server/tool_formats.py; Hermes / Qwen blocks by default):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`required` and a named function constrain the whole output to calls (one, or several separated
as the format separates them when parallel calls are allowed), each call's arguments to its
tool's `parameters` schema (an xgrammar structural tag). `auto` lets the model write text and
constrains every call it opens. `none` (or no tools) leaves the output free and the tools out of
the prompt. Where the chat template renders tools itself (it uses `tools`), the tools and the
earlier calls go to it as vLLM passes them; else the system message describes the tools in the
format, and earlier calls are written out in it. The default model is small: the point is
well-formed calls, not good ones.
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
from eagleserve.server.tool_formats import HERMES, ToolFormat

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSetup:
    tools: tuple[tuple[str, str, str], ...]  # (name, description, parameters as JSON text)
    choice: str  # "auto", "required", or the one function's name
    parallel: bool
    fmt: ToolFormat = HERMES

    def offered(self) -> list[tuple[str, str, str]]:
        """The tools the output may call."""
        if self.choice in ("auto", "required"):
            return list(self.tools)
        return [t for t in self.tools if t[0] == self.choice]


def tool_setup(
    body: ChatCompletionRequest, fmt: ToolFormat = HERMES
) -> ToolSetup | ApiError | None:
    """The request's tool calling in `fmt`, None when it has none (no tools, or tool_choice
    none)."""
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
    return ToolSetup(tuple(parsed), named or str(choice), parallel, fmt)


def tool_grammar(setup: ToolSetup) -> GrammarSpec:
    """The structural tag the output follows (see the module docstring)."""
    tags = [setup.fmt.tag(name, json.loads(params)) for name, _, params in setup.offered()]
    once = not setup.parallel
    if setup.choice == "auto":
        fmt: dict[str, Any] = {
            "type": "triggered_tags",
            "triggers": [setup.fmt.trigger],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": once,
        }
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": setup.fmt.separator,
               "at_least_one": True, "stop_after_first": once}  # fmt: skip
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))


def opener_is_special(tok: Any, fmt: ToolFormat) -> bool:
    """Whether a call's opener is a special token of the tokenizer (Mistral's [TOOL_CALLS]),
    which skip_special_tokens would drop from the text the calls are read from."""
    if tok is None or not fmt.opener:
        return False
    added = getattr(tok, "added_tokens_decoder", None) or {}
    return fmt.opener in getattr(tok, "all_special_tokens", ()) or any(
        t.content == fmt.opener and t.special for t in added.values()
    )


def template_takes_tools(tok: Any) -> bool:
    """Whether the chat template renders `tools` itself (Qwen2.5's, Llama 3.1's, ...)."""
    template = getattr(tok, "chat_template", None) or ""
    return any("tools" in t for t in (template.values() if isinstance(template, dict)
                                      else [template]))  # fmt: skip


def template_tools(setup: ToolSetup) -> list[dict[str, Any]]:
    """The offered tools as a template takes them (OpenAI's form)."""
    return [{"type": "function", "function": {"name": n, "description": d,
                                              "parameters": json.loads(p)}}
            for n, d, p in setup.offered()]  # fmt: skip


def template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An earlier call as templates read it: its arguments an object (vLLM's conversion;
    templates write them with `tojson`), where they are JSON."""
    fn = call.get("function")
    fn = dict(fn) if isinstance(fn, dict) else {}
    try:
        fn["arguments"] = json.loads(fn.get("arguments") or "{}")
    except (TypeError, ValueError):
        pass
    return {**call, "type": "function", "function": fn}


def template_messages(
    body: ChatCompletionRequest, tools: ToolSetup | None, fmt: ToolFormat, templated: bool
) -> list[dict[str, Any]]:
    """The conversation as the template takes it. A template that renders tools gets the
    earlier calls and the tool messages' call ids as they are; else the calls are written out in
    `fmt`, and the system message describes the tools."""
    msgs: list[dict[str, Any]] = []
    for m in body.messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls and templated:
            msg["tool_calls"] = [template_call(c) for c in m.tool_calls]
        elif m.tool_calls:
            msg["content"] = (msg["content"] + "\n" if msg["content"] else "") + render_calls(
                m.tool_calls, fmt
            )
        if templated:
            msg.update({k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", m.name))
                        if v is not None})  # fmt: skip
        msgs.append(msg)
    if tools is not None and not templated:
        if msgs[0]["role"] in ("system", "developer"):
            msgs[0]["content"] += "\n\n" + tool_prompt(tools)
        else:
            msgs.insert(0, {"role": "system", "content": tool_prompt(tools)})
    return msgs


def tool_prompt(setup: ToolSetup) -> str:
    """What the system message says about the tools (the template may know no tools)."""
    listed = [{"name": n, "description": d, "parameters": json.loads(p)}
              for n, d, p in setup.offered()]  # fmt: skip
    f = setup.fmt
    form = f'{f.begin}{{"name": <function name>, "{f.args_key}": <arguments object>}}{f.end}'
    return (
        "You can call these functions:\n" + json.dumps(listed) + "\nTo call a function, reply "
        f"with\n{form}"
    )


def render_calls(calls: list[dict[str, Any]], fmt: ToolFormat = HERMES) -> str:
    """An assistant message's earlier tool_calls, in the format, for the prompt."""
    out = []
    for call in calls:
        fn = call.get("function")
        fn = fn if isinstance(fn, dict) else {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError):
            args = fn.get("arguments")
        out.append(fmt.call_text(str(fn.get("name")), json.dumps(args)))
    return fmt.separator.join(out)


def parse_tool_calls(
    text: str, fmt: ToolFormat = HERMES
) -> tuple[str | None, list[dict[str, Any]]]:
    """(the text outside the calls or None, the OpenAI tool_calls) of an output. A block that
    is not a whole call (cut by max_tokens) stays text."""
    content, calls = fmt.parse(text)
    return content, [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": name, "arguments": json.dumps(args)}}
        for name, args in calls
    ]  # fmt: skip


def tool_answer(
    text: str, finish_reason: str | None, fmt: ToolFormat = HERMES
) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """(content, tool_calls, finish_reason) of an output with tools: as OpenAI's, finish
    `tool_calls` when it made calls, unless max_tokens cut it (it says so, with the calls it
    completed)."""
    content, calls = parse_tool_calls(text, fmt)
    cut = finish_reason == "length"
    return content, calls, "tool_calls" if calls and not cut else finish_reason

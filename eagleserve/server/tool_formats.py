"""The tool-call formats models are trained to write (vLLM's and SGLang's `--tool-call-parser`):
how one call is written, the structural tag that makes the output follow it, and how calls are
read back out of an output.

- hermes (SGLang's qwen25; the default): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>` blocks, one per call, a newline apart (Hermes, Qwen2.5, many ChatML templates).
- llama3 (vLLM's llama3_json): `{"name": ..., "parameters": {...}}` objects, `; ` apart
  (Llama 3.1-3.3's JSON tool calling; a leading `<|python_tag|>` is read too).
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` (one call a block when constrained;
  an array of several read too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolFormat:
    name: str
    opener: str  # text that opens a call block ("": the call's JSON object itself does)
    closer: str  # text that closes it after the JSON ("": the JSON value ends it)
    begin: str  # written before one call's object (the grammar's)
    end: str  # written after it
    separator: str  # between two calls
    args_key: str  # the call object's key of the arguments

    @property
    def trigger(self) -> str:
        """What opens a call where the model may also write text (tool_choice auto)."""
        return self.opener or '{"name":'

    def head(self, name: str) -> str:
        return f'{self.begin}{{"name": {json.dumps(name)}, "{self.args_key}": '

    def call_text(self, name: str, arguments: str) -> str:
        """One call as the model writes it (`arguments`: JSON text)."""
        return self.head(name) + arguments + "}" + self.end

    def tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        """xgrammar's structural tag of one call of `name` whose arguments follow `schema`."""
        return {"type": "tag", "begin": self.head(name),
                "content": {"type": "json_schema", "json_schema": schema},
                "end": "}" + self.end}  # fmt: skip

    def parse(self, text: str) -> tuple[str | None, list[tuple[str, Any]]]:
        """(the text outside the calls or None, each call's (name, arguments)). A block that is
        not a whole call (cut by max_tokens, say) stays text."""
        calls: list[tuple[str, Any]] = []
        kept: list[str] = []
        at = pos = 0
        while (start := text.find(self.opener or "{", pos)) >= 0:
            pos = start + 1
            found = self._block(text, start)
            if found is None:
                continue
            block_calls, stop = found
            if self.opener == "" and text[:start].endswith(PYTHON_TAG):
                start -= len(PYTHON_TAG)
            kept.append(text[at:start])
            calls += block_calls
            at = pos = stop
        kept.append(text[at:])
        sep = self.separator.strip()  # what is left between two calls is no content
        content = "".join(k for k in kept if not (sep and k.strip() == sep)).strip()
        return (content or None), calls

    def _block(self, text: str, start: int) -> tuple[list[tuple[str, Any]], int] | None:
        """The calls of the block at `start` and where it ends, if it is one."""
        i = start + len(self.opener)
        while i < len(text) and text[i].isspace():
            i += 1
        try:
            value, stop = _DECODER.raw_decode(text, i)
        except ValueError:
            return None
        items = value if isinstance(value, list) and self.opener else [value]
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            keys = [k for k in (self.args_key, "arguments", "parameters") if k in item]
            if not keys and not self.opener:  # a bare JSON object is a call only with arguments
                return None
            calls.append((item["name"], item[keys[0]] if keys else {}))
        if self.closer:
            while stop < len(text) and text[stop].isspace():
                stop += 1
            if not text.startswith(self.closer, stop):
                return None
            stop += len(self.closer)
        return calls, stop


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "<tool_call>\n", "\n</tool_call>",
                    "\n", "arguments")  # fmt: skip
LLAMA3 = ToolFormat("llama3", "", "", "", "", "; ", "parameters")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", "[TOOL_CALLS][", "]", "", "arguments")
# --tool-call-parser's names: SGLang's and vLLM's for each format.
TOOL_FORMATS = {"hermes": HERMES, "qwen25": HERMES, "llama3": LLAMA3, "llama3_json": LLAMA3,
                "mistral": MISTRAL}  # fmt: skip

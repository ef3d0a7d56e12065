"""A request's output constraint -> the engine's `GrammarSpec`, or a 400 naming the field.

Fields: OpenAI's `response_format` (`json_object`, `json_schema` with `json_schema.schema`;
SGLang's and vLLM's `structural_tag`),
SGLang's `regex`, `ebnf` and `json_schema` (extra_body) and vLLM's `guided_*` / `structured_outputs`
(server/vllm_fields.py), at most one of them; chat `tools` go through
server/tool_calls.py. Each spec is parsed here with xgrammar (no tokenizer needed), so an invalid
schema or an unsupported feature is a 400 before the request reaches the engine.
"""

from __future__ import annotations

import json
from typing import Any

from eagleserve.constrained.grammar import check_grammar
from eagleserve.sampling_params import GrammarSpec
from eagleserve.server.protocol import _SamplingFields
from eagleserve.server.serving import ApiError
from eagleserve.server.vllm_fields import GUIDED, STRUCTURED_KEYS, guided_spec, structured_fields


def structural_tag_spec(value: Any) -> GrammarSpec | str:
    """SGLang's and vLLM's structural tag (an object, or its JSON text) as xgrammar takes it:
    its own form (`format`) as is, the older one (`structures` of begin, schema and end, with
    `triggers`) as the triggered tags it stands for; or what is wrong with it."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            return f"not JSON: {exc}"
    if not isinstance(value, dict):
        return "must be a JSON object"
    if "format" not in value and "structures" in value:
        structures, triggers = value["structures"], value.get("triggers")
        if not (isinstance(structures, list) and all(isinstance(s, dict) for s in structures)
                and isinstance(triggers, list)):  # fmt: skip
            return "structures must be a list of objects and triggers a list of strings"
        tags = [{"type": "tag", "begin": s.get("begin"), "end": s.get("end"),
                 "content": {"type": "json_schema", "json_schema": s.get("schema")}}
                for s in structures]  # fmt: skip
        value = {"format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}
    return GrammarSpec("structural_tag", json.dumps({**value, "type": "structural_tag"}))


def _response_format_spec(body: _SamplingFields) -> GrammarSpec | ApiError | None:
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return GrammarSpec("json_object")
    if rf.type == "structural_tag":
        spec = structural_tag_spec(rf.model_extra or {})
        if isinstance(spec, str):
            return ApiError(400, f"response_format: {spec}", "response_format")
        return spec
    payload = (rf.model_extra or {}).get("json_schema")
    schema = payload.get("schema") if isinstance(payload, dict) else None
    if not isinstance(schema, dict | bool):
        msg = "response_format.json_schema.schema must be a JSON schema (an object)"
        return ApiError(400, msg, "response_format.json_schema.schema")
    return GrammarSpec("json_schema", json.dumps(schema))


def constraint_fields(body: _SamplingFields) -> list[str]:
    """The output-constraint fields `body` sets (a text response_format is none)."""
    names = ("response_format", "regex", "ebnf", "json_schema", *GUIDED)
    return [name for name in names if _is_set(body, name)]


def output_constraint(body: _SamplingFields) -> GrammarSpec | ApiError | None:
    """The constraint `body` asks for (None: free text). Runs xgrammar's parser: call it off the
    event loop."""
    given = constraint_fields(body)
    pairs: list[tuple[str, Any]] = [(name, getattr(body, name)) for name in given]
    if "structured_outputs" in given:
        fields = structured_fields(body.structured_outputs or {})
        if isinstance(fields, str):
            return ApiError(400, f"structured_outputs: {fields}", "structured_outputs")
        pairs.remove(("structured_outputs", body.structured_outputs))
        pairs += [(f"structured_outputs.{k}", v) for k, v in fields]
    if len(pairs) > 1:
        msg = f"{pairs[0][0]} and {pairs[1][0]} cannot be combined: give one output constraint"
        return ApiError(400, msg, pairs[1][0])
    if not pairs:
        return None
    name, value = pairs[0]
    if name == "response_format":
        spec = _response_format_spec(body)
        if spec is None or isinstance(spec, ApiError):
            return spec
    elif name in ("regex", "ebnf"):
        spec = GrammarSpec(name, value)
    else:  # vLLM's guided_* and structured_outputs, SGLang's json_schema (guided_json's text)
        guided_name = "guided_json" if name == "json_schema" else name.rpartition(".")[2]
        guided = guided_spec(STRUCTURED_KEYS.get(guided_name, guided_name), value)
        if isinstance(guided, str):
            return ApiError(400, f"{name}: {guided}", name)
        spec = guided
    return checked(spec, name)


def checked(spec: GrammarSpec, param: str) -> GrammarSpec | ApiError:
    err = check_grammar(spec)
    return spec if err is None else ApiError(400, err, param, "invalid_grammar")


def _is_set(body: _SamplingFields, name: str) -> bool:
    value = getattr(body, name)
    if name == "response_format":
        return value is not None and value.type != "text"
    return value is not None

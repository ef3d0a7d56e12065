"""vLLM's request extensions, so that a client written for vLLM gets what it asks for or a 400
naming the field, never a silently different answer (issue #20's rule, for fields outside
OpenAI's API too).

Honoured: `include_stop_str_in_output` (the stop string, or the text of the stop token, EOS
included, that ended a request stays in its text), `skip_special_tokens` (false: the text shows
them, and stop strings are found in that text), `truncate_prompt_tokens` (a prompt's last k
tokens, its special tokens included), and the output constraints, in vLLM's older form
(`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`) and its newer one
(`structured_outputs` with `json`, `regex`, `choice`, `grammar`, `json_object`), mapped onto the
same grammars as `response_format` and SGLang's `regex` / `ebnf` (server/structured.py), and
`allowed_token_ids` and `bad_words` (masks next to a grammar's: constrained/
output_constraint.py), `prompt_logprobs` (not streamed, as in vLLM),
`return_tokens_as_token_ids` and `cache_salt` (prefix-cache KV shared within a salt only).
Refused
unless neutral: the fields vLLM honours that change the output and eagleserve does not implement
(`REFUSED`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

from eagleserve.sampling_params import GrammarSpec

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
# structured_outputs' keys, each onto a guided_* field's meaning.
STRUCTURED_KEYS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                   "grammar": "guided_grammar", "json_object": "json_object"}  # fmt: skip


class VllmFields(BaseModel):
    """Declared (with vLLM's defaults) so that they are read, not dropped with unknown fields."""

    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict[str, Any] | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # the prompt's last k tokens only
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None  # -1 (the whole vocabulary) is refused, as vLLM's default
    return_tokens_as_token_ids: bool | None = None
    # The prompt's and the answer's token ids beside the text (a stream: the prompt's with a
    # choice's first chunk, each chunk's new ids with it), as vLLM returns them.
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    priority: int = 0
    logits_processors: list[Any] | None = None


# (field, is-neutral test, what is accepted) for the vLLM fields eagleserve does not implement.
REFUSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("spaces_between_special_tokens", bool, "true"),
    ("guided_whitespace_pattern", lambda v: v is None, "null"),
    ("logits_processors", lambda v: not v, "null"),
)  # fmt: skip


def choice_grammar(choices: list[str]) -> str:
    """xgrammar EBNF matching exactly one of `choices` (as vLLM's guided_choice)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def guided_spec(name: str, value: Any) -> GrammarSpec | str:
    """The grammar of one guided field's value, or what is wrong with it."""
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                return f"not a JSON schema: {exc}"
        if not isinstance(value, dict | bool):
            return "must be a JSON schema (an object)"
        return GrammarSpec("json_schema", json.dumps(value))
    if name == "json_object":
        return GrammarSpec("json_object") if value else "must be true"
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            return "must be a non-empty list of strings"
        return GrammarSpec("ebnf", choice_grammar(value))
    if not isinstance(value, str):
        return "must be a string"
    return GrammarSpec("regex" if name == "guided_regex" else "ebnf", value)


def structured_fields(outputs: dict[str, Any]) -> list[tuple[str, Any]] | str:
    """`structured_outputs`' set keys with their values (unset and false ones are vLLM's
    defaults), or what is wrong: a key outside STRUCTURED_KEYS changes the output otherwise."""
    given = [(k, v) for k, v in outputs.items() if v is not None and v is not False]
    unknown = sorted(k for k, _ in given if k not in STRUCTURED_KEYS)
    if unknown:
        return f"keys {unknown} are not supported; only {sorted(STRUCTURED_KEYS)}"
    return given

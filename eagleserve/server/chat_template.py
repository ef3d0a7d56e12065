"""`--chat-template`: the Jinja template the chat routes (and /tokenize's `messages`) render a
conversation with, in place of the tokenizer's own: for a model whose tokenizer ships none, or
to serve another format. As vLLM's and SGLang's flag of that name, the value is a file's path
or the template itself on one line (its `\\n` escapes read as newlines, as vLLM reads them).
"""

from __future__ import annotations

import codecs
import os
from typing import Any

# A conversation every chat template must render: a template that fails on it would fail on
# every request, so the server refuses to start with it.
TRIAL_CHAT = [{"role": "user", "content": "Hello"}]


def read_chat_template(value: str) -> str:
    """The template's text; ValueError saying why `value` is none (no such file, and no Jinja
    markup in it)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return codecs.decode(value, "unicode_escape")
    raise ValueError(
        f"--chat-template {value!r}: no such file, and not a Jinja template ({{{{ or {{% in it)"
    )


def with_chat_template(tokenizer: Any, template: str) -> Any:
    """`tokenizer` rendering chats with `template`; ValueError if it has no tokenizer or the
    template fails on a one-message chat (a syntax error, an undefined filter)."""
    if tokenizer is None:
        raise ValueError("--chat-template needs a tokenizer: this model ships none")
    tokenizer.chat_template = template
    try:
        tokenizer.apply_chat_template(TRIAL_CHAT, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja2's syntax and runtime errors, whatever the template raises
        raise ValueError(f"--chat-template fails on a one-message chat: {exc}") from None
    return tokenizer

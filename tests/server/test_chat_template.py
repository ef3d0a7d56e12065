"""`--chat-template` (server/chat_template.py): a server started with a template of its own
renders chats with it (what /tokenize says the model reads is the template's text, and the
chat answer is the completion of that text, token for token); a template that is no file and
no Jinja, or one that fails on a chat, stops the start with one line and exit code 2."""

from __future__ import annotations

import random
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixtures import ServerProcess, server_fixture, tokenizer_fixture  # noqa: F401
from test_startup import assert_one_line_exit_2, run_serve

from eagleserve.server.chat_template import read_chat_template


def marker() -> str:
    return "".join(random.choices(string.ascii_uppercase, k=4))


# Each role's header a random marker: no other template renders this text.
USER, BOT = marker(), marker()
TEMPLATE = (
    "{% for m in messages %}[" + USER + "|{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if reasoning_effort %}(effort {{ reasoning_effort }}){% endif %}"
    "{% if add_generation_prompt %}[" + BOT + "]{% endif %}"
)


def rendered(messages: list[dict[str, str]], effort: str | None = None) -> str:
    turns = "".join(f"[{USER}|{m['role']}] {m['content']}\n" for m in messages)
    return turns + (f"(effort {effort})" if effort else "") + f"[{BOT}]"


@pytest.fixture(scope="module", name="templated")
def templated_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    srv = ServerProcess(["--chat-template", str(path)])
    yield srv
    srv.stop()


def test_chats_are_rendered_with_the_template(templated: ServerProcess, tokenizer: Any) -> None:
    system = random.choice(["Be brief.", "Answer in French."])
    question = random.choice(["Name a fruit.", "Count to 3."])
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    text = rendered(messages)
    n_tokens = random.randint(4, 12)
    with httpx.Client(base_url=templated.url, timeout=120) as http:
        ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        assert ids == tokenizer.encode(text, add_special_tokens=False)
        chat = http.post("/v1/chat/completions", json={
            "messages": messages, "max_tokens": n_tokens, "temperature": 0}).json()  # fmt: skip
        plain = http.post("/v1/completions", json={
            "prompt": ids, "max_tokens": n_tokens, "temperature": 0}).json()  # fmt: skip
    assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
    assert chat["usage"]["prompt_tokens"] == len(ids)


def test_reasoning_effort_reaches_the_template(
    templated: ServerProcess, server: ServerProcess, tokenizer: Any
) -> None:
    """OpenAI's reasoning_effort (chat) and reasoning.effort (responses) are the template's
    `reasoning_effort`, as vLLM passes them; a template without it renders as before."""
    messages = [{"role": "user", "content": random.choice(["Name a fruit.", "Count to 3."])}]
    effort = random.choice(["low", "medium", "high"])
    want = tokenizer.encode(rendered(messages, effort), add_special_tokens=False)
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    with httpx.Client(base_url=templated.url, timeout=120) as http:
        chat = http.post("/v1/chat/completions", json={**body, "reasoning_effort": effort})
        assert chat.json()["prompt_token_ids"] == want
        resp = http.post("/v1/responses", json={
            "input": messages, "max_output_tokens": 4, "temperature": 0,
            "reasoning": {"effort": effort, "summary": "auto"}}).json()  # fmt: skip
        assert resp["usage"]["input_tokens"] == len(want)
        assert resp["reasoning"]["effort"] == effort
    # The default model's template reads no reasoning_effort: the same prompt with or without.
    with httpx.Client(base_url=server.url, timeout=120) as http:
        plain = http.post("/v1/chat/completions", json=body).json()
        chat = http.post("/v1/chat/completions", json={**body, "reasoning_effort": effort})
        assert chat.json()["prompt_token_ids"] == plain["prompt_token_ids"]


def test_inline_template_reads_escapes(tmp_path: Path) -> None:
    word = marker()
    inline = "{% for m in messages %}" + word + "{{ m.content }}\\n{% endfor %}"
    assert read_chat_template(inline) == inline.replace("\\n", "\n")
    path = tmp_path / "t.jinja"
    path.write_text(inline)
    assert read_chat_template(str(path)) == inline  # a file's text as it is
    with pytest.raises(ValueError, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))


@pytest.mark.parametrize(
    ("template", "words"),
    [
        ("/nonexistent/chat.jinja", ["--chat-template", "/nonexistent/chat.jinja"]),
        ("{% for m in messages %}{{ m.content }", ["--chat-template", "fails"]),
        ("{{ messages | no_such_filter }}", ["--chat-template", "fails"]),
    ],
)
def test_a_bad_template_stops_the_start(template: str, words: list[str]) -> None:
    assert_one_line_exit_2(run_serve(["--chat-template", template]), *words)

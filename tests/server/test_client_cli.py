"""`eagleserve chat` and `eagleserve complete` (vLLM's `vllm chat`, `vllm complete`) against a
running server: what they print is the server's greedy answer, a chat's second line is
answered with the first exchange before it, `--version` names the package, and a server that
cannot be reached, or refuses the request, is one line and exit code 1."""

from __future__ import annotations

import random
import subprocess
import sys
from importlib.metadata import version

import httpx
from server_fixtures import ServerProcess, http_fixture, server_fixture  # noqa: F401

QUESTIONS = ["Name three colours.", "What is the capital of France?", "Count to five."]
PROMPTS = ["The days of the week are", "1, 2, 3, 4,", "Once upon a time"]


def cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "eagleserve", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=300)


def chat(http: httpx.Client, messages: list[dict[str, str]], n: int) -> str:
    body = {"messages": messages, "max_tokens": n, "temperature": 0}
    return http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]


def test_chat_keeps_the_conversation(server: ServerProcess, http: httpx.Client) -> None:
    first, second = random.sample(QUESTIONS, 2)
    system, n = "Answer briefly.", random.randint(6, 16)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    want_first = chat(http, messages, n)
    messages += [{"role": "assistant", "content": want_first}, {"role": "user", "content": second}]
    want_second = chat(http, messages, n)
    got = cli("chat", "--url", server.url + "/v1", "--max-tokens", str(n), "--temperature", "0",
              "--system-prompt", system, stdin=f"{first}\n{second}\n")  # fmt: skip
    assert got.returncode == 0, got.stderr
    assert got.stdout == f"{want_first}\n{want_second}\n"


def test_complete_quick(server: ServerProcess, http: httpx.Client) -> None:
    prompt, n = random.choice(PROMPTS), random.randint(4, 12)
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0}
    want = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    got = cli("complete", "--url", server.url + "/v1", "--max-tokens", str(n), "--temperature",
              "0", "-q", prompt)  # fmt: skip
    assert got.returncode == 0 and got.stdout == want + "\n", got.stderr


def test_failures_are_one_line(server: ServerProcess) -> None:
    gone = cli("chat", "--url", "http://127.0.0.1:9/v1", "-q", "Hi")
    assert gone.returncode == 1 and gone.stdout == ""
    assert gone.stderr.startswith("eagleserve chat: cannot reach") and gone.stderr.count("\n") == 1
    refused = cli("complete", "--url", server.url + "/v1", "--model-name", "no-such-model", "-q",
                  "Hi")  # fmt: skip
    assert refused.returncode == 1 and refused.stderr.startswith("eagleserve complete: 404")
    assert refused.stderr.count("\n") == 1


def test_version() -> None:
    got = cli("--version")
    assert got.returncode == 0 and got.stdout == f"eagleserve {version('eagleserve')}\n"

"""`eagleserve chat` and `eagleserve complete` (vLLM's `vllm chat` and `vllm complete`): talk
to a running server from a terminal. Each line read is one request, its answer streamed as it
comes; a chat keeps the conversation (its answers included) for the next line. `-q TEXT` sends
one and exits. Only the standard library: the server's OpenAI routes over HTTP."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000/v1"  # `make serve`'s address


class ServerError(Exception):
    """The server could not be reached, or answered with an error."""


def add_client_parsers(sub: argparse._SubParsersAction) -> None:
    for name, what in (("chat", "chat with a running server, a conversation kept per session"),
                       ("complete", "complete prompts on a running server")):  # fmt: skip
        p = sub.add_parser(name, help=f"{what} (vLLM's `vllm {name}`)",
                           description=f"{what[0].upper()}{what[1:]}: each line is a request, its "
                           "answer streamed; Ctrl-D or Ctrl-C ends it.")  # fmt: skip
        p.add_argument(
            "--url", default=DEFAULT_URL, help=f"the server's API (default {DEFAULT_URL})"
        )
        p.add_argument("--model-name", help="the model to ask (default: the server's first)")
        p.add_argument("--api-key", default=os.environ.get("EAGLESERVE_API_KEY"),
                       help="the server's --api-key (default: $EAGLESERVE_API_KEY)")  # fmt: skip
        p.add_argument("--max-tokens", type=int, default=None,
                       help="most tokens per answer (default: the server's)")  # fmt: skip
        p.add_argument("--temperature", type=float, default=None,
                       help="0: greedy (default: the server's)")  # fmt: skip
        p.add_argument(
            "-q", "--quick", metavar="TEXT", help="send TEXT alone, print the answer, exit"
        )
        if name == "chat":
            p.add_argument("--system-prompt", help="a system message first in the conversation")
        p.set_defaults(func=run_chat if name == "chat" else run_complete)


def request(ns: argparse.Namespace, path: str, body: dict[str, Any] | None = None) -> Any:
    headers = {"Content-Type": "application/json"}
    if ns.api_key:
        headers["Authorization"] = f"Bearer {ns.api_key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(ns.url.rstrip("/") + path, data=data, headers=headers)
    try:
        return urllib.request.urlopen(req, timeout=3600)
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise ServerError(f"{exc.code} {message}") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ServerError(f"cannot reach {ns.url}: {reason}") from exc


def model_name(ns: argparse.Namespace) -> str:
    if ns.model_name:
        return ns.model_name
    with request(ns, "/models") as resp:
        return json.load(resp)["data"][0]["id"]


def streamed(ns: argparse.Namespace, path: str, body: dict[str, Any]) -> Iterator[str]:
    """The text pieces of one streamed answer (an error event is a ServerError)."""
    with request(ns, path, {**body, "stream": True}) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise ServerError(event["error"].get("message", "the request failed"))
            for choice in event.get("choices", []):
                delta = choice.get("delta")  # a chat's; a completion's chunk has its text
                piece = delta.get("content") if delta is not None else choice.get("text")
                if piece:
                    yield piece


def lines(ns: argparse.Namespace, prompt: str) -> Iterator[str]:
    """The lines to send: -q's, or what the user types (a prompt shown only on a terminal)."""
    if ns.quick is not None:
        yield ns.quick
        return
    shown = prompt if sys.stdin.isatty() else ""
    while True:
        try:
            yield input(shown)
        except (EOFError, KeyboardInterrupt):
            return


def answer(ns: argparse.Namespace, path: str, body: dict[str, Any]) -> str:
    """Prints the streamed answer as it comes; returns it whole."""
    for name in ("max_tokens", "temperature"):
        if getattr(ns, name) is not None:
            body[name] = getattr(ns, name)
    text = []
    for piece in streamed(ns, path, body):
        print(piece, end="", flush=True)
        text.append(piece)
    print(flush=True)
    return "".join(text)


def run_chat(ns: argparse.Namespace) -> int:
    def session() -> None:
        model = model_name(ns)
        messages = [{"role": "system", "content": ns.system_prompt}] if ns.system_prompt else []
        for line in lines(ns, "> "):
            messages.append({"role": "user", "content": line})
            reply = answer(ns, "/chat/completions", {"model": model, "messages": messages})
            messages.append({"role": "assistant", "content": reply})

    return run("chat", session)


def run_complete(ns: argparse.Namespace) -> int:
    def session() -> None:
        model = model_name(ns)
        for line in lines(ns, "> "):
            answer(ns, "/completions", {"model": model, "prompt": line})

    return run("complete", session)


def run(name: str, session: Callable[[], None]) -> int:
    """The command's exit code: 1 where the server failed it (one line), 0 otherwise (Ctrl-C
    too, mid-answer included)."""
    try:
        session()
    except ServerError as exc:
        print(f"eagleserve {name}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(flush=True)
    return 0

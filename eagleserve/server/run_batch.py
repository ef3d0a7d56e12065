"""`eagleserve run-batch -i IN.jsonl -o OUT.jsonl`: OpenAI's batch file format run offline,
as vLLM's `run-batch`. Each input line is a request, `{"custom_id", "method": "POST", "url",
"body"}`, to /v1/completions, /v1/chat/completions or /v1/responses; each output line is its
answer, `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`, in
the input's order. A request the server would refuse gets its 4xx status and error body; a
line that is no such request (not JSON, another URL or method, `stream`) gets `response`
null and an `error`.

The requests run through the server's own routes, in this process with no port, up to
`--max-running-requests` at once, so an answer is the one `eagleserve serve` would give with
the same flags. Answers are written as soon as every line before them is done: an interrupted
run keeps them (its output holds a prefix of the input's lines).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import IO, Any

from tqdm import tqdm

from eagleserve.config import ServerArgs
from eagleserve.server.api import create_app
from eagleserve.server.engine_client import EngineClient
from eagleserve.server.startup import StartupError, check_paths, fail, start_engine

BATCH_URLS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
logger = logging.getLogger("eagleserve.server")
App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


@dataclass(frozen=True)
class BatchLine:
    custom_id: str | None
    url: str = ""
    body: bytes = b""
    error: str | None = None  # why the line is no request this runs


def parse_line(text: str) -> BatchLine:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return BatchLine(None, error=f"not JSON: {exc}")
    if not isinstance(obj, dict):
        return BatchLine(None, error="a line must be a JSON object")
    custom_id = obj.get("custom_id")
    custom_id = custom_id if isinstance(custom_id, str) else None
    url, body = obj.get("url"), obj.get("body")
    if obj.get("method", "POST") != "POST":
        return BatchLine(custom_id, error=f"method {obj.get('method')!r}: only POST runs")
    if url not in BATCH_URLS:
        return BatchLine(custom_id, error=f"url {url!r}: one of {', '.join(BATCH_URLS)}")
    if not isinstance(body, dict):
        return BatchLine(custom_id, error="body must be a JSON object (the request's body)")
    if body.get("stream"):
        return BatchLine(custom_id, error="stream: a batch's answers are whole (stream false)")
    if body.get("background"):
        return BatchLine(custom_id, error="background: a batch's answers are whole (false)")
    return BatchLine(custom_id, url, json.dumps(body).encode())


def output_line(line: BatchLine, status: int | None, body: Any) -> dict[str, Any]:
    """An answer in OpenAI's batch output format (`response` null for a line that did not run)."""
    response = None
    if status is not None:
        response = {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}", "body": body}
    error = None if line.error is None else {"code": "invalid_batch_line", "message": line.error}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": response, "error": error}  # fmt: skip


async def call_app(app: App, path: str, body: bytes, api_key: str | None) -> tuple[int, Any]:
    """One POST through the ASGI app (its middleware and routes), as a client would send it:
    (status, JSON body)."""
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]  # fmt: skip
    if api_key is not None:
        headers.append((b"authorization", f"Bearer {api_key}".encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "headers": headers,
             "client": ("run-batch", 0), "server": ("run-batch", 0)}  # fmt: skip
    answered = asyncio.Event()
    sent = False
    status, chunks = 500, []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await answered.wait()  # the client stays until the answer is whole
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                answered.set()

    try:
        await app(scope, receive, send)
    except Exception:  # Starlette re-raises after its 500 went out (for a server's log)
        logger.exception("run-batch: %s failed", path)
    answered.set()
    raw = b"".join(chunks)
    try:
        return status, json.loads(raw or b"null")
    except ValueError:  # a plain-text answer (the 500 above): kept as an error body
        return status, {"error": {"message": raw.decode(errors="replace"), "code": status}}


async def run_lines(app: App, lines: list[BatchLine], out: IO[str], api_key: str | None,
                    concurrency: int) -> tuple[int, int]:  # fmt: skip
    """Runs the lines, writing each answer once those before it are written; (answers with
    status 200, other lines)."""
    gate = asyncio.Semaphore(concurrency)
    done: dict[int, dict[str, Any]] = {}
    written, ok = 0, 0
    bar = tqdm(total=len(lines), desc="run-batch", unit="req", file=sys.stderr)

    async def one(i: int, line: BatchLine) -> None:
        nonlocal written, ok
        if line.error is not None:
            done[i] = output_line(line, None, None)
        else:
            async with gate:
                status, body = await call_app(app, line.url, line.body, api_key)
            done[i] = output_line(line, status, body)
            ok += status == 200
        bar.update()
        while written in done:
            out.write(json.dumps(done.pop(written), ensure_ascii=False) + "\n")
            written += 1
        out.flush()

    await asyncio.gather(*(one(i, line) for i, line in enumerate(lines)))
    bar.close()
    return ok, len(lines) - ok


async def run_batch(args: ServerArgs, input_file: str, output_file: str) -> int:
    """The command's exit code: 0 when every line was answered (some may be errors), 2 when
    it cannot start (files, flags, the engine)."""
    debug = args.log_level.lower() == "debug"
    try:
        with open(input_file, encoding="utf-8") as f:
            lines = [parse_line(t) for t in f if t.strip()]
    except OSError as exc:
        return fail(f"run-batch: {exc.filename}: {exc.strerror}")
    # Checked now, opened (emptied) only once the engine runs: a start that fails keeps an
    # earlier run's answers.
    folder = os.path.dirname(os.path.abspath(output_file))
    if os.path.isdir(output_file) or not os.access(folder, os.W_OK):
        return fail(f"run-batch: {output_file}: cannot be written")
    client = EngineClient(args)
    try:
        check_paths(args)
        if not await start_engine(client):
            return fail("stopped while starting")
        with open(output_file, "w", encoding="utf-8") as out:
            ok, failed = await run_lines(create_app(args, client), lines, out, args.api_key,
                                         args.max_running_requests)  # fmt: skip
    except StartupError as exc:
        return fail(str(exc), getattr(exc.__cause__, "traceback", ""), debug)
    finally:
        await client.shutdown()
    print(f"run-batch: {len(lines)} lines, {ok} answered 200, {failed} not (see their status "
          f"or error) -> {output_file}", file=sys.stderr)  # fmt: skip
    return 0

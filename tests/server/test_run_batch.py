"""`eagleserve run-batch` (server/run_batch.py): an OpenAI batch file's requests answered in
OpenAI's batch output format, line for line in the input's order, each answer the one the
server gives for the same body (greedy: the same text); a request the server refuses keeps its
status and error body; lines that are no request get an error and no response; a missing
input file stops it with one line and exit code 2."""

from __future__ import annotations

import asyncio
import io
import json
import random
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
from server_fixtures import KV_TOKENS, http_fixture, server_fixture  # noqa: F401 (fixtures)
from test_startup import assert_one_line_exit_2

from eagleserve.server.run_batch import BATCH_URLS, parse_line, run_lines

PROMPTS = ["Name a colour.", "Count to four.", "What is two plus two?", "Say hi."]


def run_batch(tmp: Path, lines: list[str]) -> tuple[subprocess.CompletedProcess[str], Path]:
    src, out = tmp / "in.jsonl", tmp / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "eagleserve", "run-batch", "-i", str(src), "-o", str(out),
           "--device", "cpu", "--max-total-tokens", str(KV_TOKENS),
           "--log-level", "warning"]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600), out


def request(url: str) -> dict[str, Any]:
    n = random.randint(3, 10)
    prompt = random.choice(PROMPTS)
    body: dict[str, Any] = {
        "/v1/completions": {"prompt": prompt, "max_tokens": n},
        "/v1/chat/completions": {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": n,
        },
        "/v1/responses": {"input": prompt, "max_output_tokens": n, "store": False},
    }[url]
    return {"custom_id": uuid.uuid4().hex[:8], "method": "POST", "url": url,
            "body": {**body, "temperature": 0}}  # fmt: skip


def text_of(url: str, body: dict[str, Any]) -> str:
    if url == "/v1/completions":
        return body["choices"][0]["text"]
    if url == "/v1/chat/completions":
        return body["choices"][0]["message"]["content"]
    return body["output"][0]["content"][0]["text"]


def test_answers_in_order_as_the_server_gives_them(tmp_path: Path, http: httpx.Client) -> None:
    reqs = [request(random.choice(BATCH_URLS)) for _ in range(6)]
    refused = {"custom_id": "refused", "method": "POST", "url": "/v1/completions",
               "body": {"prompt": "x", "suffix": "y"}}  # fmt: skip
    streamed = {**reqs[0], "custom_id": "streamed", "body": {**reqs[0]["body"], "stream": True}}
    bad = ["not json", json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/models"}),
           json.dumps(streamed)]  # fmt: skip
    lines = [json.dumps(r) for r in reqs] + [json.dumps(refused)] + bad
    random.shuffle(lines)
    proc, out = run_batch(tmp_path, lines)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    assert [a["custom_id"] for a in answers] == [
        json.loads(line)["custom_id"] if line != "not json" else None for line in lines
    ]
    assert len({a["id"] for a in answers}) == len(answers)
    by_id = {a["custom_id"]: a for a in answers}
    for r in reqs:
        got = by_id[r["custom_id"]]
        assert got["error"] is None and got["response"]["status_code"] == 200
        want = http.post(r["url"], json=r["body"]).json()
        assert text_of(r["url"], got["response"]["body"]) == text_of(r["url"], want)
    assert by_id["refused"]["response"]["status_code"] == 400
    assert by_id["refused"]["response"]["body"]["error"]["param"] == "suffix"
    for key in ("get", "streamed", None):
        assert by_id[key]["response"] is None and by_id[key]["error"]["message"]
    assert f"{len(lines)} lines, {len(reqs)} answered 200" in proc.stderr


def test_lines_that_are_no_request() -> None:
    ok = parse_line(json.dumps({"custom_id": "a", "url": "/v1/responses", "body": {"input": "x"}}))
    assert ok.error is None and ok.custom_id == "a" and json.loads(ok.body) == {"input": "x"}
    for line, word in [
        ("[1, 2]", "JSON object"),
        ("{", "not JSON"),
        (json.dumps({"url": "/v1/completions", "method": "PUT", "body": {}}), "method"),
        (json.dumps({"url": "/v1/embeddings", "body": {}}), "url"),
        (json.dumps({"url": "/v1/completions", "body": "prompt"}), "body"),
        (json.dumps({"url": "/v1/completions", "body": {"stream": True}}), "stream"),
        (json.dumps({"url": "/v1/responses", "body": {"background": True}}), "background"),
    ]:
        assert word in (parse_line(line).error or ""), line


def test_what_cannot_run_is_one_line_exit_2_and_keeps_the_output(tmp_path: Path) -> None:
    """A missing input, an output that cannot be written, a start that fails: one line, exit
    code 2, and an earlier run's answers still there."""

    def batch(src: Path, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "eagleserve", "run-batch", "-i", str(src), "-o", str(out),
               "--device", "cpu", *flags]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps(request("/v1/completions")) + "\n")
    earlier = json.dumps({"custom_id": uuid.uuid4().hex}) + "\n"
    out.write_text(earlier)
    assert_one_line_exit_2(batch(tmp_path / "none.jsonl", out), "none.jsonl")
    assert_one_line_exit_2(batch(src, tmp_path), str(tmp_path))  # a folder
    assert_one_line_exit_2(batch(src, out, "--model", "/nonexistent/model"), "/nonexistent")
    assert out.read_text() == earlier


def test_a_route_that_fails_answers_500_and_the_batch_goes_on() -> None:
    """An exception in a route (Starlette answers a plain-text 500, then re-raises it) is that
    line's 500 with the text as its error; the other lines still run."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def route(request: Request) -> JSONResponse:
        body = await request.json()
        if body.get("fail"):
            raise RuntimeError("a broken route")
        return JSONResponse({"echo": body})

    app = Starlette(routes=[Route("/v1/completions", route, methods=["POST"])])
    raw = [{"custom_id": str(i), "url": "/v1/completions", "body": {"fail": i == 1, "n": i}}
           for i in range(3)]  # fmt: skip
    lines = [parse_line(json.dumps(r)) for r in raw]
    out = io.StringIO()
    ok, failed = asyncio.run(run_lines(app, lines, out, None, 2))
    answers = [json.loads(x) for x in out.getvalue().splitlines()]
    assert (ok, failed) == (2, 1) and [a["custom_id"] for a in answers] == ["0", "1", "2"]
    assert answers[1]["response"]["status_code"] == 500
    assert "Internal Server Error" in answers[1]["response"]["body"]["error"]["message"]
    assert answers[2]["response"]["body"] == {"echo": {"fail": False, "n": 2}}

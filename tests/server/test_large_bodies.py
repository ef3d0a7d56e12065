"""Large request bodies (issue #20 item 3): a size limit answered with a 413 before the body is
read, and tokenizing off the event loop so /health and other clients stay responsive."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from server_fixtures import (  # noqa: F401 (fixtures)
    ServerProcess,
    http_fixture,
    server_fixture,
)

SMALL_LIMIT = 4096


@pytest.fixture(scope="module", name="small_server")
def small_server_fixture() -> Iterator[ServerProcess]:
    srv = ServerProcess(["--max-total-tokens", "512", "--max-request-body-bytes", str(SMALL_LIMIT)])
    yield srv
    srv.stop()


def raw_post(url: str, head: list[str], parts: list[bytes], timeout: float = 10.0) -> bytes:
    """Sends the request line + headers + `parts` (not necessarily a whole body) on a raw socket
    and returns everything the server answers before it closes the connection. A server that
    closes with part of the body unread makes its kernel reset the connection, so a reset after
    the answer has come ends the answer; before it, it is an error."""
    u = urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as sock:
        lines = ["POST /v1/completions HTTP/1.1", f"Host: {u.netloc}",
                 "Content-Type: application/json", *head]  # fmt: skip
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        for part in parts:
            sock.sendall(part)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            if not data:
                raise
        return data


def error_of(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    return status, json.loads(body)["error"]


def test_declared_length_over_limit_is_413_before_the_body(server: ServerProcess) -> None:
    """100 MB declared, 1 KB sent: the answer comes without the server waiting for the rest."""
    t0 = time.monotonic()
    answer = raw_post(server.url, ["Content-Length: 100000000"], [b'{"prompt": "' + b"a" * 1024])
    status, err = error_of(answer)
    assert status == 413, answer[:300]
    assert err["code"] == "request_too_large" and str(16 * 2**20) in err["message"]
    assert time.monotonic() - t0 < 5


def test_chunked_body_over_limit_is_413(small_server: ServerProcess) -> None:
    """No Content-Length: the server stops reading once the chunks pass the limit (the final
    chunk is never sent, so an answer at all proves it did not wait for the end)."""
    piece = b"a" * 3000
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    answer = raw_post(small_server.url, ["Transfer-Encoding: chunked"], [chunk, chunk])
    status, err = error_of(answer)
    assert status == 413, answer[:300]
    assert str(SMALL_LIMIT) in err["message"]


def test_limit_is_on_the_body_size(small_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=small_server.url + "/v1", api_key="x", max_retries=0)
    ok = client.completions.create(model="default", prompt="a" * 100, max_tokens=1)
    assert ok.choices[0].finish_reason
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(model="default", prompt="a" * SMALL_LIMIT, max_tokens=1)
    assert exc.value.status_code == 413
    assert httpx.get(small_server.url + "/health").status_code == 200


BIG = {
    # 5 MB of text: seconds of tokenizing.
    "text": ("/v1/completions", {"prompt": "hello world, this is text. " * 190_000}),
    # 200k messages (6 MB): over a second of validating, then seconds of chat templating.
    "messages": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]
                                          * 200_000}),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(BIG))
def test_health_answers_while_a_huge_prompt_is_processed(
    server: ServerProcess, http: httpx.Client, kind: str
) -> None:
    """A huge prompt takes seconds to validate and tokenize (then is a 400: longer than the
    context); on the event loop that stalled /health for as long. Now every probe answers
    promptly meanwhile."""
    path, big = BIG[kind]
    result: list[httpx.Response] = []
    worker = threading.Thread(
        target=lambda: result.append(
            httpx.post(server.url + path, json={**big, "max_tokens": 1}, timeout=120)
        )  # fmt: skip
    )
    worker.start()
    time.sleep(0.5)  # the body is uploaded: validating / tokenizing has begun
    worst = 0.0
    probes = 0
    while worker.is_alive() and probes < 8:
        t0 = time.monotonic()
        assert http.get("/health").status_code == 200
        worst = max(worst, time.monotonic() - t0)
        probes += 1
        time.sleep(0.1)
    busy = worker.is_alive()  # the probes all ran while the big request was in progress
    worker.join(120)
    assert result and result[0].status_code == 400, result
    assert result[0].json()["error"]["code"] == "context_length_exceeded"
    assert busy and probes == 8, probes
    assert worst < 1.0, worst  # was the whole processing time (seconds) before

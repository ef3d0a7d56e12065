"""Reading a request body under a size limit (`--max-request-body-bytes`).

Invariant: the server never holds more than `limit` bytes of one body. A declared
Content-Length over the limit is answered at once, before any of the body is read; a chunked
body is read until it passes the limit, then answered. Either way the answer is a 413 in
OpenAI's error format, and uvicorn closes the connection (the rest of the body is never read).
"""

from __future__ import annotations

from fastapi import Request

from eagleserve.server.serving import ApiError


def too_large(limit: int) -> ApiError:
    msg = f"the request body is larger than this server's limit of {limit} bytes"
    return ApiError(413, msg, None, "request_too_large")


async def read_body(request: Request, limit: int) -> bytes | ApiError:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)

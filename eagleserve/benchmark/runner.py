"""Sends the benchmark's requests: each one streamed, timed chunk by chunk, or (without
streaming) timed whole, and counted by the server's usage; arrivals at the request rate, at
most `max_concurrency` in flight."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from eagleserve.benchmark.datasets import BenchPrompt
from eagleserve.benchmark.stats import RequestRecord

# A generation on a loaded server may take long; the benchmark waits it out (vLLM: 6 hours).
TIMEOUT = httpx.Timeout(6 * 3600.0, connect=30.0)


@dataclass(frozen=True)
class RequestSettings:
    """What every request of the run asks, besides its prompt and length."""

    model: str
    chat: bool  # /v1/chat/completions (the prompt one user message), else /v1/completions
    temperature: float
    top_p: float | None
    top_k: int | None
    ignore_eos: bool
    stream: bool = True

    def body(self, p: BenchPrompt) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": p.output_len,
            "temperature": self.temperature,
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.chat:
            assert isinstance(p.prompt, str), "a chat prompt is text"
            body["messages"] = [{"role": "user", "content": p.prompt}]
        else:
            body["prompt"] = p.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.top_p is not None:
            body["top_p"] = self.top_p
        if self.top_k is not None:
            body["top_k"] = self.top_k
        return body


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a completion or chat chunk, or a whole answer, holds (a reasoning model's
    thinking included)."""
    parts = []
    for choice in chunk.get("choices") or []:
        said = choice.get("delta") or choice.get("message") or {}
        parts += [choice.get("text"), said.get("reasoning_content"), said.get("content")]
    return "".join(p for p in parts if p)


async def send_request(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], t0: float
) -> RequestRecord:
    """One request, timed; its failure (a status, an error event, a lost connection) is kept in
    the record, never raised."""
    rec = RequestRecord(streamed=body["stream"])
    sent = time.perf_counter()
    rec.start = sent - t0
    if not rec.streamed:
        return await send_whole(http, path, body, rec, sent)
    last = None
    try:
        async with http.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:300]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    rec.error = str(chunk["error"].get("message", chunk["error"]))
                    return rec
                now = time.perf_counter()
                text = chunk_text(chunk)
                if text:
                    rec.generated_text += text
                    if last is None:
                        rec.ttft = now - sent
                    else:
                        rec.itls.append(now - last)
                    last = now
                usage = chunk.get("usage")
                if usage:
                    rec.prompt_tokens = usage["prompt_tokens"]
                    rec.output_tokens = usage["completion_tokens"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
        return rec
    rec.latency = time.perf_counter() - sent
    rec.ok = rec.output_tokens > 0
    if not rec.ok:
        rec.error = "the stream ended without output or usage"
    return rec


async def send_whole(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], rec: RequestRecord, sent: float
) -> RequestRecord:
    """A request that is not streamed: its client sees its first token with its last, so its
    time to first token is its latency (as SGLang's benchmark counts it)."""
    try:
        resp = await http.post(path, json=body)
        if resp.status_code != 200:
            rec.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
            return rec
        answer = resp.json()
        rec.generated_text = chunk_text(answer)
        rec.prompt_tokens = answer["usage"]["prompt_tokens"]
        rec.output_tokens = answer["usage"]["completion_tokens"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
        return rec
    rec.latency = rec.ttft = time.perf_counter() - sent
    rec.ok = rec.output_tokens > 0
    if not rec.ok:
        rec.error = "the answer had no output"
    return rec


async def run_requests(
    send: Callable[[BenchPrompt, float], Awaitable[RequestRecord]],
    prompts: list[BenchPrompt],
    gaps: list[float],
    max_concurrency: int | None,
    progress: bool,
) -> tuple[list[RequestRecord], float]:
    """Sends each prompt after its gap (at most `max_concurrency` in flight: later arrivals wait
    for a free slot); the records in the prompts' order and the run's wall time in seconds."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=not progress)
    t0 = time.perf_counter()

    async def one(p: BenchPrompt) -> RequestRecord:
        if slots is None:
            rec = await send(p, t0)
        else:
            async with slots:
                rec = await send(p, t0)
        bar.update(1)
        return rec

    tasks = []
    for p, gap in zip(prompts, gaps, strict=True):
        if gap > 0:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(p)))
    records = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    bar.close()
    return list(records), duration

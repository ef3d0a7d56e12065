"""The server side of the engine process: start it, send requests, route its outputs.

One asyncio task receives every engine message and hands each `TokenOutput` to the queue of its
request. If the engine process dies, the client turns unhealthy and every in-flight request
gets a final 503 error output.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from eagleserve.config import ServerArgs
from eagleserve.messages import (
    AbortReq,
    BatchTokenOutput,
    EngineReady,
    EngineStartupError,
    EngineStats,
    FlushCacheReq,
    FlushCacheResult,
    GenerateReqInput,
    ProfileReq,
    ProfileResult,
    ShutdownReq,
    StatsReq,
    TokenOutput,
)
from eagleserve.models.loader import load_tokenizer, load_tokenizer_in_background, model_folder
from eagleserve.sampling_params import SamplingParams
from eagleserve.server.engine_process import spawn_engine
from eagleserve.server.model_files import serving_files
from eagleserve.server.sampling_defaults import SamplingDefaults

A = TypeVar("A")  # an answer of the engine to one request

logger = logging.getLogger("eagleserve.server")
POLL_MS = 250
# /health_generate: tokens sent this recently while requests run prove the engine works
# without queuing a probe behind them.
RECENT_TOKENS_S = 5.0
FOLLOWER_REPORT_S = 10.0  # how long rank 0 may take to report a follower's start-up failure


class EngineStartupFailed(RuntimeError):
    """The engine process could not start: the message says why in one line; `traceback` is
    the engine's, for --log-level debug."""

    def __init__(self, message: str, traceback: str = "") -> None:
        super().__init__(message)
        self.traceback = traceback


DEAD = "the engine process is not running"


# The health probe's request ids (never aborted by /abort_request), and what separates a
# request id from its choice number (`rid#j`).
HEALTH_PREFIX = "health-"
CHOICE_SEP = "#"


def _error_output(rid: str, message: str, reason: str = "error") -> TokenOutput:
    return TokenOutput(rid, [], True, reason, error=message, error_code=503)


class RequestStream:
    """The outputs of a group of requests (the n choices of one API call), in arrival order.

    Iterate it to get `TokenOutput`s until every request finished; `close()` aborts whatever is
    still running (idempotent; call it when the client goes away).
    """

    def __init__(self, client: EngineClient, reqs: list[GenerateReqInput]) -> None:
        self.client = client
        self.rids = [r.rid for r in reqs]
        self.live = set(self.rids)
        self.queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
        self.closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenOutput:
        if not self.live:
            raise StopAsyncIteration
        out = await self.queue.get()
        if out.finished:
            self.live.discard(out.rid)
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for rid in self.live:
            self.client.abort(rid)
        for rid in self.rids:
            self.client.queues.pop(rid, None)


class EngineClient:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.ready: EngineReady | None = None
        self.tokenizer: Any = None
        self.sampling_defaults = SamplingDefaults()  # what unset sampling fields mean
        self.healthy = False
        self.draining = False  # shutting down: no new requests (503), in-flight ones finish
        self.died_at: float | None = None  # time.monotonic() when the engine process was lost
        self.closing: str | None = None  # set by cut_all: why every request now ends at once
        self.queues: dict[str, asyncio.Queue[TokenOutput]] = {}
        self.last_stats = EngineStats()
        self.last_tokens_at: float | None = None  # time.monotonic() of the last token outputs
        self.on_stats: Callable[[EngineStats], None] | None = None
        self._stats_waiters: list[asyncio.Future[EngineStats]] = []
        # Callers waiting for the engine's answer to a request, by the answer's type, in the
        # order asked (the engine answers in that order), each with what it gets if the engine
        # dies first.
        self._replies: dict[type, deque[tuple[asyncio.Future[Any], Any]]] = {}
        self._proc: Any = None
        self._followers: list[Any] = []  # tensor-parallel ranks 1.. (tp_engine.py)
        self._tmpdir: str | None = None
        self._recv_task: asyncio.Task[None] | None = None

    @property
    def started(self) -> bool:
        return self.ready is not None

    @property
    def max_context_len(self) -> int:
        return self.ready.max_context_len if self.ready else 0

    async def start(self) -> None:
        """Spawns the engine process and waits until it is ready (or raises EngineStartupFailed)."""
        # The tokenizer loads here while the engine builds, where its folder already exists
        # (a model folder, or a GGUF converted by an earlier start); else once it is ready.
        early: tuple[str, Future[Any]] | None = None
        with contextlib.suppress(OSError):
            folder = model_folder(self.args.model)
            if os.path.isfile(os.path.join(folder, "config.json")):
                early = (folder, load_tokenizer_in_background(folder))
        try:
            spawned = spawn_engine(self.args)
        except RuntimeError as exc:  # no free rendezvous port
            raise EngineStartupFailed(str(exc)) from None
        self._ctx, self._send, self._recv = spawned.ctx, spawned.send, spawned.recv
        self._proc, self._followers, self._tmpdir = spawned.proc, spawned.followers, spawned.tmpdir
        dead_since: float | None = None
        while self.ready is None:
            if await self._recv.poll(POLL_MS):
                msg = await self._recv.recv_pyobj()
                if isinstance(msg, EngineReady):
                    self.ready = msg
                elif isinstance(msg, EngineStartupError):
                    self._proc.join(10)
                    raise EngineStartupFailed(msg.message, msg.traceback)
            elif (dead := self._dead_process()) is not None:
                # A follower that failed to start has told rank 0 why: prefer rank 0's report.
                dead_since = dead_since or time.monotonic()
                if not self._proc.is_alive() or time.monotonic() - dead_since > FOLLOWER_REPORT_S:
                    raise EngineStartupFailed(f"{dead} exited before it was ready")
        if early is not None and early[0] == self.ready.model_path:
            tokenizer = await asyncio.wrap_future(early[1])
        else:
            tokenizer = await asyncio.to_thread(load_tokenizer, self.ready.model_path)
        try:
            self.tokenizer, self.sampling_defaults = serving_files(
                self.args, self.ready.model_path, tokenizer
            )
        except (ValueError, OSError) as exc:
            raise EngineStartupFailed(str(exc)) from None
        self.last_stats = EngineStats(kv_total_tokens=self.ready.kv_total_tokens)
        self.healthy = True
        self._recv_task = asyncio.create_task(self._recv_loop())

    async def _recv_loop(self) -> None:
        while self.healthy:
            if await self._recv.poll(POLL_MS):
                self._dispatch(await self._recv.recv_pyobj())
            elif self._dead_process() is not None:
                logger.error("%s died", self._dead_process())
                self._engine_died()

    def _dead_process(self) -> str | None:
        """Which process of the engine has exited (rank 0 or a tensor-parallel follower)."""
        for rank, proc in enumerate([self._proc, *self._followers]):
            if not proc.is_alive():
                name = "the engine process" if rank == 0 else f"tensor-parallel rank {rank}"
                return f"{name} (exit code {proc.exitcode})"
        return None

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, BatchTokenOutput):
            self.last_tokens_at = time.monotonic()
            for out in msg.outputs:
                queue = self.queues.get(out.rid)
                if queue is not None:
                    queue.put_nowait(out)
        elif isinstance(msg, EngineStats):
            self.last_stats = msg
            if self.on_stats is not None:
                self.on_stats(msg)
            waiters, self._stats_waiters = self._stats_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(msg)
        elif isinstance(msg, FlushCacheResult | ProfileResult):
            waiting = self._replies.get(type(msg))
            if waiting:
                fut, _ = waiting.popleft()
                if not fut.done():  # its caller may have gone
                    fut.set_result(msg)

    def _engine_died(self) -> None:
        self.healthy = False
        self.died_at = time.monotonic()
        for rid, queue in list(self.queues.items()):
            queue.put_nowait(_error_output(rid, DEAD))
        for fut in self._stats_waiters:
            if not fut.done():
                fut.set_result(self.last_stats)
        self._stats_waiters = []
        for waiting in self._replies.values():  # callers see `healthy` false too
            for fut, dead in waiting:
                if not fut.done():
                    fut.set_result(dead)
        self._replies = {}

    def generate(self, reqs: list[GenerateReqInput]) -> RequestStream:
        """Sends the requests; their outputs arrive on the returned stream."""
        stream = RequestStream(self, reqs)
        for req in reqs:
            self.queues[req.rid] = stream.queue
            if not self.healthy:
                stream.queue.put_nowait(_error_output(req.rid, DEAD))
            elif self.closing is not None:
                stream.queue.put_nowait(_error_output(req.rid, self.closing, "abort"))
            else:
                self._send.send_pyobj(req)
        return stream

    def cut_all(self, message: str) -> int:
        """Ends every request in flight now, and any sent later: each gets a final 503 error
        output (its handler answers 503, or sends an error event and [DONE]) and is aborted in
        the engine. Returns how many were cut."""
        self.closing = message
        for rid, queue in list(self.queues.items()):
            queue.put_nowait(_error_output(rid, message, "abort"))
            self.abort(rid)
        return len(self.queues)

    def abort(self, rid: str) -> None:
        if self.healthy:
            self._send.send_pyobj(AbortReq(rid))

    def abort_matching(self, rid: str | None) -> int:
        """SGLang's /abort_request: ends the requests in flight whose id is `rid` or, for the
        choices of one, `rid#j` (every request but health probes when `rid` is None). Each gets
        a final output with finish reason "abort" and is dropped by the engine. Returns how
        many."""
        hits = [r for r in self.queues if not r.startswith(HEALTH_PREFIX)
                and (rid is None or r == rid or r.startswith(rid + CHOICE_SEP))]  # fmt: skip
        for r in hits:
            self.queues.pop(r).put_nowait(TokenOutput(r, [], True, "abort"))  # later ones drop
            self.abort(r)
        return len(hits)

    async def check_generates(self, timeout: float) -> str | None:
        """None when the engine produces tokens: it sent some in the last RECENT_TOKENS_S while
        requests run, or a one-token request of its own finishes within `timeout` seconds;
        else why not (a hung forward leaves the process alive, so /health cannot tell)."""
        recent = self.last_tokens_at is not None and (
            time.monotonic() - self.last_tokens_at < RECENT_TOKENS_S
        )
        if recent and self.queues:
            return None
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        stream = self.generate([GenerateReqInput(HEALTH_PREFIX + uuid.uuid4().hex, [0], params)])
        try:
            out = await asyncio.wait_for(anext(stream), timeout)
        except asyncio.TimeoutError:  # the builtin TimeoutError only from Python 3.11
            return f"the engine produced no token in {timeout:g} s"
        finally:
            stream.close()
        return out.error

    async def ask(self, msg: object, dead: A) -> A:
        """Sends `msg` to the engine and returns its answer, of `dead`'s type; `dead` where
        the engine is not running or dies first."""
        if not self.healthy:
            return dead
        fut: asyncio.Future[A] = asyncio.get_running_loop().create_future()
        self._replies.setdefault(type(dead), deque()).append((fut, dead))
        self._send.send_pyobj(msg)
        return await fut

    async def flush_cache(self) -> FlushCacheResult:
        """Asks the engine to empty its prefix cache; its answer (None freed: requests ran,
        or the engine died meanwhile)."""
        return await self.ask(FlushCacheReq(), FlushCacheResult(None))

    async def profile(self, req: ProfileReq) -> ProfileResult:
        """Starts or stops the engine's torch profiler (scheduler/profiler.py)."""
        return await self.ask(req, ProfileResult(False, "the engine is not running"))

    async def get_stats(self, timeout: float = 2.0) -> EngineStats:
        """Fresh engine stats (the last known ones if the engine does not answer in time)."""
        if not self.healthy:
            return self.last_stats
        fut: asyncio.Future[EngineStats] = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        self._send.send_pyobj(StatsReq())
        done, _ = await asyncio.wait({fut}, timeout=timeout)
        return fut.result() if done else self.last_stats

    async def shutdown(self, timeout: float = 10.0) -> None:
        was_healthy, self.healthy = self.healthy, False
        if self._recv_task is not None:
            self._recv_task.cancel()
            await asyncio.gather(self._recv_task, return_exceptions=True)
        if self._proc is not None:
            if was_healthy and self._proc.is_alive():
                self._send.send_pyobj(ShutdownReq(timeout_s=min(5.0, timeout / 2)))
            elif self._proc.is_alive():  # never became ready (start-up interrupted): nothing
                self._proc.kill()  # to drain, and it ignores SIGTERM (see engine_main)
            await asyncio.to_thread(self._proc.join, timeout)
            if self._proc.is_alive():
                logger.warning("the engine did not stop in %.0f s: killing it", timeout)
                self._proc.kill()  # SIGKILL: it ignores SIGTERM (see engine_main)
                await asyncio.to_thread(self._proc.join, 5)
        told_to_exit = self._proc is not None and self._proc.exitcode == 0
        for proc in self._followers:  # rank 0 tells them to exit when it stops cleanly
            await asyncio.to_thread(proc.join, 5 if told_to_exit else 0)
            if proc.is_alive():
                proc.kill()
                await asyncio.to_thread(proc.join, 5)
        if self._tmpdir is not None:
            self._send.close(linger=0)
            self._recv.close(linger=0)
            self._ctx.term()
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

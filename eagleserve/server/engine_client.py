"""The server side of the engine process: start it, send requests, route its outputs.

One asyncio task receives every engine message and hands each `TokenOutput` to the queue of its
request. If the engine process dies, the client turns unhealthy and every in-flight request
gets a final 503 error output.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq
import zmq.asyncio

from eagleserve.config import ServerArgs
from eagleserve.device import pick_device
from eagleserve.messages import (
    AbortReq,
    BatchTokenOutput,
    EngineReady,
    EngineStartupError,
    EngineStats,
    FlushCacheReq,
    FlushCacheResult,
    GenerateReqInput,
    ShutdownReq,
    StatsReq,
    TokenOutput,
)
from eagleserve.models.loader import load_tokenizer, load_tokenizer_in_background, model_folder
from eagleserve.sampling_params import SamplingParams
from eagleserve.scheduler.engine_loop import run_engine
from eagleserve.scheduler.omp_spin import overlap_spin_env, process_env
from eagleserve.scheduler.tp_engine import rendezvous_port, spawn_followers
from eagleserve.server.model_files import serving_files
from eagleserve.server.sampling_defaults import SamplingDefaults

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


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def engine_main(args: ServerArgs, in_addr: str, out_addr: str, tp_port: int | None) -> None:
    """The engine process. It ignores SIGTERM and SIGINT: a signal to the whole process group
    (systemd's default KillMode, Ctrl-C in a terminal) must not kill it while the server drains;
    the server stops it after the drain (ShutdownReq, then SIGKILL if it does not exit), and it
    exits by itself when the server process is gone."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_engine(args, in_addr, out_addr, tp_port)


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
        self._flush_waiters: list[asyncio.Future[FlushCacheResult]] = []
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
        self._tmpdir = tempfile.mkdtemp(prefix="eagleserve-")
        in_addr = f"ipc://{os.path.join(self._tmpdir, 'to_engine')}"
        out_addr = f"ipc://{os.path.join(self._tmpdir, 'from_engine')}"
        self._ctx = zmq.asyncio.Context()
        self._send = self._ctx.socket(zmq.PUSH)
        self._send.bind(in_addr)
        self._recv = self._ctx.socket(zmq.PULL)
        self._recv.bind(out_addr)
        spawn = mp.get_context("spawn")
        # --tp-size > 1: the engine process is rank 0, the followers are started here too, so
        # that this process sees any rank die (tp_engine.py).
        try:
            tp_port = rendezvous_port() if self.args.tp_size > 1 else None
        except RuntimeError as exc:
            raise EngineStartupFailed(str(exc)) from None
        # With overlap on a CPU the engine is born with libgomp's spin settings (omp_spin.py).
        try:
            device_type = pick_device(self.args.device).type
        except RuntimeError:  # no such device: the engine process reports it
            device_type = "none"
        spin = overlap_spin_env(device_type, self.args.overlap_schedule(device_type))
        self._proc = spawn.Process(
            target=engine_main,
            args=(self.args, in_addr, out_addr, tp_port),
            name="eagleserve-engine",
            daemon=True,
        )
        # The engine and its tensor-parallel followers are born ignoring the group's stop
        # signals (an ignored disposition survives the spawn's exec; a mask does not): one
        # arriving while they still import would kill them with a traceback. Here they are
        # blocked meanwhile, so none meant for the server is lost (Linux keeps a blocked
        # signal pending even while it is ignored).
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        old_handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
        try:
            with process_env(spin):
                self._proc.start()
                self._followers = [] if tp_port is None else spawn_followers(self.args, tp_port)
        finally:
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
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
        elif isinstance(msg, FlushCacheResult):
            flushes, self._flush_waiters = self._flush_waiters, []
            for done in flushes:  # one answer serves every flush asked for meanwhile
                if not done.done():
                    done.set_result(msg)

    def _engine_died(self) -> None:
        self.healthy = False
        self.died_at = time.monotonic()
        for rid, queue in list(self.queues.items()):
            queue.put_nowait(_error_output(rid, DEAD))
        for fut in self._stats_waiters:
            if not fut.done():
                fut.set_result(self.last_stats)
        self._stats_waiters = []
        for done in self._flush_waiters:  # nothing was flushed (callers see `healthy` false)
            if not done.done():
                done.set_result(FlushCacheResult(None))
        self._flush_waiters = []

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

    async def flush_cache(self) -> FlushCacheResult:
        """Asks the engine to empty its prefix cache; its answer (None freed: requests ran,
        or the engine died meanwhile)."""
        if not self.healthy:
            return FlushCacheResult(None)
        fut: asyncio.Future[FlushCacheResult] = asyncio.get_running_loop().create_future()
        self._flush_waiters.append(fut)
        self._send.send_pyobj(FlushCacheReq())
        return await fut

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

"""The engine process: builds the Scheduler and serves it over two ZeroMQ sockets.

The server PUSHes `GenerateReqInput` / `AbortReq` / `StatsReq` / `FlushCacheReq` / `ProfileReq`
/ `ShutdownReq` to `in_addr`; the engine PUSHes `EngineReady` (or `EngineStartupError`),
`BatchTokenOutput`, `EngineStats`, `FlushCacheResult` and `ProfileResult` to `out_addr`. The
engine exits when told to, or when its parent process is gone.

Every rank installs fault injection (scheduler/faults.py; tests only) on its scheduler.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from typing import Any

import zmq

from eagleserve.config import ServerArgs
from eagleserve.device import device_name
from eagleserve.messages import (
    AbortReq,
    BatchTokenOutput,
    EngineReady,
    EngineStartupError,
    FlushCacheReq,
    FlushCacheResult,
    GenerateReqInput,
    ProfileReq,
    ShutdownReq,
    StatsReq,
)
from eagleserve.scheduler.faults import install_fault_injection
from eagleserve.scheduler.profiler import EngineProfiler
from eagleserve.scheduler.stats_log import StatsLog, log_interval_s

logger = logging.getLogger("eagleserve.engine")
IDLE_POLL_MS = 500


class EngineLoop:
    def __init__(
        self, scheduler: Any, recv: zmq.Socket, send: zmq.Socket, log_stats: bool = True
    ) -> None:
        self.scheduler = scheduler
        self.recv = recv
        self.send = send
        self.live: set[str] = set()  # rids added and not finished yet
        self.shutdown_deadline: float | None = None
        self.parent_pid = os.getppid()
        self.profiler = EngineProfiler()
        self.stats_log = StatsLog(scheduler.stats, log_interval_s()) if log_stats else None

    def handle(self, msg: object) -> None:
        if isinstance(msg, GenerateReqInput):
            if self.shutdown_deadline is not None:
                self.scheduler.add_request(msg)
                self.scheduler.abort_request(msg.rid)
                return
            self.live.add(msg.rid)
            self.scheduler.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.scheduler.abort_request(msg.rid)
        elif isinstance(msg, StatsReq):
            self.send.send_pyobj(self.scheduler.stats())
        elif isinstance(msg, FlushCacheReq):
            freed = self.scheduler.flush_cache()
            self.send.send_pyobj(FlushCacheResult(freed))
            if freed:
                logger.info("prefix cache flushed: %d KV slots freed", freed)
        elif isinstance(msg, ProfileReq):
            profiler = self.profiler
            self.send.send_pyobj(profiler.start(msg) if msg.start else profiler.stop())
        elif isinstance(msg, ShutdownReq):
            self.shutdown_deadline = time.monotonic() + msg.timeout_s
        else:
            logger.warning("engine: ignoring unknown message %r", type(msg).__name__)

    def drain(self, block: bool) -> None:
        """Handles every waiting message; when `block`, first waits (briefly) for one."""
        timeout = IDLE_POLL_MS if block else 0
        while self.recv.poll(timeout):
            self.handle(self.recv.recv_pyobj())
            timeout = 0

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    def run(self) -> None:
        sched = self.scheduler
        while self.parent_alive():
            self.drain(block=not sched.has_work())
            if self.stats_log is not None:
                self.stats_log.tick()
            if self.shutdown_deadline is not None:
                if not self.live and not sched.has_work():
                    break
                if time.monotonic() > self.shutdown_deadline:
                    for rid in list(self.live):
                        sched.abort_request(rid)
                    self.shutdown_deadline = time.monotonic() + 5.0
            if not sched.has_work():
                continue
            outputs = self.profiler.step(sched.step)
            for out in outputs:
                if out.finished:
                    self.live.discard(out.rid)
            if outputs:
                self.send.send_pyobj(BatchTokenOutput(outputs))
                if not sched.has_work():  # just went idle: publish final gauges (KV back)
                    self.send.send_pyobj(sched.stats())
        if self.profiler.active:  # a trace still recording is written, not lost
            self.profiler.stop()


def run_engine(args: ServerArgs, in_addr: str, out_addr: str, tp_port: int | None = None) -> None:
    """Entry point of the engine process (multiprocessing spawn target). With --tp-size > 1
    it is rank 0, whose followers (started by the caller) join it at `tp_port`."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.connect(in_addr)
    send = ctx.socket(zmq.PUSH)
    send.setsockopt(zmq.LINGER, 5000)
    send.connect(out_addr)
    t0 = time.perf_counter()
    try:
        from eagleserve.scheduler.scheduler import Scheduler
        from eagleserve.scheduler.tp_engine import start_rank0

        if tp_port is None:
            scheduler = Scheduler(args)
            install_fault_injection(scheduler)
        else:  # every rank installs its own fault injection (tp_engine.join)
            scheduler = start_rank0(args, tp_port, [])
        stats = scheduler.stats()
        ready = EngineReady(
            model_path=scheduler.model_path,
            max_context_len=scheduler.max_context_len,
            kv_total_tokens=stats.kv_total_tokens,
            vocab_size=scheduler.model_config.vocab_size,
            device_name=device_name(scheduler.device),
        )
    except Exception as exc:  # report any start-up failure to the parent, then exit non-zero
        send.send_pyobj(EngineStartupError(f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        _close(ctx, send, recv)
        sys.exit(1)
    logger.info("start-up: engine built in %.2f s", time.perf_counter() - t0)
    send.send_pyobj(ready)
    EngineLoop(scheduler, recv, send, log_stats=not args.disable_log_stats).run()
    if tp_port is not None:
        scheduler.close()
    _close(ctx, send, recv)


def _close(ctx: zmq.Context, send: zmq.Socket, recv: zmq.Socket) -> None:
    """Every exit of the engine process: ctx.term() waits until each socket is closed (one
    left open hangs the exit); `send` lingers until what it queued is delivered."""
    send.close()
    recv.close(linger=0)
    ctx.term()

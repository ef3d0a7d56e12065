"""Starting the engine process (and its tensor-parallel followers) with the two ZeroMQ sockets
the server talks to it over (scheduler/engine_loop.py is the other end)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import zmq
import zmq.asyncio

from eagleserve.config import ServerArgs
from eagleserve.device import pick_device
from eagleserve.scheduler.engine_loop import run_engine
from eagleserve.scheduler.omp_spin import overlap_spin_env, process_env
from eagleserve.scheduler.tp_engine import rendezvous_port, spawn_followers

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def engine_main(args: ServerArgs, in_addr: str, out_addr: str, tp_port: int | None) -> None:
    """The engine process. It ignores SIGTERM and SIGINT: a signal to the whole process group
    (systemd's default KillMode, Ctrl-C in a terminal) must not kill it while the server drains;
    the server stops it after the drain (ShutdownReq, then SIGKILL if it does not exit), and it
    exits by itself when the server process is gone."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_engine(args, in_addr, out_addr, tp_port)


@dataclass
class SpawnedEngine:
    ctx: zmq.asyncio.Context
    send: zmq.asyncio.Socket  # to the engine
    recv: zmq.asyncio.Socket  # from it
    proc: BaseProcess  # the engine (tensor-parallel rank 0)
    followers: list[BaseProcess]  # ranks 1.. (tp_engine.py)
    tmpdir: str  # the sockets' folder, removed at shutdown


def spawn_engine(args: ServerArgs) -> SpawnedEngine:
    """Starts the engine process; RuntimeError where no rendezvous port is free (--tp-size)."""
    # --tp-size > 1: the engine process is rank 0, the followers are started here too, so that
    # the server sees any rank die (tp_engine.py).
    tp_port = rendezvous_port() if args.tp_size > 1 else None
    tmpdir = tempfile.mkdtemp(prefix="eagleserve-")
    in_addr = f"ipc://{os.path.join(tmpdir, 'to_engine')}"
    out_addr = f"ipc://{os.path.join(tmpdir, 'from_engine')}"
    ctx = zmq.asyncio.Context()
    send = ctx.socket(zmq.PUSH)
    send.bind(in_addr)
    recv = ctx.socket(zmq.PULL)
    recv.bind(out_addr)
    spawn = mp.get_context("spawn")
    # With overlap on a CPU the engine is born with libgomp's spin settings (omp_spin.py).
    try:
        device_type = pick_device(args.device).type
    except RuntimeError:  # no such device: the engine process reports it
        device_type = "none"
    spin = overlap_spin_env(device_type, args.overlap_schedule(device_type))
    proc = spawn.Process(
        target=engine_main,
        args=(args, in_addr, out_addr, tp_port),
        name="eagleserve-engine",
        daemon=True,
    )
    # The engine and its tensor-parallel followers are born ignoring the group's stop signals
    # (an ignored disposition survives the spawn's exec; a mask does not): one arriving while
    # they still import would kill them with a traceback. Here they are blocked meanwhile, so
    # none meant for the server is lost (Linux keeps a blocked signal pending even while it is
    # ignored).
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    old_handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    try:
        with process_env(spin):
            proc.start()
            followers = [] if tp_port is None else spawn_followers(args, tp_port)
    finally:
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    return SpawnedEngine(ctx, send, recv, proc, followers, tmpdir)

"""Data parallelism: `--dp-size N` runs N whole servers (replicas) on one host, on ports
--port, --port + 1, ... (each picks its own with --port 0), and on GPUs replica i on devices
i * tp_size .. (i + 1) * tp_size - 1 after --device's.

There is no balancer in here: requests reach the replicas through nginx (deploy/nginx.conf,
least connections) or a Kubernetes Service, as for replicas on several hosts. SGLang's
--dp-size puts a controller process in front of its replicas instead; an nginx upstream does
the same job and is what a multi-host deployment needs anyway.

This process supervises: SIGTERM / SIGINT go to every replica (each drains, see launch.py);
when one replica exits non-zero the others are stopped and this exits with its code (2 for a
start-up error, 1 for an engine that died), so an orchestrator restarts the whole set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import os
import signal
import sys
import time
from multiprocessing.process import BaseProcess
from types import FrameType

import torch

from eagleserve.config import ServerArgs
from eagleserve.device import pick_device

POLL_S = 0.2


def replica_args(args: ServerArgs, i: int) -> ServerArgs:
    """Replica i's own args: one replica, its port, its devices on GPUs, and its own random seed
    (replicas with one seed would give their i-th unseeded requests the same draws)."""
    port = args.port + i if args.port else 0
    seed = None if args.random_seed is None else args.random_seed + i
    out = dataclasses.replace(args, dp_size=1, port=port, random_seed=seed)
    device = pick_device(args.device)
    if device.type == "cpu":
        return out
    first = (device.index or 0) + i * args.tp_size
    return dataclasses.replace(out, device=f"{device.type}:{first}")


def check_devices(args: ServerArgs) -> str | None:
    """One line when the replicas need more GPUs than there are; None when they fit."""
    device = pick_device(args.device)
    if device.type == "cpu":
        return None
    need = (device.index or 0) + args.dp_size * args.tp_size
    have = torch.accelerator.device_count()
    if need > have:
        return (f"--dp-size {args.dp_size} x --tp-size {args.tp_size} from {device} needs "
                f"{need} devices; there are {have}")  # fmt: skip
    return None


def _replica_main(args: ServerArgs, threads: int | None) -> None:
    from eagleserve.server.launch import serve

    # Its own process group: a Ctrl-C or a group-wide SIGTERM reaches the supervisor only, which
    # passes it on once (a second signal would cut the replica's drain short).
    os.setpgid(0, 0)
    if threads is not None:  # read by torch in the engine process this replica starts
        os.environ["OMP_NUM_THREADS"] = str(threads)

    sys.exit(asyncio.run(serve(args)))


def run_replicas(args: ServerArgs) -> int:
    """Starts the replicas and waits for them; the exit code (see the module docstring)."""
    problem = check_devices(args)
    if problem is not None:
        print(f"eagleserve: error: {problem}", file=sys.stderr, flush=True)
        return 2
    ctx = mp.get_context("spawn")
    # On a CPU the replicas share the cores: each gets its part unless OMP_NUM_THREADS says.
    on_cpu = pick_device(args.device).type == "cpu"
    threads = (
        max(1, (os.cpu_count() or 1) // args.dp_size)
        if on_cpu and "OMP_NUM_THREADS" not in os.environ
        else None
    )
    # Not daemonic: each replica starts its own engine process.
    procs: list[BaseProcess] = [
        ctx.Process(
            target=_replica_main, args=(replica_args(args, i), threads), name=f"eagleserve-dp{i}"
        )
        for i in range(args.dp_size)
    ]

    def forward(sig: int, frame: FrameType | None) -> None:
        for proc in procs:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    for proc in procs:
        proc.start()
    failed: int | None = None
    while any(p.is_alive() for p in procs):
        for proc in procs:
            code = proc.exitcode
            if code not in (None, 0) and failed is None:
                failed = code
                for other in procs:  # a set with a dead member stops as a whole
                    if other.is_alive():
                        other.terminate()
        time.sleep(POLL_S)
    codes = [p.exitcode for p in procs]
    if failed is not None:
        return failed if failed > 0 else 1
    return next((c for c in codes if c), 0)

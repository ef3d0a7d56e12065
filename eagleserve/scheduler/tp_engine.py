"""Tensor parallelism of one engine: a scheduler per rank, kept identical by replaying rank 0's.

Rank 0 is the engine (the engine process of `eagleserve serve`, or the caller of the offline
`Engine`); ranks 1..N-1 are followers, started with torch.multiprocessing and joined over
torch.distributed (model/parallel.py). Every rank builds the same Scheduler over its shard of
the target (model/tp_shard.py). Rank 0 alone receives requests; every scheduler call that
changes state (add_request, abort_request, step) is broadcast, in rank 0's order, before rank 0
makes it, and each follower makes the same calls. The schedulers then choose the same batches,
allocate the same KV slots and run the same forwards, whose collectives meet; what a forward
decides (sampled and accepted tokens) is rank 0's on every rank (broadcast_from_first), so no
replica drifts. This is SGLang's layout too: its rank 0 broadcasts the requests it receives.

A failure inside a forward is fatal under tensor parallelism (the process exits 1): a rank
that raised mid-forward has left the others waiting in a collective, and the schedulers could
no longer be kept equal. The server sees the engine die and answers 503, then exits non-zero.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import sys
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.multiprocessing as tmp

from eagleserve.config import ServerArgs
from eagleserve.device import pick_device
from eagleserve.messages import GenerateReqInput, TokenOutput
from eagleserve.model.loader import resolve_model_path
from eagleserve.model.parallel import (
    all_gather_object,
    broadcast_object,
    check_backend,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from eagleserve.scheduler.faults import install_fault_injection
from eagleserve.scheduler.scheduler import Scheduler

logger = logging.getLogger("eagleserve.tp")
FOLLOWER_JOIN_S = 10.0


def rank_args(args: ServerArgs, rank: int) -> ServerArgs:
    """The rank's own args: on GPUs rank r runs on the r-th device after --device's."""
    device = pick_device(args.device)
    if device.type == "cpu":
        return args
    first = device.index or 0
    count = torch.accelerator.device_count()
    if first + args.tp_size > count:
        last = first + args.tp_size - 1
        raise RuntimeError(
            f"--tp-size {args.tp_size} from {device} needs devices {first}..{last}; "
            f"there are {count}"
        )
    return dataclasses.replace(args, device=f"{device.type}:{first + rank}")


def rendezvous_port() -> int:
    """A free loopback port for the ranks' TCP store."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    except OSError as exc:
        raise RuntimeError(
            f"no free port on 127.0.0.1 for the --tp-size rendezvous: {exc}"
        ) from None


def spawn_followers(args: ServerArgs, port: int) -> list[BaseProcess]:
    """Ranks 1..tp_size-1, started now; they join rank 0 at `port`."""
    ctx = tmp.get_context("spawn")
    procs = []
    for rank in range(1, args.tp_size):
        proc = ctx.Process(
            target=follower_main, args=(args, rank, port), name=f"eagleserve-tp{rank}", daemon=True
        )
        proc.start()
        logger.info("tensor-parallel rank %d: pid %d", rank, proc.pid)
        procs.append(proc)
    return procs


def _threads_per_rank(args: ServerArgs) -> None:
    """On a CPU the ranks share the cores: each gets its part unless OMP_NUM_THREADS says."""
    if "OMP_NUM_THREADS" not in os.environ and pick_device(args.device).type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tp_size))


def join(args: ServerArgs, rank: int, port: int) -> Scheduler:
    """Joins the group and builds this rank's scheduler; raises on any rank's failure (rank 0
    with that rank's message), after every rank has tried, so none is left waiting."""
    own = rank_args(args, rank)
    if rank == 0:  # before the rendezvous, so followers find a converted default model
        check_backend(pick_device(own.device))
        resolve_model_path(args.model)
    _threads_per_rank(args)
    init_tensor_parallel(rank, args.tp_size, port, pick_device(own.device))
    scheduler: Scheduler | None = None
    error: BaseException | None = None
    try:
        scheduler = Scheduler(own)
        make_forward_fatal(scheduler)
        # Every rank, so an injected fault skips the forward on all of them (tests only).
        install_fault_injection(scheduler)
    except Exception as exc:  # reported below, by every rank
        error = exc
    errors = all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        r, e = failed[0]
        raise RuntimeError(f"tensor-parallel rank {r} failed to start: {e}")
    assert scheduler is not None
    return scheduler


def make_forward_fatal(scheduler: Scheduler) -> None:
    """Any exception out of a forward exits the process (see the module docstring)."""
    worker = scheduler.worker
    forward = worker.forward_batch_generation

    def fatal_on_error(*a: Any, **kw: Any) -> Any:
        try:
            return forward(*a, **kw)
        except BaseException:
            logger.critical("a forward failed under tensor parallelism: exiting", exc_info=True)
            logging.shutdown()
            os._exit(1)

    worker.forward_batch_generation = fatal_on_error  # type: ignore[method-assign]


class ReplicatedScheduler:
    """Rank 0's scheduler: each state change goes to the followers first (module docstring).
    Reads (has_work, stats, waiting, ...) are rank 0's own."""

    def __init__(self, scheduler: Scheduler, followers: list[BaseProcess]) -> None:
        self.scheduler = scheduler
        self.followers = followers  # the ones this process started (offline Engine)
        self.calls: list[tuple[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)

    def add_request(self, msg: GenerateReqInput) -> None:
        self.calls.append(("add_request", msg))
        self.scheduler.add_request(msg)

    def abort_request(self, rid: str) -> None:
        self.calls.append(("abort_request", rid))
        self.scheduler.abort_request(rid)

    def step(self) -> list[TokenOutput]:
        self._publish("step")
        return self.scheduler.step()

    def _publish(self, last: str) -> None:
        calls, self.calls = [*self.calls, (last, None)], []
        broadcast_object(calls)

    def close(self) -> None:
        """Stops the followers (they leave their loop) and leaves the group."""
        self._publish("exit")
        for proc in self.followers:
            proc.join(FOLLOWER_JOIN_S)
            if proc.is_alive():
                proc.kill()
        destroy_tensor_parallel()


def start_rank0(args: ServerArgs, port: int, followers: list[BaseProcess]) -> ReplicatedScheduler:
    return ReplicatedScheduler(join(args, 0, port), followers)


def build_scheduler(args: ServerArgs) -> Scheduler | ReplicatedScheduler:
    """The scheduler of an in-process engine: with --tp-size > 1, rank 0 of a group whose
    followers this starts (and stops on failure)."""
    if args.tp_size == 1:
        return Scheduler(args)
    port = rendezvous_port()
    followers = spawn_followers(args, port)
    try:
        return start_rank0(args, port, followers)
    except BaseException:
        for proc in followers:
            proc.kill()
        destroy_tensor_parallel()
        raise


def follower_main(args: ServerArgs, rank: int, port: int) -> None:
    """A follower rank: build, then replay rank 0's scheduler calls until told to exit. Signals
    are ignored as by the engine process: rank 0 (or its parent) ends this rank."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s",
    )
    try:
        scheduler = join(args, rank, port)
    except Exception as exc:  # rank 0 reports it (join's all-gather)
        logger.debug("tensor-parallel rank %d failed to start: %s", rank, exc)
        sys.exit(1)
    while True:
        try:
            calls = broadcast_object(None)
        except Exception as exc:  # rank 0 is gone
            logger.error("tensor-parallel rank %d: lost rank 0 (%s): exiting", rank, exc)
            sys.exit(1)
        for name, arg in calls:
            if name == "exit":
                destroy_tensor_parallel()
                return
            if name == "step":
                scheduler.step()
            else:
                getattr(scheduler, name)(arg)

"""Tensor parallelism of one engine: a scheduler per rank, kept identical by replaying rank 0's.

Rank 0 is the engine (the engine process of `eagleserve serve`, or the caller of the offline
`Engine`); ranks 1..N-1 are followers, started with torch.multiprocessing and joined over
torch.distributed (distributed/parallel.py). Every rank builds the same Scheduler over its shard of
the target (models/tp_shard.py). Rank 0 alone receives requests; every scheduler call that
changes state (add_request, abort_request, step) is broadcast, in rank 0's order, before rank 0
makes it, and each follower makes the same calls. The schedulers then choose the same batches,
allocate the same KV slots and run the same forwards, whose collectives meet; what a forward
decides (sampled and accepted tokens) is rank 0's on every rank (broadcast_from_first), so no
replica drifts; what a rank computes before that (a sampled chain's drafts) agrees because every
input does, the seeds of requests that name none included (`join`). This is SGLang's layout
too: its rank 0 broadcasts the requests it receives.

A failure inside a forward is fatal under tensor parallelism (the process exits 1): a rank
that raised mid-forward has left the others waiting in a collective, and the schedulers could
no longer be kept equal. The server sees the engine die and answers 503, then exits non-zero.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from eagleserve.config import ServerArgs
from eagleserve.device import pick_device
from eagleserve.distributed.parallel import (
    GROUP_TIMEOUT,
    all_gather_object,
    broadcast_object,
    check_backend,
    destroy_tensor_parallel,
    get_tp,
    init_tensor_parallel,
)
from eagleserve.messages import GenerateReqInput, TokenOutput
from eagleserve.models.loader import resolve_model_path
from eagleserve.sampling.seeded_noise import entropy_seed
from eagleserve.scheduler.faults import install_fault_injection
from eagleserve.scheduler.scheduler import Scheduler

logger = logging.getLogger("eagleserve.tp")
FOLLOWER_JOIN_S = 10.0
JOIN_POLL_S = 0.05
# Why a rank most likely died before it joined: it re-ran the caller's script (a follower is a
# spawned process, which imports the main module again before it runs anything).
GUARD_HINT = (
    "With --tp-size > 1 each other rank is a spawned process that imports the main module "
    'again: a script must build the Engine under `if __name__ == "__main__":` (see that '
    "rank's traceback above)"
)


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


def open_store(args: ServerArgs, rank: int, port: int) -> dist.TCPStore:
    """The ranks' rendezvous store: rank 0 serves it on 127.0.0.1:`port` (0: any free port,
    `.port` says which), the others connect to it. Its own timeout is the group's: the start-up
    deadline is `wait_for_ranks`'s, and a follower waits for rank 0 as long as rank 0 lives
    (it may be converting the model first)."""
    try:
        return dist.TCPStore("127.0.0.1", port, args.tp_size, is_master=rank == 0,
                             timeout=GROUP_TIMEOUT, wait_for_workers=False)  # fmt: skip
    except (RuntimeError, OSError) as exc:
        raise RuntimeError(
            f"tensor-parallel rank {rank}: no rendezvous on 127.0.0.1:{port}: {exc}"
        ) from None


def _joined_key(rank: int) -> str:
    return f"eagleserve/joined/{rank}"


def wait_for_ranks(
    store: dist.TCPStore, size: int, followers: Sequence[BaseProcess], timeout_s: float
) -> None:
    """Rank 0: returns once ranks 1..size-1 have joined the store. Raises at once when one of
    `followers` (those this process started) exits first, and after `timeout_s` when any is
    still missing: the group's own rendezvous would wait for them for days."""
    deadline = time.monotonic() + timeout_s
    missing = list(range(1, size))
    while True:
        missing = [r for r in missing if not store.check([_joined_key(r)])]
        if not missing:
            return
        for rank, proc in enumerate(followers, start=1):
            if rank in missing and proc.exitcode is not None:
                raise RuntimeError(
                    f"tensor-parallel rank {rank} exited (exit code {proc.exitcode}) before it "
                    f"joined rank 0. {GUARD_HINT}"
                )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"tensor-parallel ranks {missing} did not join rank 0 within {timeout_s:g} s "
                f"(--dist-timeout). {GUARD_HINT}"
            )
        time.sleep(JOIN_POLL_S)


def _threads_per_rank(args: ServerArgs) -> None:
    """On a CPU the ranks share the cores: each gets its part unless OMP_NUM_THREADS says."""
    if "OMP_NUM_THREADS" not in os.environ and pick_device(args.device).type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tp_size))


def join(
    args: ServerArgs,
    rank: int,
    port: int,
    followers: Sequence[BaseProcess] = (),
    store: dist.TCPStore | None = None,
) -> Scheduler:
    """Joins the group and builds this rank's scheduler; raises on any rank's failure (rank 0
    with that rank's message), after every rank has tried, so none is left waiting. Rank 0
    serves the rendezvous (or is handed `store`, already serving) and fails fast when a rank
    does not join (`wait_for_ranks`)."""
    own = rank_args(args, rank)
    store = store or open_store(args, rank, port)
    if rank == 0:  # before the group forms, so followers find a converted default model
        check_backend(pick_device(own.device))
        resolve_model_path(args.model)
        wait_for_ranks(store, args.tp_size, followers, args.dist_timeout)
    else:
        store.set(_joined_key(rank), str(os.getpid()))
    _threads_per_rank(args)
    init_tensor_parallel(rank, args.tp_size, port, pick_device(own.device), store=store)
    # Sampled requests that name no seed get theirs from one generator, seeded alike on every
    # rank: each rank draws a sampled chain's drafts on the request's noise itself, and a
    # verify whose ranks drafted different tokens mixes their shards' inputs.
    seed = own.random_seed if own.random_seed is not None else entropy_seed()
    own = dataclasses.replace(own, random_seed=broadcast_object(seed))
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
        self.closed = False
        # A script that never closes its Engine would hang at exit: multiprocessing joins the
        # followers, which ignore SIGTERM and wait for rank 0's next call. This is that call.
        atexit.register(self.close)

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

    def flush_cache(self) -> int | None:
        self.calls.append(("flush_cache", None))  # every rank's state, so answer, is the same
        return self.scheduler.flush_cache()

    def _publish(self, last: str) -> None:
        calls, self.calls = [*self.calls, (last, None)], []
        broadcast_object(calls)

    def close(self) -> None:
        """Stops the followers (they leave their loop) and leaves the group, once: afterwards
        this process may form a new group (another engine)."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        try:
            self._publish("exit")
        finally:
            stop_followers(self.followers, FOLLOWER_JOIN_S)
            destroy_tensor_parallel()


def stop_followers(followers: Sequence[BaseProcess], wait_s: float) -> None:
    """Waits up to `wait_s` for each follower to exit, then kills it; each is reaped."""
    for proc in followers:
        proc.join(wait_s)
        if proc.is_alive():
            proc.kill()
            proc.join()


def start_rank0(args: ServerArgs, port: int, followers: list[BaseProcess]) -> ReplicatedScheduler:
    return ReplicatedScheduler(join(args, 0, port, followers), followers)


def build_scheduler(args: ServerArgs) -> Scheduler | ReplicatedScheduler:
    """The scheduler of an in-process engine: with --tp-size > 1, rank 0 of a group whose
    followers this starts (and stops on failure). One group per process (distributed/parallel.py):
    while a tensor-parallel engine is open, no other engine can be built here."""
    if get_tp().enabled or dist.is_initialized():
        raise RuntimeError(
            "a tensor-parallel Engine is open in this process: close() it before building "
            "another (one tensor-parallel group per process)"
        )
    if args.tp_size == 1:
        return Scheduler(args)
    # The store first, on a port it picks itself: no other process can take it in between.
    store = open_store(args, 0, 0)
    followers = spawn_followers(args, store.port)
    try:
        return ReplicatedScheduler(join(args, 0, store.port, followers, store), followers)
    except BaseException:
        stop_followers(followers, 0)
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
    # A follower replays rank 0's scheduler: rank 0's log already says what it does (a
    # retraction, say); a follower's scheduler package speaks only of what goes wrong.
    sched_logger = logging.getLogger(Scheduler.__module__.rpartition(".")[0])
    sched_logger.setLevel(max(sched_logger.getEffectiveLevel(), logging.WARNING))
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

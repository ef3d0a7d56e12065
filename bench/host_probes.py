"""The probes of bench/host_overhead.py: exclusive host time per stage of a running engine's
methods (StageClock, instrument) and per-iteration counts of dispatched ops, target and head
forwards and host reads (OpCounter). Nothing in the engine is changed; its methods are wrapped."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

from eagleserve import Engine, SamplingParams

STAGES = ("schedule", "batch prep", "forward", "draft", "sampling", "output", "detokenize", "other")
COUNTS = ("ops", "target fwd", "head fwd", "host reads")


class StageClock:
    """Exclusive wall time per stage of wrapped callables (one thread: a stack of open calls).
    `mark()` starts an iteration; `iteration()` closes it into a {stage: seconds} row."""

    def __init__(self) -> None:
        self.stack: list[list[float]] = []  # per open call: [start, time spent in callees]
        self.now: dict[str, float] = defaultdict(float)
        self.mode: str | None = None
        self.wrapped: list[tuple[Any, str, Any]] = []

    def restore(self) -> None:
        """Puts the wrapped callables back (module functions outlive the engine)."""
        for obj, name, real in reversed(self.wrapped):
            setattr(obj, name, real)
        self.wrapped = []

    def wrap(self, obj: Any, name: str, stage: str) -> None:
        real = getattr(obj, name)
        self.wrapped.append((obj, name, real))

        def timed(*args: Any, **kwargs: Any) -> Any:
            frame = [time.perf_counter(), 0.0]
            self.stack.append(frame)
            try:
                return real(*args, **kwargs)
            finally:
                self.stack.pop()
                spent = time.perf_counter() - frame[0]
                self.now[stage] += spent - frame[1]
                if self.stack:
                    self.stack[-1][1] += spent

        setattr(obj, name, timed)

    def add(self, stage: str, seconds: float) -> None:
        self.now[stage] += seconds

    def take(self) -> dict[str, float]:
        row, self.now = dict(self.now), defaultdict(float)
        return row


def instrument(engine: Engine, clock: StageClock) -> None:
    """Wraps the engine's stage methods (instance attributes shadow the class's)."""
    import eagleserve.scheduler.target_worker as tw
    import eagleserve.spec.eagle_worker as ew

    s = engine.scheduler
    w = s.worker
    orig_next = s.get_next_batch_to_run

    def next_batch() -> Any:
        batch = orig_next()
        clock.mode = None if batch is None else batch.mode
        return batch

    s.get_next_batch_to_run = next_batch  # type: ignore[method-assign]
    clock.wrap(s, "get_next_batch_to_run", "schedule")
    clock.wrap(w, "prepare_for_decode", "batch prep")
    clock.wrap(s, "run_batch", "batch prep")
    clock.wrap(w, "forward_batch_generation", "forward")
    clock.wrap(w.runner, "forward", "forward")
    clock.wrap(s, "process_batch_result", "output")
    clock.wrap(tw, "sample_next", "sampling")
    if hasattr(w, "drafter"):
        clock.wrap(w.drafter, "draft", "draft")
        clock.wrap(w.drafter, "extend", "draft")
        clock.wrap(ew, "sample_next", "sampling")
        clock.wrap(ew, "accept", "sampling")


class OpCounter:
    """Per decode iteration: tensor ops dispatched outside the target forward, target and head
    forwards, and host reads of device values (one thread: the overlap scheduler is off)."""

    def __init__(self, engine: Engine) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.now: dict[str, int] = defaultdict(int)
        self.inside = False
        reads = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
                 torch.ops.aten.masked_select.default}  # fmt: skip
        indexing = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:  # fmt: skip
                if not counter.inside:
                    counter.now["ops"] += 1
                    if func in reads or (func in indexing and any(
                        t is not None and t.dtype == torch.bool for t in args[1]
                    )):  # fmt: skip
                        counter.now["host reads"] += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode
        self.restore: list[tuple[Any, str, Any]] = []
        w = engine.scheduler.worker
        self._wrap(w.runner, "forward", "target fwd", exclusive=True)
        if hasattr(w, "drafter"):
            self._wrap(w.drafter.head, "forward", "head fwd")
            self._wrap(w.drafter.head, "write_kv", "head fwd")

    def _wrap(self, obj: Any, name: str, key: str, exclusive: bool = False) -> None:
        real = getattr(obj, name)
        self.restore.append((obj, name, real))

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.now[key] += 1
            if not exclusive:
                return real(*args, **kwargs)
            self.inside = True
            try:
                return real(*args, **kwargs)
            finally:
                self.inside = False

        setattr(obj, name, counted)

    def close(self) -> None:
        for obj, name, real in reversed(self.restore):
            setattr(obj, name, real)

    def run(self, engine: Engine, batch: int, new: int, vocab: int) -> dict[str, float]:
        """Medians per decode iteration of one run over `batch` prompts."""
        from eagleserve.messages import GenerateReqInput

        s = engine.scheduler
        params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
        for i, ids in enumerate(prompts(batch, vocab, 24, 5)):
            s.add_request(GenerateReqInput(f"count-{i}", ids, params))
        rows = []
        while s.has_work():
            self.now = defaultdict(int)
            decode = s.running_batch is not None and not s.waiting
            with self.mode():
                s.step()
            if decode:
                rows.append(dict(self.now))
        rows = rows[1:] or rows
        med = lambda k: sorted(r.get(k, 0) for r in rows)[len(rows) // 2]
        return {k: med(k) for k in COUNTS}


def prompts(n: int, vocab: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 1, (length,), generator=g).tolist() for _ in range(n)]


class SyncCensus:
    """Where the host waits for the device: every synchronizing call of the open decode
    iterations (on CUDA, torch's sync debug mode warns at each: an `.item()`, a `.tolist()`, a
    blocking copy, a value-dependent shape), attributed to the innermost eagleserve frame, per
    iteration. A sync inside the overlap scheduler's result read is the one by design; any
    other on the hot path stalls the device's queue."""

    MARK = "synchroniz"  # torch: "called a synchronizing CUDA operation"

    def __init__(self) -> None:
        self.sites: dict[str, int] = defaultdict(int)

    def record(self, message: Warning | str) -> None:
        if self.MARK not in str(message):
            return
        import traceback

        frames = [f for f in traceback.extract_stack() if "/eagleserve/" in f.filename]
        where = frames[-1] if frames else None
        self.sites[f"{where.filename.split('/eagleserve/')[-1]}:{where.lineno} {where.name}"
                   if where else "outside eagleserve"] += 1  # fmt: skip

    def watch(self) -> Any:
        """A context in which every such warning is recorded (and not printed)."""
        import contextlib
        import warnings

        census = self

        @contextlib.contextmanager
        def ctx() -> Any:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                shown = warnings.showwarning

                def show(message: Warning | str, *rest: Any, **kw: Any) -> None:
                    if census.MARK in str(message):
                        census.record(message)
                    else:
                        shown(message, *rest, **kw)

                warnings.showwarning = show
                yield census

        return ctx()

    def per_iteration(self, iterations: int) -> dict[str, float]:
        return {k: round(v / max(iterations, 1), 2)
                for k, v in sorted(self.sites.items(), key=lambda kv: -kv[1])}  # fmt: skip


def sync_sites(engine: Engine, batch: int, new: int, vocab: int) -> dict[str, float]:
    """Synchronizing calls per decode iteration by site (with the overlap scheduler, its
    forward thread's too), from a generate of `batch` prompts; {} where the device has no sync
    debug mode."""
    dev = engine.scheduler.device
    mod = torch.get_device_module(dev)
    if not hasattr(mod, "set_sync_debug_mode"):
        return {}
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    ps = prompts(batch, vocab, 24, 11)
    engine.generate(ps, params)  # warm
    census = SyncCensus()
    s = engine.scheduler
    run_batch, iterations = s.run_batch, [0]

    def counted(batch: Any, *args: Any) -> Any:
        iterations[0] += batch.mode == "decode"
        return run_batch(batch, *args)

    s.run_batch = counted  # type: ignore[method-assign]
    with census.watch():
        mod.set_sync_debug_mode("warn")
        try:
            engine.generate(ps, params)
        finally:
            mod.set_sync_debug_mode("default")
            s.run_batch = run_batch  # type: ignore[method-assign]
    return census.per_iteration(iterations[0])

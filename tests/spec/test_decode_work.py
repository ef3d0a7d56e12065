"""What a speculative decode iteration makes the host do, counted rather than timed (timings on a
shared CPU say little; counts hold on any machine):

- an adaptive iteration that drafts nothing (k = 0) runs the forwards a target-only decode runs,
  no head forward, and dispatches about as many tensor ops around them (on a GPU each op outside
  the graph-replayed forward is a kernel launch the host pays for);
- a verify iteration (chain or tree), and the head's catch-up and flush of the inputs an
  adaptive engine held at k = 0, read no device value back on the host: no `.item()`-like read
  and no op whose output shape depends on values (boolean-mask indexing, nonzero, a
  repeat_interleave by device counts), each of which is a device sync on a GPU that stalls the
  overlap scheduler.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from device_reads import device_read
from host_reads import HostReadError, head_dir
from torch.utils._python_dispatch import TorchDispatchMode

from eagleserve import Engine, SamplingParams
from eagleserve.messages import GenerateReqInput
from eagleserve.spec.eagle_worker import EagleWorker

__all__ = ["head_dir"]  # the module-scoped EAGLE3 head fixture of host_reads

pytestmark = pytest.mark.usefixtures("torch_threads")

CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=5)
# Ops a k = 0 iteration may dispatch beyond a target-only decode's (outside the forward): its
# result is built the same way; the scheduler's and worker's bookkeeping differ by a few ops
# (the k = 0 decode reads its slots back from req_to_token, where a target-only decode
# allocates one per request; the target-only decode's positions and prefix lengths share one
# tensor, as the k = 0 decode's always did).
K0_EXTRA_OPS = 4


def _prompts(seed: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (int(m),), generator=g).tolist()
            for m in torch.randint(4, 30, (n,), generator=g)]  # fmt: skip


class _Ops(TorchDispatchMode):
    """Counts the ops dispatched while it is active and outside `paused` sections."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.paused = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.paused:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _Forwards:
    """Counts target forwards by mode and head forwards / K/V writes of one engine; `ops`, when
    set, stops counting inside the target forward (on a GPU: one graph replay)."""

    def __init__(self, engine: Engine) -> None:
        self.calls: Counter[str] = Counter()
        self.ops: _Ops | None = None
        worker = engine.scheduler.worker
        runner_forward = worker.runner.forward

        def forward(fb: Any) -> Any:
            self.calls[f"target {fb.mode}"] += 1
            if self.ops is None:
                return runner_forward(fb)
            self.ops.paused = True
            try:
                return runner_forward(fb)
            finally:
                self.ops.paused = False

        worker.runner.forward = forward  # type: ignore[method-assign]
        if isinstance(worker, EagleWorker):
            head = worker.drafter.head
            for name in ("forward", "write_kv"):
                real = getattr(head, name)
                setattr(head, name, self._counted(f"head {name}", real))

    def _counted(self, key: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[key] += 1
            return real(*args, **kwargs)

        return counted


def _hold_at_zero(engine: Engine) -> None:
    controller = engine.scheduler.worker.controller
    assert controller is not None
    controller.choose = lambda alphas, catching_up=False: 0  # type: ignore[method-assign]


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_k0_iteration_runs_a_target_decode_and_nothing_else(
    tiny_model_dir: str, head_dir: str, make_engine: Callable[..., Engine], overlap: bool
) -> None:
    """Adaptive speculation held at k = 0 runs exactly the target forwards target-only runs (the
    same decodes, one per iteration), never the head's layer, writes head K/V only at the
    prefill, and emits target-only's tokens."""
    seed = random.randrange(2**31)
    prompts = _prompts(seed, 3)
    params = SamplingParams(max_new_tokens=int(torch.randint(8, 20, ())), temperature=0.0,
                            ignore_eos=True)  # fmt: skip
    runs = {}
    for name, spec in (("target", {}), ("k0", dict(CHAIN, speculative_adaptive=True))):
        if spec:
            spec = dict(spec, speculative_algorithm="EAGLE3", speculative_draft_model_path=head_dir)
        eng = make_engine(tiny_model_dir, max_running_requests=4,
                          disable_overlap_schedule=not overlap, **spec)  # fmt: skip
        if spec:
            _hold_at_zero(eng)
        forwards = _Forwards(eng)
        out = eng.generate(prompts, [params] * len(prompts))
        runs[name] = ([o["token_ids"] for o in out], forwards.calls)
    (target_tokens, target_calls), (k0_tokens, k0_calls) = runs["target"], runs["k0"]
    assert k0_tokens == target_tokens, f"seed {seed}"
    assert target_calls["target decode"] >= params.max_new_tokens - 1
    assert {k: v for k, v in k0_calls.items() if k.startswith("target")} == dict(target_calls)
    assert k0_calls["head forward"] == 0, k0_calls
    assert k0_calls["head write_kv"] == target_calls["target extend"], k0_calls  # the prompts


def _ops_per_decode(engine: Engine, prompts: list[list[int]], new: int) -> list[int]:
    """Ops dispatched outside the target forward by each decode step of the scheduler (overlap
    off: one thread, one forward per step). A step that also prefills (a prompt's chunk: the
    CPU prefill chunk can split the prompts admitted together) is not a decode step, nor is
    one in which requests finish (their release differs by design)."""
    forwards = _Forwards(engine)
    sched = engine.scheduler
    run_batch, modes = sched.run_batch, []

    def recorded(batch: Any, *args: Any) -> Any:
        modes.append(batch.mode)
        return run_batch(batch, *args)

    sched.run_batch = recorded  # type: ignore[method-assign]
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        sched.add_request(GenerateReqInput(f"r{i}", ids, params))
    counts = []
    running = lambda: len(sched.running_batch.reqs) if sched.running_batch else 0  # noqa: E731
    while sched.has_work():
        modes.clear()
        before = running()
        ops = forwards.ops = _Ops()
        with ops:
            sched.step()
        if modes == ["decode"] and running() == before:  # no request finished either
            counts.append(ops.count)
    return counts


@pytest.mark.parametrize("bs", [1, 3])
def test_k0_iteration_dispatches_about_a_target_decodes_ops(
    tiny_model_dir: str, head_dir: str, make_engine: Callable[..., Engine], bs: int
) -> None:
    """Around the forward, a k = 0 iteration dispatches at most K0_EXTRA_OPS more tensor ops
    than a target-only decode of the same batch, step by step (steps that prefill or finish
    requests aside)."""
    prompts = _prompts(random.randrange(2**31), bs)
    target = make_engine(tiny_model_dir, max_running_requests=4, disable_overlap_schedule=True)
    k0 = make_engine(tiny_model_dir, max_running_requests=4, disable_overlap_schedule=True,
                     speculative_algorithm="EAGLE3", speculative_draft_model_path=head_dir,
                     speculative_adaptive=True, **CHAIN)  # fmt: skip
    _hold_at_zero(k0)
    plain, held = (_ops_per_decode(e, prompts, 10) for e in (target, k0))
    assert len(plain) == len(held) >= 6
    for step, (p, h) in enumerate(zip(plain, held, strict=True)):
        assert h <= p + K0_EXTRA_OPS, (step, plain, held)


class _NoDeviceReads(TorchDispatchMode):
    """Refuses host reads of device values and ops whose output shape depends on values
    (stricter than test_no_host_sync's forward guard: a verify must not select rows by mask)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        read = device_read(func, args, kwargs)
        if read is not None:
            raise HostReadError(read)
        return func(*args, **(kwargs or {}))


def test_the_guard_catches_value_dependent_shapes() -> None:
    x, keep = torch.randn(5), torch.rand(5) > 0.5
    for read in (lambda: x[keep], lambda: keep.nonzero(), lambda: float(x.sum())):
        with pytest.raises(HostReadError), _NoDeviceReads():
            read()
    counts = torch.randint(1, 4, (3,))
    total = int(counts.sum())
    for mode in (torch.no_grad, torch.inference_mode):  # the op's overload differs
        with mode():
            with pytest.raises(HostReadError), _NoDeviceReads():
                torch.arange(3).repeat_interleave(counts)
            with _NoDeviceReads():  # its size given: no read
                torch.arange(3).repeat_interleave(counts, output_size=total)


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_verify_reads_no_device_value(
    tiny_model_dir: str,
    head_dir: str,
    make_engine: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
    spec: dict[str, int],
) -> None:
    """Draft, verify, acceptance, the tree's KV commit and the head extend over the accepted
    path, greedy and sampled rows together, without a host read (the extend in its fixed
    shape, as on an accelerator); greedy tokens still equal target-only's."""
    prompts = _prompts(random.randrange(2**31), 3)
    greedy = SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=14, temperature=0.8, ignore_eos=True)
    params = [greedy, sampled, greedy]
    target = make_engine(tiny_model_dir, max_running_requests=4)
    expect = [o["token_ids"] for o in target.generate(prompts, params)]
    eng = make_engine(tiny_model_dir, max_running_requests=4, speculative_algorithm="EAGLE3",
                      speculative_draft_model_path=head_dir, **spec)  # fmt: skip
    worker = eng.scheduler.worker
    assert isinstance(worker, EagleWorker) and not worker.paths.fixed_shape  # a CPU's choice
    worker.paths.fixed_shape = True
    real = EagleWorker._draft_verify

    def guarded(*args: Any, **kwargs: Any) -> Any:
        with _NoDeviceReads():
            return real(*args, **kwargs)

    monkeypatch.setattr(EagleWorker, "_draft_verify", guarded)
    got = [o["token_ids"] for o in eng.generate(prompts, params)]
    assert eng.stats().spec_verify_calls_total > 0
    assert [got[0], got[2]] == [expect[0], expect[2]]
    assert len(got[1]) == 14


def test_adaptive_catch_up_and_flush_read_no_device_value(
    tiny_model_dir: str,
    head_dir: str,
    make_engine: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An adaptive engine whose controller holds k = 0 for stretches longer than its ring of
    held head inputs (the probe interval), so that requests fill the ring (a flush), then
    drafts (a catch-up of every held input): both build their head extend from host counts
    without reading the device, and greedy tokens equal target-only's."""
    from eagleserve.spec.draft_worker import EagleDraftWorker

    prompts = _prompts(random.randrange(2**31), 3)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    target = make_engine(tiny_model_dir, max_running_requests=4)
    expect = [o["token_ids"] for o in target.generate(prompts, params)]
    ring = random.randint(2, 4)
    eng = make_engine(tiny_model_dir, max_running_requests=4, speculative_algorithm="EAGLE3",
                      speculative_draft_model_path=head_dir, speculative_adaptive=True,
                      speculative_adaptive_probe_interval=ring, **CHAIN)  # fmt: skip
    worker = eng.scheduler.worker
    assert isinstance(worker, EagleWorker) and worker.controller is not None
    plan = itertools.cycle([0] * random.randint(ring + 1, 2 * ring + 1) + [random.randint(1, 3)])
    monkeypatch.setattr(worker.controller, "choose", lambda *args, **kwargs: next(plan))
    calls: Counter[str] = Counter()
    for name in ("flush", "catch_up"):
        real = getattr(EagleDraftWorker, name)

        def guarded(*args: Any, real: Any = real, name: str = name, **kwargs: Any) -> Any:
            calls[name] += 1
            with _NoDeviceReads():
                return real(*args, **kwargs)

        monkeypatch.setattr(EagleDraftWorker, name, guarded)
    got = [o["token_ids"] for o in eng.generate(prompts, params)]
    assert got == expect
    assert calls["flush"] > 0 and calls["catch_up"] > 0, calls

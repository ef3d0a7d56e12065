"""Device graphs on a CPU, for tests: the engine's accelerator path (graph replays of decode,
verify, draft steps, the draft loop and the seed extend; fixed-shape extends) run end to end
under the Triton interpreter.

A stand-in capture runs the graph's function once per bucket on the static batch; a replay runs
it again there, under the no-host-read guard (a host read inside a captured function fails its
capture on a GPU), and copies the results into the captured outputs. Static inputs in, static
outputs out: what a replay computes. Ops inside replays are counted apart, as a GPU would launch
them from the graph instead of from the host.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from host_reads import no_host_reads

from eagleserve.config import ServerArgs
from eagleserve.layers.forward_batch import ForwardBatch
from eagleserve.model_executor.cuda_graph_runner import GraphedForward
from eagleserve.model_executor.model_runner import ModelRunner

# True while a stand-in replay copies its results into the captured outputs.
STAND_IN_COPIES = [False]


class ReplayCount:
    """Replays per GraphedForward, and whether a replay is running."""

    def __init__(self) -> None:
        self.by_graph: dict[int, int] = {}
        self.inside = False

    def of(self, graph: GraphedForward) -> int:
        return self.by_graph.get(id(graph), 0)


class StandInGraph:
    def __init__(
        self,
        graph: GraphedForward,
        bs: int,
        fb: ForwardBatch,
        extras: dict[str, torch.Tensor],
        count: ReplayCount,
    ) -> None:
        self.graph, self.bs, self.fb, self.extras, self.count = graph, bs, fb, extras, count

    def replay(self) -> None:
        self.count.by_graph[id(self.graph)] = self.count.of(self.graph) + 1
        self.count.inside = True
        try:  # under inference mode, as the capture ran (its outputs are inference tensors)
            with torch.inference_mode(), no_host_reads():
                fresh = self.graph.run_fn(self.fb, self.extras)
                # A graph's kernels write its outputs in place: these copies launch nothing
                # on a GPU, and LaunchCensus does not count them.
                STAND_IN_COPIES[0] = True
                try:
                    for out, new in zip(self.graph.outputs[self.bs], fresh, strict=True):
                        out.copy_(new)
                finally:
                    STAND_IN_COPIES[0] = False
        finally:
            self.count.inside = False


@contextlib.contextmanager
def graphs_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[ReplayCount]:
    """While open, engines built on a CPU with the Triton backend capture stand-in graphs."""
    count = ReplayCount()

    @torch.inference_mode()
    def capture(self: GraphedForward) -> None:
        for bs in reversed(self.buckets):
            fb, extras = self.bucket_batch(bs)
            with no_host_reads():
                out = self.run_fn(fb, extras)
            self.batches[bs], self.outputs[bs] = fb, tuple(o.clone() for o in out)
            self.graphs[bs] = StandInGraph(self, bs, fb, extras, count)

    def enabled(self: ModelRunner, args: ServerArgs) -> bool:
        return not args.disable_cuda_graph and hasattr(
            self.attn_backend, "init_forward_metadata_static"
        )

    monkeypatch.setattr(GraphedForward, "capture", capture)
    monkeypatch.setattr(ModelRunner, "graphs_enabled", enabled)
    yield count


def outside_replays(count: ReplayCount) -> tuple[type, dict[str, int]]:
    """A dispatch mode class counting ops dispatched outside stand-in replays, and its tally."""
    from torch.utils._python_dispatch import TorchDispatchMode

    tally = {"ops": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:  # fmt: skip
            if not count.inside:
                tally["ops"] += 1
            return func(*args, **(kwargs or {}))

    return Count, tally


# Torch ops that launch no kernel: views, allocations, host reads.
NOT_KERNELS = {"view", "_unsafe_view", "reshape", "slice", "select", "expand", "unsqueeze",
               "squeeze", "t", "transpose", "permute", "as_strided", "alias", "detach", "empty",
               "empty_like", "new_empty", "empty_strided", "lift_fresh", "split", "chunk",
               "unbind", "split_with_sizes", "_reshape_alias", "item", "_local_scalar_dense",
               "resolve_conj", "resolve_neg", "flatten"}  # fmt: skip


class LaunchCensus:
    """Kernel launches by where they ran: the host, or the graph (by `names`, keyed by the
    GraphedForward's id) whose stand-in replay ran them. A launch is a Triton kernel or a torch
    op that computes; not counted: the interpreter's own copies inside a Triton launch, a
    stand-in replay's copies into its outputs, a `to` that returns its input."""

    def __init__(self) -> None:
        self.where = "host"
        self.active = True
        self.in_triton = False
        self.names: dict[int, str] = {}
        self.tally: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )

    def add(self, op: str) -> None:
        if self.active and not STAND_IN_COPIES[0]:
            self.tally[self.where][op] += 1

    @contextlib.contextmanager
    def counting(self) -> Iterator[LaunchCensus]:
        import triton.runtime.interpreter as interp
        from torch.utils._python_dispatch import TorchDispatchMode

        census = self
        real_launch, real_replay = interp.GridExecutor.__call__, StandInGraph.replay

        def launch(grid: Any, *args: Any, **kwargs: Any) -> Any:
            census.add("triton " + grid.fn.__name__)
            census.in_triton = True
            try:
                return real_launch(grid, *args, **kwargs)
            finally:
                census.in_triton = False

        def replay(graph: StandInGraph) -> None:
            outer = census.where
            census.where = census.names.get(id(graph.graph), "other graph")
            try:
                real_replay(graph)
            finally:
                census.where = outer

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:  # fmt: skip
                name = func.overloadpacket.__name__
                out = func(*args, **(kwargs or {}))
                # `to` a tensor's own dtype and device returns it: no copy, no kernel.
                no_op = name == "to" and args and out is args[0]
                if not census.in_triton and name not in NOT_KERNELS and not no_op:
                    census.add(name)
                return out

        interp.GridExecutor.__call__ = launch
        StandInGraph.replay = replay  # type: ignore[method-assign]
        try:
            with Ops():
                yield self
        finally:
            interp.GridExecutor.__call__ = real_launch
            StandInGraph.replay = real_replay  # type: ignore[method-assign]

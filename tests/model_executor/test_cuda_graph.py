"""The device-graph runner's host-independent logic, on any device: which captured batch size
serves a batch, and how a batch's inputs land in the static buffers a graph reads (the graphs
themselves are captured and replayed only on an accelerator: tests/spec/test_gpu_paths.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import random
from collections.abc import Iterator

import pytest
import torch

from eagleserve.layers.attention import create_attn_backend
from eagleserve.layers.forward_batch import ForwardBatch, HostLens
from eagleserve.mem_cache.kv_cache import ReqToTokenPool, TokenToKVPool
from eagleserve.model_executor.cuda_graph_runner import BUCKETS, GraphedForward, bucket_for


@pytest.mark.parametrize("max_bs", [1, 20, 32, 100])
def test_bucket_is_the_smallest_captured_size_that_holds_the_batch(max_bs: int) -> None:
    buckets = [b for b in BUCKETS if b < max_bs] + [max_bs]
    for bs in range(1, max_bs + 1):
        pb = bucket_for(buckets, bs)
        assert pb in buckets and pb >= bs
        assert all(b < bs for b in buckets if b < pb)
    for bad in (0, max_bs + 1):
        with pytest.raises(ValueError):
            bucket_for(buckets, bad)


def _graph(n: int, max_bs: int, hidden: int) -> GraphedForward:
    dev = torch.device("cpu")
    r2t = ReqToTokenPool(max_bs + 1, 64, dev)
    kv = TokenToKVPool(256, 1, 2, 8, torch.float32, dev)
    backend = create_attn_backend("torch", dev, r2t.req_to_token, 8**-0.5)
    extras = {"features": ((hidden,), torch.float32)}
    return GraphedForward(
        lambda fb, ex: (), "verify", kv, backend, dev, max_bs, n, extra_shapes=extras
    )


@pytest.mark.parametrize(("bs", "n"), [(5, 3), (1, 1), (13, 4), (20, 2)])
def test_stage_copies_the_batch_and_pads_to_its_bucket(bs: int, n: int) -> None:
    g = torch.Generator().manual_seed(bs * 10 + n)
    graph = _graph(n, 20, 6)
    # A larger batch staged before leaves its rows behind: the padding must overwrite them.
    for buf in (graph.input_ids, graph.positions, graph.out_cache_loc, graph.req_pool_indices,
                graph.prefix_lens):  # fmt: skip
        buf.copy_(torch.randint(1, 50, buf.shape, generator=g))
    t = bs * n
    rand = lambda *shape: torch.randint(1, 50, shape, generator=g)
    prefix = rand(bs)
    fb = ForwardBatch(
        mode="verify",
        input_ids=rand(t),
        positions=rand(t),
        out_cache_loc=rand(t),
        req_pool_indices=rand(bs),
        prefix_lens=prefix,
        extend_lens=torch.full((bs,), n),
        host=HostLens.per_request(n, 50, bs),
        kv_pool=graph.kv_pool,
        attn_backend=graph.attn_backend,
    )
    feats = torch.randn(t, 6, generator=g)
    pb = graph.stage(fb, features=feats)
    assert pb == bucket_for(graph.buckets, bs)
    pt = pb * n
    for buf, src in ((graph.input_ids, fb.input_ids), (graph.positions, fb.positions),
                     (graph.out_cache_loc, fb.out_cache_loc)):  # fmt: skip
        assert torch.equal(buf[:t], src)
        assert not buf[t:pt].any()  # padded tokens write KV slot 0 only
    assert torch.equal(graph.req_pool_indices[:bs], fb.req_pool_indices)
    assert not graph.req_pool_indices[bs:pb].any()  # request slot 0, never handed out
    assert torch.equal(graph.prefix_lens[:bs], prefix)
    assert not graph.prefix_lens[bs:pb].any()
    # The KV lengths the static metadata reads are computed inside the graph, before `fn`.
    static = dataclasses.replace(
        fb, prefix_lens=graph.prefix_lens[:pb], kv_lens=graph.kv_lens[:pb]
    )  # fmt: skip
    graph.fn, graph.own_context = lambda fb, ex: (fb.kv_lens.clone(),), False
    (kv_lens,) = graph.run_fn(static, {})
    assert torch.equal(kv_lens, graph.prefix_lens[:pb] + n)
    assert torch.equal(graph.extras["features"][:t], feats)


@pytest.mark.parametrize("running", [1, 24, 64, 300])
def test_graphs_cover_the_running_batch_by_default(running: int) -> None:
    """Batches above the largest graph run eagerly: by default every batch that can run has a
    graph (up to the cap); an explicit --cuda-graph-max-bs wins, never above the running max."""
    from eagleserve.config import GRAPH_MAX_BS, ServerArgs

    assert ServerArgs(max_running_requests=running).graph_max_bs() == min(running, GRAPH_MAX_BS)
    explicit = ServerArgs(max_running_requests=running, cuda_graph_max_bs=16)
    assert explicit.graph_max_bs() == min(16, running)


class _CaptureAPI:
    """The slice of torch.cuda that GraphedForward.capture calls, recording whether a capture
    is open: the device's rules (nothing may free a graph while a stream captures) on a CPU."""

    def __init__(self) -> None:
        self.capturing = False
        self.captures = 0

    class _Stream:
        def wait_stream(self, other: object) -> None:
            pass

    def graph_pool_handle(self) -> None:
        return None

    def Stream(self) -> _Stream:  # noqa: N802 (torch.cuda's name)
        return self._Stream()

    def current_stream(self) -> _Stream:
        return self._Stream()

    def stream(self, s: object) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def CUDAGraph(self) -> object:  # noqa: N802
        return object()

    @contextlib.contextmanager
    def graph(self, g: object, pool: object = None) -> Iterator[None]:
        self.capturing, self.captures = True, self.captures + 1
        try:
            yield
        finally:
            self.capturing = False


class _DroppedEngineGraph:
    """An earlier engine's graph, reachable only through a reference cycle (as a dropped
    engine's are): freed when the garbage collector runs."""

    def __init__(self, api: _CaptureAPI, freed: list[bool]) -> None:
        self.api, self.freed, self.cycle = api, freed, self

    def __del__(self) -> None:
        self.freed.append(self.api.capturing)


def test_no_garbage_collection_runs_inside_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen on an H200: the fourth engine built in one process failed its capture when the
    collector freed an earlier engine's graphs inside it. Dead graphs are freed before the
    captures, and nothing is collected during one, however often the collector would run."""
    from eagleserve.model_executor import cuda_graph_runner

    api = _CaptureAPI()
    monkeypatch.setattr(cuda_graph_runner, "device_module", lambda dev: api)
    graph = _graph(2, 12, 4)
    monkeypatch.setattr(graph.attn_backend, "init_forward_metadata_static", lambda fb: None,
                        raising=False)  # fmt: skip
    freed: list[bool] = []
    runs_while_capturing: list[bool] = []
    rng = random.Random()

    def fn(fb: ForwardBatch, extras: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        for _ in range(rng.randint(50, 200)):  # cyclic garbage: the collector's trigger
            _DroppedEngineGraph(api, [])
        return (fb.input_ids * 2,)

    graph.fn = fn
    for _ in range(rng.randint(1, 4)):
        _DroppedEngineGraph(api, freed)

    def on_collect(phase: str, info: dict) -> None:
        if phase == "start":
            runs_while_capturing.append(api.capturing)

    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)  # a collection at nearly every allocation
    gc.callbacks.append(on_collect)
    try:
        graph.capture()
    finally:
        gc.callbacks.remove(on_collect)
        gc.set_threshold(*threshold)
    assert api.captures == len(graph.buckets) == len(graph.graphs)
    assert freed and not any(freed), "the dropped graphs were freed inside a capture"
    assert runs_while_capturing and not any(runs_while_capturing)
    assert gc.isenabled()

"""model_executor/prefill_graphs.py, its host-side logic on any device: which prefills replay a
graph (one request, causal, last-token logits, a bucket that holds its tokens and a
req_to_token row wide enough for the padding), and how a prompt is padded into its bucket. The
replayed output equals the eager forward's end to end in tests/spec/test_accelerator_path_cpu.py
(stand-in graphs) and tests/spec/test_gpu_paths.py (a GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from eagleserve.layers.attention import create_attn_backend
from eagleserve.layers.forward_batch import ForwardBatch, HostLens
from eagleserve.mem_cache.kv_cache import ReqToTokenPool, TokenToKVPool
from eagleserve.model_executor.prefill_graphs import PREFILL_BUCKETS, PrefillGraphs

WIDTH = 150  # req_to_token row: buckets 16..128 fit, 256 does not


def _graphs() -> PrefillGraphs:
    dev = torch.device("cpu")
    r2t = ReqToTokenPool(4, WIDTH, dev)
    kv = TokenToKVPool(512, 1, 2, 8, torch.float32, dev)
    backend = create_attn_backend("torch", dev, r2t.req_to_token, 8**-0.5)
    return PrefillGraphs(lambda fb, ex: (), kv, backend, dev)


def _prefill(graphs: PrefillGraphs, prefix: list[int], new: list[int]) -> ForwardBatch:
    """What ForwardBatch.init_new builds for a prefill batch of these requests."""
    g = torch.Generator().manual_seed(sum(prefix) * 1000 + sum(new))
    ext, pre = torch.tensor(new), torch.tensor(prefix)
    t = int(ext.sum())
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, new)])
    one = next(iter(graphs.graphs.values()))
    return ForwardBatch(
        mode="extend",
        input_ids=torch.randint(1, 99, (t,), generator=g),
        positions=positions,
        out_cache_loc=torch.randint(1, 500, (t,), generator=g),
        req_pool_indices=torch.randint(1, 4, (len(new),), generator=g),
        prefix_lens=pre,
        extend_lens=ext,
        host=HostLens.of(new, (pre + ext).tolist()),
        kv_pool=one.kv_pool,
        attn_backend=one.attn_backend,
        logits_indices=torch.cumsum(ext, 0) - 1,
    )


def test_a_single_prefill_takes_the_smallest_bucket_that_holds_it() -> None:
    graphs = _graphs()
    assert list(graphs.graphs) == [n for n in PREFILL_BUCKETS if n <= WIDTH]
    for new in (1, 15, 16, 17, 64, 65, 128):
        want = min(n for n in graphs.graphs if n >= new)
        assert graphs.bucket(_prefill(graphs, [0], [new])) == want
    assert graphs.bucket(_prefill(graphs, [0], [129])) is None  # past the largest bucket
    # A cached prefix leaves the row WIDTH - prefix wide: padding to 32 must still fit.
    assert graphs.bucket(_prefill(graphs, [WIDTH - 32], [20])) == 32
    assert graphs.bucket(_prefill(graphs, [WIDTH - 31], [20])) is None


def test_other_forwards_run_eagerly() -> None:
    graphs = _graphs()
    fb = _prefill(graphs, [3], [10])
    assert graphs.bucket(fb) == 16
    assert graphs.bucket(_prefill(graphs, [0, 4], [5, 7])) is None  # two requests
    for other in (
        dataclasses.replace(fb, logits_indices=None),  # every row's logits
        dataclasses.replace(fb, logits_indices=torch.tensor([3, 9])),
        dataclasses.replace(fb, mode="verify"),
        dataclasses.replace(fb, tree_mask=torch.ones(1, 10, 10, dtype=torch.bool)),
        dataclasses.replace(fb, kv_lens=torch.tensor([20])),
    ):
        assert graphs.bucket(other) is None


@pytest.mark.parametrize(("prefix", "new"), [(0, 5), (7, 16), (40, 33)])
def test_a_prompt_is_padded_after_its_tokens(prefix: int, new: int) -> None:
    graphs = _graphs()
    fb = _prefill(graphs, [prefix], [new])
    n = graphs.bucket(fb)
    assert n is not None
    staged: list[ForwardBatch] = []
    graphs.graphs[n].replay = lambda f: staged.append(f) or ()  # type: ignore[method-assign]
    graphs.replay(fb, n)
    (p,) = staged
    assert p.input_ids.shape == p.positions.shape == p.out_cache_loc.shape == (n,)
    assert torch.equal(p.input_ids[:new], fb.input_ids) and not p.input_ids[new:].any()
    # Padding writes the dummy slot 0 and sits at the last prompt position (a rotary row).
    assert torch.equal(p.out_cache_loc[:new], fb.out_cache_loc) and not p.out_cache_loc[new:].any()
    assert torch.equal(p.positions[:new], fb.positions)
    assert (p.positions[new:] == prefix + new - 1).all()
    assert p.host == HostLens(n, prefix + n, True) and p.logits_indices is None
    assert torch.equal(p.req_pool_indices, fb.req_pool_indices)
    assert torch.equal(p.prefix_lens, fb.prefix_lens)

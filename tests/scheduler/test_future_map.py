"""FutureMap relay: stash -> publish -> resolve, placeholder resolution, guards, the compiled
gather, and the host-side publish wait across threads (all on CPU)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import eagleserve.scheduler.future_map as fm_mod
from eagleserve.core import EagleDraftInput, ScheduleBatch
from eagleserve.scheduler.future_map import (
    DISABLE_COMPILE_ENV,
    FutureMap,
    _gather_spec_extras,
    _gather_spec_extras_eager,
)

CPU = torch.device("cpu")
POOL = 64


def _batch(
    input_ids: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    future_indices: torch.Tensor | None = None,
) -> ScheduleBatch:
    return ScheduleBatch(
        reqs=[],
        mode="decode",
        device=CPU,
        input_ids=input_ids,
        seq_lens=seq_lens,
        future_indices=future_indices,
        lengths_in_flight=future_indices is not None,  # a verify's, unless a test says so
    )


def _rand_slots(gen: torch.Generator, bs: int) -> torch.Tensor:
    """Distinct request-pool slots in [0, POOL)."""
    return torch.randperm(POOL, generator=gen)[:bs]


@pytest.fixture
def eager_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    # Logic tests use the eager gathers; the compiled path is checked against it separately
    # (keeps the suite from compiling one inductor graph per topk/hidden configuration).
    monkeypatch.setenv(DISABLE_COMPILE_ENV, "1")


@pytest.mark.usefixtures("eager_gather")
@pytest.mark.parametrize("topk", [1, 4])
@pytest.mark.parametrize("hidden", [8, 16])
def test_spec_round_trip(topk: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(topk * 100 + hidden)
    fmap = FutureMap(POOL, CPU)
    bs = 11
    slots = _rand_slots(gen, bs)
    fi = FutureMap.alloc_future_indices(slots)
    assert torch.equal(fi, slots + 1) and int(fi.min()) >= 1

    bonus = torch.randint(1, 32000, (bs,), generator=gen)
    new_seq_lens = torch.randint(1, 4096, (bs,), generator=gen)
    topk_p = torch.rand(bs, topk, generator=gen) + 0.01
    topk_index = torch.randint(1, 32000, (bs, topk), generator=gen)
    hs = torch.randn(bs, hidden, generator=gen)
    # Two-phase stash as the worker does it: seq lens before publish, draft outputs after.
    fmap.stash(fi, bonus, new_seq_lens=new_seq_lens)
    fmap.publish()
    fmap.stash_draft(fi, EagleDraftInput(topk_p, topk_index, hs))

    # The next batch holds the same requests in a different order.
    perm = torch.randperm(bs, generator=gen)
    batch = _batch(
        input_ids=FutureMap.placeholder_ids(fi[perm]),
        seq_lens=torch.full((bs,), -7, dtype=torch.long),  # stale; must be replaced
        future_indices=fi[perm],
    )
    fmap.resolve_seq_lens_cpu(batch, 4)
    assert torch.equal(batch.seq_lens, new_seq_lens[perm])
    assert torch.equal(batch.seq_lens_cpu, new_seq_lens[perm])
    assert batch.seq_lens_sum == int(new_seq_lens.sum())

    info = fmap.resolve_future(batch)
    assert info is not None
    assert torch.equal(info.topk_p, topk_p[perm])
    assert torch.equal(info.topk_index, topk_index[perm])
    assert torch.equal(info.hidden_states, hs[perm])
    assert torch.equal(batch.input_ids, bonus[perm])  # the bonus token, through the placeholder
    assert torch.equal(batch.seq_lens, new_seq_lens[perm])


@pytest.mark.usefixtures("eager_gather")
def test_placeholders_resolved_real_ids_untouched() -> None:
    gen = torch.Generator().manual_seed(1)
    fmap = FutureMap(POOL, CPU)
    slots = _rand_slots(gen, 5)
    fi = FutureMap.alloc_future_indices(slots)
    next_tokens = torch.randint(1, 32000, (5,), generator=gen)
    fmap.stash(fi, next_tokens)  # no spec: next-token ids only

    # Mixed batch: extend tokens (including token id 0) and decode placeholders.
    extend = torch.tensor([0, 17, 31999, 5, 0], dtype=torch.long)
    ids = torch.cat([extend, FutureMap.placeholder_ids(fi)])
    batch = _batch(input_ids=ids.clone())
    assert fmap.resolve_future(batch) is None  # no spec payload, no futures on the batch
    assert torch.equal(batch.input_ids, torch.cat([extend, next_tokens]))
    assert batch.seq_lens is None  # seq lens are not relayed without spec


def test_unstashed_slot_trips_guard() -> None:
    fmap = FutureMap(POOL, CPU)
    fmap.stash(torch.tensor([3, 4]), torch.tensor([11, 12]), new_seq_lens=torch.tensor([9, 10]))
    fmap.publish()
    batch = _batch(future_indices=torch.tensor([3, 5]))  # slot 5 was never stashed
    with pytest.raises(RuntimeError):
        fmap.resolve_future(batch)
    # The host-side resolve reports it too, with a readable message.
    with pytest.raises(RuntimeError, match="unstashed"):
        fmap.resolve_seq_lens_cpu(_batch(future_indices=torch.tensor([5])), 4)
    # Future index 0 (the scratch row) is never valid.
    with pytest.raises(RuntimeError):
        fmap.resolve_future(_batch(future_indices=torch.tensor([0])))


@pytest.mark.usefixtures("eager_gather")
def test_debug_poison_catches_double_resolve() -> None:
    fmap = FutureMap(POOL, CPU, debug_poison=True)
    fi = torch.tensor([2, 7])
    fmap.stash(fi, torch.tensor([101, 102]), new_seq_lens=torch.tensor([30, 40]))
    fmap.stash_draft(
        fi, EagleDraftInput(torch.rand(2, 1) + 0.1, torch.tensor([[5], [6]]), torch.randn(2, 4))
    )
    fmap.publish()
    ok = _batch(input_ids=-fi, future_indices=fi)
    assert fmap.resolve_future(ok) is not None
    assert torch.equal(ok.input_ids, torch.tensor([101, 102]))
    # Consumed: a second resolve without a stash in between trips the guard.
    with pytest.raises(RuntimeError):
        fmap.resolve_future(_batch(input_ids=-fi, future_indices=fi))

    # Without spec seq lens the token guard catches it.
    plain = FutureMap(POOL, CPU, debug_poison=True)
    plain.stash(torch.tensor([4]), torch.tensor([77]))
    batch = _batch(input_ids=torch.tensor([3, -4]))
    plain.resolve_future(batch)
    assert torch.equal(batch.input_ids, torch.tensor([3, 77]))
    with pytest.raises(RuntimeError):
        plain.resolve_future(_batch(input_ids=torch.tensor([3, -4])))


def test_resolve_seq_lens_cpu_waits_only_for_lengths_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fmap = FutureMap(POOL, CPU)
    fmap.stash(torch.tensor([1]), torch.tensor([5]), new_seq_lens=torch.tensor([8]))
    fmap.expect_publish()  # an announced publish that never comes: waiting would hang

    def no_wait(*args: object, **kwargs: object) -> None:
        raise AssertionError("resolve_seq_lens_cpu must not wait: no lengths in flight")

    monkeypatch.setattr(fmap, "wait_published", no_wait)
    seq_lens = torch.tensor([3, 4])
    seq_lens_cpu = torch.tensor([3, 4])
    batch = _batch(input_ids=torch.tensor([1, 2]), seq_lens=seq_lens)
    batch.seq_lens_cpu = seq_lens_cpu
    batch.seq_lens_sum = None
    fmap.resolve_seq_lens_cpu(batch, 4)
    assert batch.seq_lens is seq_lens
    assert batch.seq_lens_cpu is seq_lens_cpu
    assert batch.seq_lens_sum is None  # refresh_seq_lens_cpu was not called
    # Futures whose lengths the host already knows (a prefill, a decode without drafts).
    batch.future_indices, batch.lengths_in_flight = torch.tensor([1, 2]), False
    fmap.resolve_seq_lens_cpu(batch, 4)
    assert batch.seq_lens is seq_lens and batch.seq_lens_cpu is seq_lens_cpu


def _make_bufs(
    gen: torch.Generator, topk: int, hidden: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = POOL + 1
    topk_p = torch.rand(rows, topk, generator=gen) + 0.01
    topk_index = torch.randint(1, 32000, (rows, topk), generator=gen)
    hs = torch.randn(rows, hidden, generator=gen)
    return topk_p, topk_index, hs


def _assert_same(a: tuple, b: tuple) -> None:
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            assert x is None and y is None
        else:
            assert torch.equal(x, y)


def test_compiled_gather_matches_eager_without_recompiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DISABLE_COMPILE_ENV, raising=False)
    torch._dynamo.reset()
    monkeypatch.setattr(fm_mod, "_compiled_gather", None)
    stats = torch._dynamo.utils.counters["stats"]
    before = stats["unique_graphs"]
    gen = torch.Generator().manual_seed(3)
    for hidden in (16, 24):
        bufs = _make_bufs(gen, topk=4, hidden=hidden)
        for bs in range(1, 65):
            idx = torch.randint(1, POOL + 1, (bs,), generator=gen)
            got = _gather_spec_extras(idx, *bufs)
            _assert_same(got, _gather_spec_extras_eager(idx, *bufs))
    compiled_graphs = stats["unique_graphs"] - before
    # At most one graph per hidden size, none per batch size (bs=1 included).
    assert 1 <= compiled_graphs <= 2, compiled_graphs


def test_warm_up_compiles_before_the_first_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DISABLE_COMPILE_ENV, raising=False)
    torch._dynamo.reset()
    monkeypatch.setattr(fm_mod, "_compiled_gather", None)
    fmap = FutureMap(POOL, CPU)
    fmap.warm_up(topk=2, hidden_size=12, dtype=torch.float32)
    stats = torch._dynamo.utils.counters["stats"]
    before = stats["unique_graphs"]
    gen = torch.Generator().manual_seed(6)
    fi = FutureMap.alloc_future_indices(_rand_slots(gen, 5))
    info = EagleDraftInput(
        torch.rand(5, 2, generator=gen),
        torch.randint(0, 999, (5, 2), generator=gen),
        torch.randn(5, 12, generator=gen),
    )
    fmap.stash(fi, torch.randint(0, 999, (5,), generator=gen))
    fmap.stash_draft(fi, info)
    with torch.inference_mode():  # as the overlap forward resolves
        got = fmap.resolve_future(_batch(input_ids=-fi, future_indices=fi))
    assert stats["unique_graphs"] == before  # nothing left to compile on the serving path
    assert got is not None and torch.equal(got.hidden_states, info.hidden_states)
    assert torch.equal(got.topk_index, info.topk_index)


def test_disable_compile_env_gives_identical_results(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(4)
    bufs = _make_bufs(gen, topk=4, hidden=24)
    idx = torch.randint(1, POOL + 1, (9,), generator=gen)
    monkeypatch.delenv(DISABLE_COMPILE_ENV, raising=False)
    compiled = _gather_spec_extras(idx, *bufs)
    monkeypatch.setenv(DISABLE_COMPILE_ENV, "1")
    compiled_before = fm_mod._compiled_gather
    monkeypatch.setattr(fm_mod, "_compiled_gather", None)
    eager = _gather_spec_extras(idx, *bufs)
    assert fm_mod._compiled_gather is None  # the fallback never built the compiled wrapper
    monkeypatch.setattr(fm_mod, "_compiled_gather", compiled_before)
    _assert_same(compiled, eager)
    _assert_same(eager, _gather_spec_extras_eager(idx, *bufs))


def test_publish_wait_across_threads() -> None:
    """The scheduler thread waits for a publish done by a separate forward thread."""
    fmap = FutureMap(POOL, CPU)
    fi = torch.tensor([6, 1, 9])
    lens = torch.tensor([12, 13, 14])
    for step in range(3):
        start = threading.Event()

        def forward(step: int = step, start: threading.Event = start) -> None:
            start.wait()
            time.sleep(0.05)  # the scheduler is already waiting by now
            fmap.stash(fi, fi * 10, new_seq_lens=lens + step)
            fmap.publish()

        fmap.expect_publish()  # announced before the hand-off, so no race with publish()
        worker = threading.Thread(target=forward)
        worker.start()
        start.set()
        batch = _batch(future_indices=fi)
        fmap.resolve_seq_lens_cpu(batch, 4)  # blocks until this step's publish
        assert torch.equal(batch.seq_lens_cpu, lens + step)
        assert batch.seq_lens_sum == int((lens + step).sum())
        worker.join()
    assert fmap.num_published == 3

    # An announced publish that never happens surfaces as a timeout, not a hang.
    fmap.expect_publish()
    with pytest.raises(TimeoutError):
        fmap.wait_published(timeout=0.05)


@pytest.mark.usefixtures("eager_gather")
def test_a_decode_without_drafts_leaves_the_seeds_in_their_rows() -> None:
    """Adaptive k = 0 iterations resolve their tokens, keep the lengths the host launched them
    with, and neither read nor stash a draft seed: the seed stashed before them is what the
    next drafting iteration reads, with the lengths the last of them stashed."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    fmap = FutureMap(POOL, CPU, debug_poison=True)
    fi = FutureMap.alloc_future_indices(_rand_slots(gen, 3))
    seed = EagleDraftInput(torch.rand(3, 2, generator=gen) + 0.1,
                           torch.randint(1, 32000, (3, 2), generator=gen),
                           torch.randn(3, 8, generator=gen))  # fmt: skip
    lens = torch.randint(1, 4096, (3,), generator=gen)
    tokens = torch.randint(1, 32000, (3,), generator=gen)
    fmap.stash(fi, tokens, new_seq_lens=lens)
    fmap.stash_draft(fi, seed)
    for step in range(2):  # two iterations without drafts
        host_lens = lens + step  # what the host knows at launch
        batch = _batch(input_ids=FutureMap.placeholder_ids(fi), future_indices=fi,
                       seq_lens=host_lens)  # fmt: skip
        assert fmap.resolve_future(batch, drafts=False) is None
        assert torch.equal(batch.input_ids, tokens) and batch.seq_lens is host_lens
        tokens = torch.randint(1, 32000, (3,), generator=gen)
        fmap.stash(fi, tokens, new_seq_lens=host_lens + 1)
    batch = _batch(input_ids=FutureMap.placeholder_ids(fi), future_indices=fi)
    info = fmap.resolve_future(batch)
    assert info is not None and torch.equal(batch.input_ids, tokens)
    assert torch.equal(batch.seq_lens, lens + 2)
    assert torch.equal(info.topk_p, seed.topk_p) and torch.equal(info.topk_index, seed.topk_index)
    assert torch.equal(info.hidden_states, seed.hidden_states)


@pytest.mark.usefixtures("eager_gather")
def test_a_verify_in_flight_leaves_the_host_a_bound_not_a_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a verify, the next launch takes its lengths on the device from the relay and, on
    the host, bounds them by each request's committed length plus the most a verify commits:
    the host never reads the device's lengths (on a GPU that would wait for the verify)."""
    from eagleserve.core import Req
    from eagleserve.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    bs, max_new = 6, 4
    fmap = FutureMap(POOL, CPU)
    fi = FutureMap.alloc_future_indices(_rand_slots(gen, bs))
    committed = torch.randint(5, 500, (bs,), generator=gen)
    accepted = torch.randint(1, max_new + 1, (bs,), generator=gen)
    fmap.stash(fi, torch.randint(1, 99, (bs,), generator=gen), new_seq_lens=committed + accepted)
    fmap.publish()
    reqs = [Req(f"r{i}", [1, 2], SamplingParams(), kv_committed_len=int(c))
            for i, c in enumerate(committed)]  # fmt: skip
    batch = _batch(input_ids=FutureMap.placeholder_ids(fi), future_indices=fi)
    batch.reqs = reqs
    real_to = torch.Tensor.to

    def no_read(t: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if t.data_ptr() == fmap.new_seq_lens_buf.data_ptr() or "cpu" in args:
            raise AssertionError("the host read the relayed lengths")
        return real_to(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", no_read)
    fmap.resolve_seq_lens_cpu(batch, max_new)
    monkeypatch.undo()
    assert torch.equal(batch.seq_lens, committed + accepted)  # exact, on the device
    assert torch.equal(batch.seq_lens_cpu, committed + max_new)
    assert (batch.seq_lens_cpu >= batch.seq_lens).all()
    assert batch.seq_lens_sum == int((committed + max_new).sum())
    assert not batch.lengths_in_flight

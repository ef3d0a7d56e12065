"""The chunk of chunked prefill next to decodes: pure budget math on random times, and a CPU
engine whose chunks, while requests decode, shrink to about one decode iteration's cost."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from conftest import run_scheduler_to_completion

from eagleserve import SamplingParams
from eagleserve.core import ScheduleBatch
from eagleserve.messages import GenerateReqInput
from eagleserve.scheduler.chunk_budget import (
    CHUNK_COST_SHARE,
    MIN_CHUNK_TOKENS,
    ChunkBudget,
    chunk_tokens,
)
from eagleserve.scheduler.scheduler import Scheduler


def test_chunk_costs_about_one_decode() -> None:
    rng = random.Random()
    for _ in range(200):
        decode_s = rng.uniform(1e-3, 0.2)
        per_token = rng.uniform(1e-4, 0.05)
        size = rng.randrange(1, 512)
        n = chunk_tokens(decode_s, per_token, size)
        assert min(MIN_CHUNK_TOKENS, size) <= n <= size
        if min(MIN_CHUNK_TOKENS, size) < n < size:  # not clamped: the largest that fits
            share = CHUNK_COST_SHARE * decode_s
            assert n * per_token <= share < (n + 1) * per_token
    assert chunk_tokens(None, 0.01, 64) == 64  # nothing measured yet: the chunk size
    assert chunk_tokens(0.05, None, 64) == 64


def test_budget_cuts_only_next_to_decodes() -> None:
    rng = random.Random()
    size = rng.randrange(32, 256)
    budget = ChunkBudget(size, dynamic=True)
    per_token = rng.uniform(1e-3, 2e-3)
    budget.observe("extend", 100, 100 * per_token)
    budget.observe("decode", 0, 16 * per_token)  # a decode costs about 16 prompt tokens
    assert budget.tokens(decoding=False, unchunked_limit=8192) == size
    want = int(CHUNK_COST_SHARE * 16)
    assert budget.tokens(decoding=True, unchunked_limit=8192) in (want - 1, want)
    # A chunk found twice as slow per token halves the next one at once; a faster one lets
    # it grow back only gradually.
    budget.observe("extend", 10, 10 * 2 * per_token)
    assert budget.tokens(decoding=True, unchunked_limit=8192) in (want // 2 - 1, want // 2)
    budget.observe("extend", 10, 10 * per_token / 2)
    assert budget.tokens(decoding=True, unchunked_limit=8192) < want
    fixed = ChunkBudget(size, dynamic=False)
    fixed.observe("decode", 0, 8 * per_token)
    assert fixed.tokens(decoding=True, unchunked_limit=8192) == size
    assert ChunkBudget(None, dynamic=True).tokens(decoding=True, unchunked_limit=999) == 999


def test_mixed_chunk_is_timed_beyond_its_decode() -> None:
    """A mixed forward (a chunk and the decode step): its prompt tokens cost what it took
    beyond a decode iteration, not its time spread over every row."""
    rng = random.Random()
    budget = ChunkBudget(256, dynamic=True)
    decode_s, per_token = rng.uniform(0.02, 0.05), rng.uniform(1e-3, 2e-3)
    budget.observe("decode", 0, decode_s)
    chunk, rows = rng.randrange(4, 32), rng.randrange(2, 16)
    budget.observe("extend", chunk + rows, decode_s + chunk * per_token, decode_rows=rows)
    assert budget.prefill_s_per_token == pytest.approx(per_token)
    want = int(CHUNK_COST_SHARE * decode_s / per_token)
    assert budget.tokens(decoding=True, unchunked_limit=8192) in (want - 1, want, want + 1)


@pytest.mark.parametrize("dynamic", [True, False])
def test_cpu_chunks_next_to_decodes(
    tiny_model_dir: str, make_scheduler: Callable[..., Scheduler], dynamic: bool
) -> None:
    """A long prompt arrives while 4 requests decode: with dynamic chunking (a CPU's default)
    its chunks are cut to what a decode costs, on injected times so the test does not depend
    on this machine's speed; with it off they are the chunk size. Either way every chunk
    alternates with a decode and the long request completes."""
    sched = make_scheduler(
        tiny_model_dir, device="cpu", chunked_prefill_size=64, enable_dynamic_chunking=dynamic
    )
    budget = sched.chunk_budget
    budget.decode_s, budget.prefill_s_per_token = 8e-3, 1e-3  # a decode costs 8 prompt tokens
    budget.observe = lambda *a: None  # type: ignore[method-assign]
    rng = random.Random()
    greedy = SamplingParams(max_new_tokens=300, temperature=0.0, ignore_eos=True)
    for i in range(4):
        sched.add_request(
            GenerateReqInput(f"d{i}", [rng.randrange(1, 90) for _ in range(6)], greedy)
        )
    for _ in range(4):
        sched.step()
    long_ids = [rng.randrange(1, 90) for _ in range(200)]
    sched.add_request(GenerateReqInput("long", long_ids, SamplingParams(max_new_tokens=2)))
    modes: list[tuple[str, int]] = []
    pick = sched.get_next_batch_to_run

    def recording() -> ScheduleBatch | None:
        batch = pick()
        if batch is not None:
            modes.append((batch.mode, sum(batch.extend_lens or ())))
        return batch

    sched.get_next_batch_to_run = recording  # type: ignore[method-assign]
    finished = False
    while not finished:
        finished = any(out.rid == "long" and out.finished for out in sched.step())
    chunks = [n for mode, n in modes if mode == "extend"]
    assert sum(chunks) == len(long_ids)
    assert max(chunks) == (int(CHUNK_COST_SHARE * 8) if dynamic else 64), chunks
    for a, b in zip(modes, modes[1:]):  # a decode between two chunks
        assert not (a[0] == "extend" and b[0] == "extend"), modes
    run_scheduler_to_completion(sched)

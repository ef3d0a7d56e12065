"""kernels/cpu_argmax.cpp: greedy sampling and the greedy verify of a packed CPU target take
their argmax from one vectorized pass per row; it must answer what torch.argmax answers, ties,
NaN and -inf rows included (the verify's and a decode's tokens come from it)."""

from __future__ import annotations

import pytest
import torch

from eagleserve.kernels import cpu_ext
from eagleserve.sampling.sampler import greedy_ids
from eagleserve.sampling.sampling_info import SamplingInfo
from eagleserve.spec.accept import accept, unpack_walk, verify_greedy_chain
from eagleserve.spec.draft_extend import top_candidates

pytestmark = pytest.mark.skipif(
    not cpu_ext.load(), reason="the AVX2 kernels do not run here (no AVX2/FMA or compiler)"
)


@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 49152, 49155])
def test_argmax_rows_answers_what_torch_answers(vocab: int) -> None:
    rows = torch.randn(12, vocab) * 4
    k = max(1, vocab // 5)
    top = rows.max(-1, keepdim=True).values
    for r in range(1, 6):  # rows 1..5: the maximum at several places (ties)
        rows[r, torch.randperm(vocab)[:k]] = top[r]
    rows[6] = rows[6].round()  # integer-valued: many ties everywhere
    rows[7] = float("-inf")
    rows[8, torch.randperm(vocab)[: min(3, vocab)]] = float("nan")
    rows[9, torch.randint(0, vocab, (1,))] = float("inf")
    rows[10] = torch.where(torch.rand(vocab) < 0.5, -0.0, 0.0)  # signed zeros, max 0
    rows[11, torch.randperm(vocab)[: vocab // 2]] = float("-inf")
    got = cpu_ext.argmax_rows(rows)
    assert got.dtype == torch.int64
    assert torch.equal(got, rows.argmax(-1))
    # Leading dims are kept (the verify's [bs, n, V]), and each row alone gives its answer.
    assert torch.equal(
        cpu_ext.argmax_rows(rows.view(3, 4, vocab)), rows.view(3, 4, vocab).argmax(-1)
    )
    for r in (0, 5, 11):
        assert torch.equal(cpu_ext.argmax_rows(rows[r : r + 1]), got[r : r + 1])


def test_greedy_ids_keeps_torch_where_the_kernel_does_not_apply() -> None:
    logits = torch.randn(3, 100)
    assert torch.equal(greedy_ids(logits), logits.argmax(-1))  # the kernel (loaded above)
    half = logits.to(torch.bfloat16)
    assert torch.equal(greedy_ids(half), half.argmax(-1))  # torch's, as before
    strided = torch.randn(100, 3).t()  # a non-contiguous view: made contiguous first
    assert torch.equal(greedy_ids(strided), strided.argmax(-1))


@pytest.mark.parametrize(("bs", "n", "vocab"), [(1, 1, 5), (1, 2, 3), (16, 4, 3), (33, 6, 49152)])
def test_the_chain_walk_commits_what_the_torch_walk_commits(bs: int, n: int, vocab: int) -> None:
    """A greedy chain verify on a CPU walks the argmax in one kernel call (`accept`): the
    accepted nodes, committed tokens, lengths and bonus of `verify_greedy_chain` over
    torch.argmax, field for field; with ties (integer logits) and, on the full vocabulary,
    drafts equal to the argmax for a random run of nodes, so every length occurs."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    seen: set[int] = set()
    for _ in range(6):
        logits = (torch.randn(bs * n, vocab, generator=gen) * 2).round()
        predict = logits.argmax(-1).view(bs, n)
        tokens = torch.randint(0, vocab, (bs, n), generator=gen)
        run = torch.randint(0, n, (bs,), generator=gen)  # draft nodes 1..run are right
        for b in range(bs):
            tokens[b, 1 : int(run[b]) + 1] = predict[b, : int(run[b])]
        got = unpack_walk(cpu_ext.greedy_chain_walk(tokens, logits))
        want = verify_greedy_chain(tokens, predict)
        for name in ("accept_index", "accept_lens", "output_tokens", "bonus_tokens"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        seen |= set(got.accept_lens.tolist())
    if bs > 8:  # enough requests that the shortest and the longest run both occur
        assert seen >= {1, n}


def test_a_greedy_chain_accept_takes_the_kernel_walk() -> None:
    """`accept` of an all-greedy chain on fp32 CPU logits runs the one-call walk and commits
    what the torch ops commit on the same logits in fp64 (which keep the ops)."""
    bs, n, vocab = 4, 3, 50
    logits = torch.randn(bs, n, vocab)
    tokens = torch.randint(0, vocab, (bs, n))
    tokens[:, 1] = logits[:, 0].argmax(-1)  # every request accepts its first draft at least
    seeds = torch.zeros(bs, dtype=torch.long)
    info = SamplingInfo(torch.ones(bs, 1), torch.ones(bs), torch.full((bs,), vocab),
                        torch.zeros(bs), [True] * bs, seeds)  # fmt: skip
    parents = torch.arange(-1, n - 1).expand(bs, n)
    positions = 10 + torch.arange(n).expand(bs, n)
    calls = []
    original = cpu_ext.greedy_chain_walk

    def counting(*a: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return original(*a)

    cpu_ext.greedy_chain_walk = counting  # type: ignore[assignment]
    try:
        got = accept(info, tokens, parents, logits, positions, chain=True)
        ops = accept(info, tokens, parents, logits.double(), positions, chain=True)
    finally:
        cpu_ext.greedy_chain_walk = original  # type: ignore[assignment]
    assert len(calls) == 1, "the fp32 logits took the kernel, the fp64 ones the ops"
    assert bool((got.accept_lens >= 2).all())
    for name in ("accept_index", "accept_lens", "output_tokens", "bonus_tokens"):
        assert torch.equal(getattr(got, name), getattr(ops, name)), name


@pytest.mark.parametrize(("rows", "vocab"), [(1, 8192), (3, 1000), (5, 7)])
def test_a_chain_drafts_top1_is_the_softmax_max_and_its_mapped_id(rows: int, vocab: int) -> None:
    """A chain draft's candidate on a CPU head (`top1_rows`): the first argmax of each row
    (ties included), mapped through the draft-to-target table, and its softmax probability
    to fp32 rounding, as `top_candidates` and the map give them."""
    logits = torch.randn(rows, vocab) * 3
    logits[0, torch.randperm(vocab)[: max(1, vocab // 4)]] = logits[0].max()  # ties
    id_map = torch.randperm(49152)[:vocab]
    p, ids = cpu_ext.top1_rows(logits, id_map)
    want_p, want = top_candidates(logits, 1)
    assert ids.shape == (rows, 1) and p.shape == (rows, 1)
    assert torch.equal(ids, id_map[want])
    assert torch.allclose(p, want_p, rtol=1e-5, atol=0)
    p2, unmapped = cpu_ext.top1_rows(logits, None)
    assert torch.equal(unmapped, want) and torch.equal(p2, p)

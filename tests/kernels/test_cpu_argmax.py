"""kernels/cpu_argmax.cpp: greedy sampling and the greedy verify of a packed CPU target take
their argmax from one vectorized pass per row; it must answer what torch.argmax answers, ties,
NaN and -inf rows included (the verify's and a decode's tokens come from it)."""

from __future__ import annotations

import pytest
import torch

from eagleserve.kernels import cpu_ext
from eagleserve.sampling.sampler import greedy_ids

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

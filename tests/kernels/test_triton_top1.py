"""A chain draft's top-1 in one launch (kernels/triton_top1.py) against the softmax, max and
gather it replaces (spec/draft_extend.py's `top_candidates` and the head's id map)."""

from __future__ import annotations

import pytest
import torch
from triton_mode import DEVICE  # before triton is imported: picks the interpreter without a GPU

pytest.importorskip("triton")

from eagleserve.kernels.triton_top1 import top1  # noqa: E402
from eagleserve.spec.draft_extend import top_candidates  # noqa: E402


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize(("rows", "vocab"), [(1, 8192), (5, 1000), (3, 9000)])
def test_top1_is_the_softmax_max_mapped(dtype: torch.dtype, rows: int, vocab: int) -> None:
    """Random logits with a tie for the max planted in one row (the lowest id wins, across
    the kernel's blocks too); ids exact, probabilities to fp32 rounding."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    logits = (3 * torch.randn(rows, vocab, generator=gen)).to(dtype)
    tie = logits[0].max() + 1
    logits[0, vocab - 3], logits[0, 7] = tie, tie
    id_map = torch.randperm(50_000, generator=gen)[:vocab]
    want_p, want_ids = top_candidates(logits, 1)
    assert int(want_ids[0]) == 7
    p, ids = top1(logits.to(DEVICE), id_map.to(DEVICE))
    assert p.shape == (rows, 1) and p.dtype == torch.float32 and ids.shape == (rows, 1)
    assert torch.equal(ids.cpu(), id_map[want_ids])
    torch.testing.assert_close(p.cpu(), want_p, rtol=1e-5, atol=1e-7)
    _, raw = top1(logits.to(DEVICE))
    assert torch.equal(raw.cpu(), want_ids)

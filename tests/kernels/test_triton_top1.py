"""A chain draft's top-1 in one launch (kernels/triton_top1.py) against the softmax, max and
gather it replaces (spec/draft_extend.py's `top_candidates` and the head's id map), and its
drawn variant against the sampler's draw."""

from __future__ import annotations

import pytest
import torch
from triton_mode import DEVICE  # before triton is imported: picks the interpreter without a GPU

pytest.importorskip("triton")

from eagleserve.kernels.triton_top1 import drawn_top1, top1  # noqa: E402
from eagleserve.sampling.sampler import logits_to_probs, sample_packed  # noqa: E402
from eagleserve.sampling.sampling_info import PackedSampling, SamplingInfo  # noqa: E402
from eagleserve.sampling.seeded_noise import (  # noqa: E402
    exponentials,
    position_hashes,
    token_uniforms,
)
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


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize(("rows", "vocab"), [(40, 2500), (24, 8192)])
def test_drawn_top1_is_the_samplers_draw(dtype: torch.dtype, rows: int, vocab: int) -> None:
    """Rows of random temperature and min-p, some greedy, on fresh logits: a sampled row draws
    the token the sampler's draw over the same logits gives (sampler.sample_packed, keyed by the
    mapped ids), wherever its race is clear of a near-tie (the kernel's unnormalized weights
    round apart from the softmax's); a greedy row its argmax; each draft's probability at
    temperature 1."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    logits = torch.randn(rows, vocab, generator=gen) * torch.rand(rows, 1, generator=gen) * 6
    logits = logits.to(dtype)
    sampled = torch.rand(rows, generator=gen) < 0.75
    temperature = torch.where(sampled, torch.rand(rows, generator=gen) * 1.3 + 0.2, 1.0)
    min_p = torch.where(torch.rand(rows, generator=gen) < 0.3, 0.05, 0.0)
    floats = torch.stack([temperature, torch.ones(rows), min_p], dim=1)
    seeds = torch.randint(0, 2**63 - 1, (rows,), generator=gen)
    ints = torch.stack([torch.full((rows,), vocab), seeds, sampled.long()], dim=1)
    positions = torch.randint(0, 2**31, (rows,), generator=gen)
    id_map = torch.randperm(50_000, generator=gen)[:vocab]
    packed = PackedSampling(floats, ints)
    want = sample_packed(logits.float(), packed, positions, id_map, False, None)
    p, ids = drawn_top1(*(t.to(DEVICE) for t in (logits, floats, ints, positions, id_map)))
    got = ids.cpu()[:, 0]
    # Rows whose race has a clear winner: the two least keys more than 1e-4 apart.
    info = SamplingInfo(floats[:, :1], floats[:, 1], ints[:, 0], floats[:, 2], [False] * rows,
                        seeds, needs_top_k=False, needs_top_p=False)  # fmt: skip
    probs = logits_to_probs(logits.float(), info)
    e = exponentials(token_uniforms(position_hashes(seeds, positions), id_map))
    two = (e / probs.double()).topk(2, dim=-1, largest=False).values
    clear = (two[:, 1] - two[:, 0]) > 1e-4 * two[:, 0]
    assert clear.float().mean() > 0.8
    assert torch.equal(got[clear], id_map[want][clear])
    assert torch.equal(got[~sampled], id_map[logits[~sampled].float().argmax(-1)])
    col = (id_map[None, :] == got[:, None]).float().argmax(-1)
    want_p = torch.softmax(logits.float(), -1).gather(1, col[:, None])
    torch.testing.assert_close(p.cpu(), want_p, rtol=1e-5, atol=1e-7)
    assert not torch.equal(got[sampled], id_map[logits[sampled].float().argmax(-1)])

"""The one-launch seeded draw (kernels/triton_sample.py) against the torch ops it replaces
(sampling/sampler.py's `draw`, the exponential race on seeded_noise.py's noise), on fresh
random rows."""

from __future__ import annotations

import random

import pytest
import torch
from triton_mode import DEVICE  # before triton is imported: picks the interpreter without a GPU

pytest.importorskip("triton")

from eagleserve.kernels.triton_sample import seeded_draw  # noqa: E402
from eagleserve.sampling.sampler import draw  # noqa: E402


@pytest.mark.parametrize("vocab", [7, 2048, 5000])
def test_seeded_draw_is_the_torch_draw(vocab: int) -> None:
    """Peaky, flat, sparse (top-k / top-p zeroed) and unnormalized rows, seeds over their whole
    range: the same token as the torch draw with the same noise."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    m = 64
    scale = torch.tensor([0.3, 2.0, 6.0, 12.0]).repeat(m // 4)[:, None]
    probs = torch.softmax(torch.randn(m, vocab, generator=gen) * scale, dim=-1)
    probs[1::3] *= torch.rand(m, vocab, generator=gen)[1::3] < 0.2  # sparse rows
    probs[torch.arange(m), torch.randint(0, vocab, (m,), generator=gen)] += 0.01  # none empty
    probs[2::5] *= 7.5  # not normalized
    seeds = torch.randint(0, 2**63 - 1, (m,), generator=gen)
    seeds[:2] = torch.tensor([0, 2**63 - 1])
    positions = torch.randint(0, 2**31, (m,), generator=gen)
    want = draw(probs, seeds, positions)
    got = seeded_draw(probs.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE)).cpu()
    assert torch.equal(got, want)
    assert (probs.gather(1, got[:, None]) > 0).all()


def test_seeded_draw_keys_the_noise_by_the_columns_tokens() -> None:
    """With `columns` (a draft vocabulary's token ids), the torch draw's column again."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    m, vocab = 32, 600
    probs = torch.softmax(torch.randn(m, vocab, generator=gen) * 3, dim=-1)
    columns = torch.randperm(49152, generator=gen)[:vocab].sort().values
    seeds = torch.randint(0, 2**63 - 1, (m,), generator=gen)
    positions = torch.randint(0, 2**31, (m,), generator=gen)
    want = draw(probs, seeds, positions, columns)
    got = seeded_draw(probs.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE),
                      columns.to(DEVICE)).cpu()  # fmt: skip
    assert torch.equal(got, want)
    assert not torch.equal(want, draw(probs, seeds, positions))  # the key moved the draws


def test_seeded_draw_survives_a_row_without_mass() -> None:
    probs = torch.zeros(3, 9)
    probs[1, 4] = 1e-40
    probs[2, 2:5] = 1.0
    seeds, positions = torch.tensor([5, 6, 7]), torch.tensor([10, 11, 12])
    got = seeded_draw(probs.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE)).cpu()
    assert 0 <= got[0] < 9 and got[1] == 4 and 2 <= got[2] < 5


def test_the_sampler_draws_the_same_tokens_with_the_kernel(monkeypatch) -> None:
    """sample() on the kernel (as the model runner turns it on for an accelerator): the tokens
    of the torch draw, greedy rows, filters and a real vocabulary's size included."""
    from eagleserve.core import Req
    from eagleserve.sampling import sampler
    from eagleserve.sampling_params import SamplingParams

    vocab = 49152
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_p=0.9),
        SamplingParams(temperature=1.2),
        SamplingParams(temperature=0.7, top_k=40),
    ]
    reqs = [Req(f"r{i}", [1], p) for i, p in enumerate(params)]
    for r in reqs:
        r.sampling_seed = None if r.sampling_params.is_greedy else random.randrange(2**63)
    info = sampler.SamplingInfo.from_reqs(reqs, vocab, DEVICE)  # torch ops
    on_kernel = sampler.SamplingInfo.from_reqs(reqs, vocab, DEVICE, draw_kernel="triton")
    for _ in range(3):
        logits = (torch.randn(len(reqs), vocab) * 4).to(DEVICE)
        positions = torch.randint(0, 10**6, (len(reqs),)).to(DEVICE)
        want = sampler.sample(logits, info, positions)
        got = sampler.sample(logits, on_kernel, positions)
        assert torch.equal(got, want)

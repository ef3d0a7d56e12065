"""The one-launch seeded draw (kernels/triton_sample.py) against the torch ops it replaces
(sampling/sampler.py's `draw`, the exponential race on seeded_noise.py's noise), on fresh
random rows."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from triton_mode import DEVICE  # before triton is imported: picks the interpreter without a GPU

pytest.importorskip("triton")

from eagleserve.kernels.triton_sample import seeded_draw  # noqa: E402
from eagleserve.sampling.sampler import (  # noqa: E402
    SamplingInfo,
    draw,
    logits_to_probs,
    sample,
)
from eagleserve.sampling.seeded_noise import (  # noqa: E402
    exponentials,
    position_hashes,
    token_uniforms,
)


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


def _info(m: int, vocab: int, kernel: str | None, top_p: float) -> SamplingInfo:
    """m rows, about a quarter greedy, the others at random temperatures and min-p, top-p
    `top_p` on every sampled row."""
    greedy = [random.random() < 0.25 for _ in range(m)]
    return SamplingInfo(
        temperatures=torch.tensor([1.0 if g else random.uniform(0.3, 1.5) for g in greedy])[
            :, None
        ],
        top_ps=torch.full((m,), top_p),
        top_ks=torch.full((m,), vocab),
        min_ps=torch.tensor([random.choice([0.0, 0.0, 0.05]) for _ in greedy]),
        is_greedy=greedy,
        seeds=torch.randint(0, 2**63 - 1, (m,)),
        needs_top_k=False,
        needs_top_p=top_p < 1,
        needs_min_p=True,
        draw_kernel=kernel,  # type: ignore[arg-type]
    )


def test_an_unfiltered_batch_samples_in_one_kernel_with_the_torch_draws_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`sample` on the Triton path: a batch whose rows filter by neither top-k nor top-p, greedy
    rows among them, is one launch from the logits (`drawn_top1`), and gives the torch draw's
    token on every row whose race is clear of a near-tie, a greedy row's argmax always; a batch
    with a top-p row takes the probabilities and the seeded draw, the torch draw's tokens
    exactly."""
    from eagleserve.kernels import triton_top1

    launches: list[int] = []
    real = triton_top1.drawn_top1

    def counted(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        launches.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(triton_top1, "drawn_top1", counted)
    m, vocab = 48, 3000
    logits = torch.randn(m, vocab) * torch.rand(m, 1) * 6
    positions = torch.randint(0, 2**31, (m,))
    for top_p in (1.0, 0.9):
        torch_info = _info(m, vocab, None, top_p)
        want = sample(logits, torch_info, positions)
        fused = dataclasses.replace(torch_info, draw_kernel="triton")
        launches.clear()
        got = sample(logits.to(DEVICE), fused, positions.to(DEVICE)).cpu()
        assert launches == ([m] if top_p == 1 else [])  # every row, in one launch
        greedy = torch.tensor(torch_info.is_greedy)
        assert torch.equal(got[greedy], logits[greedy].argmax(-1))
        if top_p < 1:
            assert torch.equal(got, want)
            continue
        probs = logits_to_probs(logits, torch_info)
        e = exponentials(token_uniforms(position_hashes(torch_info.seeds, positions),
                                        torch.arange(vocab)))  # fmt: skip
        two = (e / probs.double()).topk(2, dim=-1, largest=False).values
        clear = (two[:, 1] - two[:, 0]) > 1e-4 * two[:, 0]
        assert clear.float().mean() > 0.8
        assert torch.equal(got[clear], want[clear])
        assert not torch.equal(got[~greedy], logits[~greedy].argmax(-1))

"""kernels/cpu_sample.cpp: a CPU engine's sampled rows take their token from one C++ call
(temperature, top-k, top-p, min-p, the seeded draw). It must draw what the sampler's torch ops
draw: the same token wherever the two roundings cannot disagree, the filtered distribution over
many seeds, and a row's token whatever its batch."""

from __future__ import annotations

import random

import pytest
import torch

from eagleserve.kernels import cpu_ext
from eagleserve.sampling import sampler
from eagleserve.sampling.sampler import draw, logits_to_probs
from eagleserve.sampling.sampling_info import SamplingInfo
from eagleserve.sampling.seeded_noise import exponentials, position_hashes, token_uniforms

pytestmark = pytest.mark.skipif(
    not cpu_ext.load(), reason="the AVX2 kernels do not run here (no AVX2/FMA or compiler)"
)


def _rows(m: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, SamplingInfo]:
    """Logits from flat to peaky (some with grammar-masked tokens) and mixed filters."""
    logits = torch.randn(m, vocab, generator=gen) * torch.rand(m, 1, generator=gen) * 5
    head = min(vocab, 60)
    logits[:, :head] += torch.rand(m, 1, generator=gen) * 12 * torch.rand(m, head, generator=gen)
    masked = torch.rand(m, vocab, generator=gen) < 0.3
    masked[:, 0] = False
    logits[: m // 4][masked[: m // 4]] = float("-inf")
    logits = logits[:, torch.randperm(vocab, generator=gen)]  # likely tokens anywhere

    def some(p: float, values: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        return torch.where(torch.rand(m, generator=gen) < p, values, off)

    ks = torch.randint(1, max(2, vocab // 3), (m,), generator=gen)
    top_ks = some(0.4, ks, torch.full((m,), vocab))
    info = SamplingInfo(
        temperatures=torch.rand(m, 1, generator=gen) * 1.5 + 0.1,
        top_ps=some(0.6, torch.rand(m, generator=gen) * 0.99 + 0.01, torch.ones(m)),
        top_ks=top_ks.clamp(max=vocab),
        min_ps=some(0.3, torch.rand(m, generator=gen) * 0.3, torch.zeros(m)),
        is_greedy=[False] * m,
        seeds=torch.randint(0, 2**63 - 1, (m,), generator=gen),
    )
    return logits, info


def _margin(logits: torch.Tensor, info: SamplingInfo, positions: torch.Tensor) -> torch.Tensor:
    """Per row, how far the rule's decisions lie from a boundary, in units of what rounding may
    move them: the race's two least keys E_t / w_t apart (relative: fp32 weights or
    probabilities, ~1e-7 each), top_p from the sorted running sums and min_p * max from the
    weights (the torch ops sum sorted fp32 probabilities in fp32: ~1e-4 over a large
    vocabulary). Below 1, the two paths may legitimately differ."""
    w = torch.softmax(logits.double() / info.temperatures.double(), -1)
    tokens = torch.arange(w.shape[1])
    e = exponentials(token_uniforms(position_hashes(info.seeds, positions), tokens))
    margins = []
    for r in range(w.shape[0]):
        p, idx = w[r].sort(descending=True)
        before = p.cumsum(0) - p
        rank = torch.arange(p.numel())
        keep = rank < info.top_ks[r]
        top_p = float(info.top_ps[r])
        gaps = [2.0]
        if top_p < 1:
            keep &= (before < top_p) | (rank == 0)
            gaps.append(float((before - top_p).abs().min()) / 1e-4)
        kept = torch.zeros_like(w[r], dtype=torch.bool)
        kept[idx[keep]] = True
        if info.min_ps[r] > 0:
            kept &= w[r] >= info.min_ps[r] * w[r].max()
            gaps.append(float((w[r] - info.min_ps[r] * w[r].max()).abs().min()) / 1e-4)
        keys = torch.where(kept & (w[r] > 0), e[r] / w[r], float("inf")).sort().values
        if torch.isfinite(keys[1:2]).all():
            gaps.append(float((keys[1] - keys[0]) / keys[0]) / 1e-5)
        margins.append(min(gaps))
    return torch.tensor(margins)


@pytest.mark.parametrize("vocab", [5, 8, 77, 4099, 49152])
def test_sample_rows_draws_the_torch_ops_token(vocab: int) -> None:
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    m = 64 if vocab > 10_000 else 256
    logits, info = _rows(m, vocab, gen)
    positions = torch.randint(0, 2**40, (m,), generator=gen)
    want = draw(logits_to_probs(logits, info), info.seeds, positions)
    got = cpu_ext.sample_rows(logits, info.temperatures, info.top_ks, info.top_ps, info.min_ps,
                              info.seeds, positions)  # fmt: skip
    assert got.dtype == torch.int64 and got.shape == (m,)
    clear = _margin(logits, info, positions) > 1
    assert clear.float().mean() > 0.5  # (a flat row over 49k tokens is near a cut often)
    assert torch.equal(got[clear], want[clear])
    assert (got == want).float().mean() > 0.9
    # Every token drawn is one the row keeps (never a masked one).
    assert torch.isfinite(logits.gather(1, got[:, None])).all()


def test_sample_rows_draws_the_filtered_distribution() -> None:
    """Over many seeds, a row's tokens follow its filtered distribution (chi-square)."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    vocab, n = 12, 24_000
    logits = (torch.randn(1, vocab, generator=gen) * 2).expand(n, vocab).contiguous()
    for t, top_k, top_p, min_p in [(1.0, vocab, 1.0, 0.0), (0.8, 5, 1.0, 0.0),
                                   (1.3, vocab, 0.7, 0.0), (0.9, 8, 0.9, 0.1)]:  # fmt: skip
        info = SamplingInfo(torch.full((n, 1), t), torch.full((n,), top_p),
                            torch.full((n,), top_k), torch.full((n,), min_p), [False] * n,
                            torch.randint(0, 2**63 - 1, (n,), generator=gen))  # fmt: skip
        got = cpu_ext.sample_rows(logits, info.temperatures, info.top_ks, info.top_ps,
                                  info.min_ps, info.seeds, torch.arange(n))  # fmt: skip
        probs = logits_to_probs(logits[:1], info.rows([0], torch.tensor([0])))[0].double()
        expected = probs / probs.sum() * n
        counts = torch.bincount(got, minlength=vocab).double()
        assert (counts[expected == 0] == 0).all()
        seen = expected > 0
        chi2 = float(((counts[seen] - expected[seen]) ** 2 / expected[seen]).sum())
        assert chi2 < 35.0, (t, top_k, top_p, min_p, chi2)  # 11 dof: p < 3e-4 by chance


@pytest.mark.parametrize("kernel", [None, "cpu"])
def test_a_row_over_some_columns_draws_the_whole_rows_token(kernel: str | None) -> None:
    """A row over some of the vocabulary (increasing token ids, `columns`: a draft head's row)
    draws the column of the token the whole row draws with the other tokens at -inf: the same
    weights, filters and noise per token, on the torch ops and on the kernel."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    vocab, m = 4099, 64
    logits, info = _rows(m, vocab, gen)
    info.draw_kernel = kernel  # type: ignore[assignment]
    ids = torch.randperm(vocab, generator=gen)[: vocab // 3].sort().values
    full = torch.full_like(logits, float("-inf"))
    full[:, ids] = logits[:, ids]
    positions = torch.randint(0, 2**40, (m,), generator=gen)
    want = sampler.sample(full, info, positions)
    got = sampler.sample(logits[:, ids].contiguous(), info, positions, ids)
    assert torch.equal(ids[got], want)


def test_a_rows_token_does_not_depend_on_its_batch() -> None:
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    logits, info = _rows(16, 4099, gen)
    positions = torch.randint(0, 5000, (16,), generator=gen)
    args = (info.temperatures, info.top_ks, info.top_ps, info.min_ps, info.seeds, positions)
    batch = cpu_ext.sample_rows(logits, *args)
    for r in (0, 7, 15):
        alone = cpu_ext.sample_rows(logits[r : r + 1], *(a[r : r + 1] for a in args))
        assert int(alone) == int(batch[r])


def test_edge_rows() -> None:
    vocab = 50
    logits = torch.randn(5, vocab) * 3
    logits[1, :] = 2.0  # all tied: top-k keeps the first k
    logits[2, :] = float("-inf")
    logits[2, 17] = 0.0  # one allowed token
    logits[3, :] = float("-inf")  # no allowed token: no distribution, still a token id
    logits[4, ::3] = float("nan")  # a NaN logit weighs nothing
    top_ks = torch.tensor([1, 3, vocab, vocab, vocab])
    top_ps = torch.tensor([1.0, 1.0, 0.5, 1.0, 1e-30])
    args = (torch.ones(5, 1), top_ks, top_ps, torch.zeros(5), torch.randint(0, 2**62, (5,)))
    for pos in range(20):
        got = cpu_ext.sample_rows(logits, *args, torch.full((5,), pos))
        assert got[0] == logits[0].argmax() and 0 <= got[1] < 3 and got[2] == 17
        assert 0 <= got[3] < vocab and got[4] == logits[4].nan_to_num(float("-inf")).argmax()
        nan_row = cpu_ext.sample_rows(logits[4:], torch.ones(1, 1), torch.tensor([vocab]),
                                      torch.ones(1), torch.zeros(1), args[4][4:],
                                      torch.tensor([pos]))  # fmt: skip
        assert not torch.isnan(logits[4, nan_row])


def test_the_sampler_uses_the_kernel_on_a_cpu() -> None:
    """With the kernel on (the model runner's default on a CPU), sample() draws a sampled row's
    token from it and a greedy row's argmax, verify nodes (repeated rows) included."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    logits, info = _rows(6, 4099, gen)
    info.is_greedy = [False, True, False, False, True, False]
    info.draw_kernel = "cpu"
    positions = torch.randint(0, 5000, (6,), generator=gen)
    got = sampler.sample(logits, info, positions)
    sampled = torch.tensor([0, 2, 3, 5])
    want = cpu_ext.sample_rows(logits[sampled], info.temperatures[sampled], info.top_ks[sampled],
                               info.top_ps[sampled], info.min_ps[sampled], info.seeds[sampled],
                               positions[sampled])  # fmt: skip
    assert torch.equal(got[sampled], want)
    assert torch.equal(got[[1, 4]], logits[[1, 4]].argmax(-1))
    nodes = info.repeat_interleave(2)
    assert nodes.draw_kernel == "cpu"
    again = sampler.sample(logits.repeat_interleave(2, 0), nodes, positions.repeat_interleave(2))
    assert torch.equal(again.view(6, 2), got[:, None].expand(6, 2))


def test_the_model_runner_chooses_the_kernel() -> None:
    from eagleserve.model_executor.model_runner import draw_kernel

    assert draw_kernel(torch.device("cpu")) == "cpu"
    assert draw_kernel(torch.device("meta")) == "triton"  # any accelerator


def test_any_row_gets_a_token_it_allows() -> None:
    """Fuzzed rows (sizes, -inf / NaN / huge logits, tiny temperatures, every filter): a token
    id in range, and one with a finite logit whenever the row has one."""
    rng = random.Random()
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    for _ in range(300):
        vocab = rng.choice([1, 2, 7, 8, 9, 63, 1000, 4099])
        m = rng.randint(1, 4)
        logits = torch.randn(m, vocab, generator=gen) * rng.choice([0.0, 1.0, 30.0, 1e4])
        special = torch.rand(m, vocab, generator=gen)
        logits[special < rng.random() * 0.5] = float("-inf")
        logits[special > 1 - rng.random() * 0.1] = float("nan")
        temps = torch.tensor([[rng.choice([1e-5, 0.3, 1.0, 2.0])] for _ in range(m)])
        top_ks = torch.randint(1, vocab + 1, (m,), generator=gen)
        top_ps = torch.rand(m, generator=gen).clamp(min=1e-6)
        min_ps = torch.rand(m, generator=gen) * rng.choice([0.0, 0.5, 1.0])
        seeds = torch.randint(0, 2**63 - 1, (m,), generator=gen)
        got = cpu_ext.sample_rows(logits, temps, top_ks, top_ps, min_ps, seeds,
                                  torch.randint(0, 2**40, (m,), generator=gen))  # fmt: skip
        assert ((got >= 0) & (got < vocab)).all()
        finite = torch.isfinite(logits)
        has_finite = finite.any(-1)
        assert finite[has_finite].gather(1, got[has_finite, None]).all()

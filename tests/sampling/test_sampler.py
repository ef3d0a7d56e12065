"""The sampler's target distribution: filters keep what they promise, never an empty set."""

from __future__ import annotations

import dataclasses
import math
import random

import torch

from eagleserve.core import Req, SamplingParams, ScheduleBatch
from eagleserve.sampling import sampler
from eagleserve.sampling.sampler import draw, logits_to_probs, sample
from eagleserve.sampling.sampling_info import SamplingInfo
from eagleserve.sampling.seeded_noise import exponentials, position_hashes, token_uniforms


def make_info(bs: int, vocab: int, top_p: float, top_k: int, min_p: float) -> SamplingInfo:
    return SamplingInfo(
        temperatures=torch.full((bs, 1), 0.7),
        top_ps=torch.full((bs,), top_p),
        top_ks=torch.full((bs,), vocab if top_k < 0 else top_k, dtype=torch.int64),
        min_ps=torch.full((bs,), min_p),
        is_greedy=[False] * bs,
        seeds=torch.randint(0, 2**63 - 1, (bs,)),
    )


def test_tiny_top_p_keeps_the_most_likely_token() -> None:
    # 5e-324 is 0.0 in fp32: the first token must still stay (it was an all-zero row: NaN).
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 3
    for top_p in (5e-324, 1e-9):
        probs = logits_to_probs(logits, make_info(4, 50, top_p, -1, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
        assert torch.isfinite(probs).all()
        assert torch.equal(probs.argmax(-1), logits.argmax(-1))
        assert torch.allclose(probs.max(-1).values, torch.ones(4))
        at = torch.randint(1, 1000, (4,))
        assert torch.equal(sample(logits, make_info(4, 50, top_p, -1, 0.0), at), logits.argmax(-1))


def test_filters_keep_the_promised_mass() -> None:
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        logits = torch.randn(3, 64, generator=gen) * 2
        top_p = float(torch.rand(1, generator=gen)) * 0.9 + 0.05
        top_k = int(torch.randint(1, 64, (1,), generator=gen))
        probs = logits_to_probs(logits, make_info(3, 64, top_p, top_k, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
        full = torch.softmax(logits / 0.7, -1)
        for row in range(3):
            kept = probs[row] > 0
            assert 1 <= int(kept.sum()) <= top_k
            order = full[row].argsort(descending=True)
            n = int(kept.sum())
            assert kept[order[:n]].all()  # a prefix of the sorted tokens
            # the smallest prefix reaching top_p, unless top_k cut it first
            mass_before, mass = full[row][order[: n - 1]].sum(), full[row][order[:n]].sum()
            assert n == top_k or mass_before < top_p <= mass + 1e-6
            assert torch.isclose(probs[row].sum(), torch.tensor(1.0))


def _reqs(params: list[SamplingParams]) -> list[Req]:
    return [Req(f"r{i}", [1, 2, 3], p) for i, p in enumerate(params)]


def test_host_flags_give_the_distribution_of_always_filtering() -> None:
    """from_reqs decides on the host which filters run; skipping the others changes nothing."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    for trial in range(8):
        params = [
            SamplingParams(
                temperature=0.0 if i == 0 else 0.5 + float(torch.rand(1, generator=gen)),
                top_p=1.0 if trial % 2 else 0.8,
                top_k=-1 if trial % 3 else 7,
                min_p=0.0 if trial % 4 else 0.05,
            )
            for i in range(3)
        ]
        info = SamplingInfo.from_reqs(_reqs(params), 40_000, torch.device("cpu"))
        assert info.needs_top_p == (trial % 2 == 0) and info.needs_top_k == (trial % 3 == 0)
        assert info.needs_min_p == (trial % 4 == 0)
        always = dataclasses.replace(info, needs_top_k=True, needs_top_p=True, needs_min_p=True)
        logits = torch.randn(3, 40_000, generator=gen) * 3  # a real vocabulary's rounding
        sampled = [i for i, g in enumerate(info.is_greedy) if not g]
        # Bit for bit: a row's tokens must not depend on whether another row filters.
        assert torch.equal(
            logits_to_probs(logits, info)[sampled], logits_to_probs(logits, always)[sampled]
        )


def test_sampling_info_is_built_once_per_batch_membership() -> None:
    reqs = _reqs([SamplingParams(temperature=0.9, top_p=0.5), SamplingParams(temperature=0.0)])
    batch = ScheduleBatch(reqs=list(reqs), mode="decode", device=torch.device("cpu"))
    batch.req_pool_indices = torch.tensor([0, 1])
    batch.seq_lens = batch.input_ids = torch.tensor([4, 4])
    first = SamplingInfo.of_batch(batch, 40, None)
    assert SamplingInfo.of_batch(batch, 40, None) is first
    batch.filter_batch([1])
    second = SamplingInfo.of_batch(batch, 40, None)
    assert second is not first and second.is_greedy == [True]
    assert torch.equal(first.rows([0], torch.tensor([0])).top_ps, torch.tensor([0.5]))


def test_a_request_joining_after_one_finished_gets_its_own_sampling_info() -> None:
    """The running batch loses a finished request and gains the next one (a client sends it as
    soon as its last answer ends): the new row samples with its own parameters, not with those
    of the request it replaced, even where Python gives the new `Req` the freed one's address."""
    rng = random.Random()
    for trial in range(20):
        temperature = round(rng.uniform(0.3, 1.5), 3)
        bias = {rng.randrange(40): rng.choice([-50.0, 50.0])}
        gone = _reqs([SamplingParams(temperature=0.0),
                      SamplingParams(temperature=temperature, logit_bias=bias)])  # fmt: skip
        batch = ScheduleBatch(reqs=list(gone), mode="decode", device=torch.device("cpu"))
        batch.req_pool_indices = torch.tensor([0, 1])
        batch.seq_lens = batch.input_ids = torch.tensor([4, 4])
        SamplingInfo.of_batch(batch, 40, None)
        batch.filter_batch([0])  # the sampled one finished
        kept = gone[0]
        rid, prompt, params = f"new{trial}", [1, 2, 3], SamplingParams(temperature=0.0)
        del gone  # the finished Req is freed; the next object made may take its address
        joined = Req(rid, prompt, params)
        other = ScheduleBatch(reqs=[joined], mode="decode", device=torch.device("cpu"))
        other.req_pool_indices, other.seq_lens = torch.tensor([1]), torch.tensor([4])
        other.input_ids = torch.tensor([5])
        batch.merge_batch(other)
        info = SamplingInfo.of_batch(batch, 40, None)
        assert batch.reqs[0] is kept and batch.reqs[1] is joined
        assert info.is_greedy == [True, True] and info.penalties is None, trial
        assert torch.equal(info.temperatures.flatten(), torch.ones(2))


def test_draw_follows_each_rows_distribution() -> None:
    """Over many positions of one seed, each row's tokens follow its (unnormalized) probs: a
    chi-square far inside its bound; tokens of zero mass are never drawn."""
    probs = torch.rand(5, 30) * (torch.rand(5, 30) > 0.3)
    probs[:, 7] += 0.05  # every row keeps some mass
    probs[2] *= 9.0  # not normalized
    draws = 20_000
    rows = torch.arange(5).repeat_interleave(draws)
    positions = torch.arange(draws).repeat(5) + random.randrange(2**40)
    got = draw(probs[rows], torch.full((5 * draws,), random.randrange(2**63)), positions)
    got = got.view(5, draws)
    for r in range(5):
        assert (probs[r, got[r]] > 0).all()
        counts = torch.bincount(got[r], minlength=30).double()
        kept = probs[r] > 0
        expected = probs[r].double() / probs[r].sum() * draws
        chi2 = float(((counts - expected)[kept] ** 2 / expected[kept]).sum())
        df = int(kept.sum()) - 1
        assert chi2 < df + 8 * math.sqrt(2 * df)


def test_draw_is_the_race_on_the_positions_noise() -> None:
    """The token drawn has the least exponential over its probability; the lowest id wins a
    tie (two tokens of one weight and noise do not occur, but the rule is fixed)."""
    probs = torch.softmax(torch.randn(64, 100) * 3, dim=-1)
    seeds, positions = torch.randint(0, 2**63 - 1, (64,)), torch.randint(0, 2**31, (64,))
    e = exponentials(token_uniforms(position_hashes(seeds, positions), torch.arange(100)))
    assert torch.equal(draw(probs, seeds, positions), (e / probs.double()).argmin(dim=-1))


def test_draw_survives_degenerate_rows() -> None:
    """An all-zero row (its last token), subnormal mass and a single kept token give valid
    tokens."""
    probs = torch.zeros(3, 6)
    probs[1, 4] = 1e-40
    probs[2, 2:] = 1e-30
    tokens = draw(probs, torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7]))
    assert tokens[0] == 5 and tokens[1] == 4 and 2 <= tokens[2] < 6


def test_filtering_among_candidates_equals_sorting_whole_rows(monkeypatch) -> None:
    """On a CPU, top-k / top-p look among each row's 256 or 4096 most likely tokens where the
    kept ones lie there: the same probabilities as sorting every whole row, for peaky rows,
    flat ones (which sort), top_p 1, and top_k past either tier."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    n, vocab = 48, 20_000
    # Every (scale, top_k) pair three times.
    scale = torch.tensor([0.3, 2.0, 4.0, 8.0]).repeat(n // 4)[:, None]
    probs = torch.softmax(torch.randn(n, vocab, generator=gen) * scale, dim=-1)
    top_ps = torch.where(torch.rand(n, generator=gen) < 0.2, 1.0, torch.rand(n, generator=gen))
    top_ks = torch.tensor([vocab, 40, 1000, 6000]).repeat_interleave(4).repeat(n // 16)
    got = sampler._top_k_top_p(probs.clone(), top_ks, top_ps)  # it filters in place
    monkeypatch.setattr(sampler, "TOP_CANDIDATES", ())
    want = sampler._top_k_top_p(probs.clone(), top_ks, top_ps)
    # The same probabilities kept; where two tokens of one probability straddle the cut (fp32
    # ties are common in the flat rows), topk and sort may each keep the other one.
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    smallest_kept = torch.where(want > 0, want, torch.inf).min(-1, keepdim=True).values
    differ = got != want
    assert torch.equal(probs[differ], smallest_kept.expand_as(probs)[differ])
    kept = (got > 0).sum(-1)
    assert (kept <= 256).any() and ((kept > 256) & (kept <= 4096)).any() and (kept > 4096).any()


def _mixed_reqs(n: int, filtered: bool) -> list[Req]:
    """Requests of random sampling parameters, some greedy; top-k / top-p only if `filtered`."""
    reqs = []
    for i in range(n):
        if random.random() < 0.3:
            params = SamplingParams(temperature=0.0)
        else:
            params = SamplingParams(
                temperature=random.uniform(0.3, 1.5),
                top_p=random.choice([1.0, 0.9, 0.5]) if filtered else 1.0,
                top_k=random.choice([-1, 5, 40]) if filtered else -1,
                min_p=random.choice([0.0, 0.0, 0.1]),
                seed=random.randrange(2**40),
            )
        reqs.append(Req(str(i), [1, 2, 3], params, sampling_seed=params.seed))
    return reqs


def test_a_graphs_packed_draw_is_the_samplers() -> None:
    """`sample_packed` (inside a draft graph: every row drawn, greedy rows' argmax taken, no
    host list) picks the token `sample` picks for every row, greedy or sampled, with or without
    filters, each row repeated as a graph's per-token rows hold it; on every draw path a CPU
    has."""
    kernels = [None, "cpu"] if sampler.cpu_ext.load() else [None]
    for kernel in kernels:
        for filtered in (False, True):
            reqs = _mixed_reqs(24, filtered)
            info = SamplingInfo.from_reqs(reqs, 97, torch.device("cpu"), draw_kernel=kernel)
            logits = torch.randn(24, 97) * torch.rand(24, 1) * 5
            at = torch.randint(0, 2**31, (24,))
            columns = torch.randperm(5000)[:97]
            want = sample(logits, info, at, columns)
            packed = info.packed(3)  # three rows per request; the graph reads the first
            first = sampler.PackedSampling(packed.floats[::3], packed.ints[::3])
            assert torch.equal(packed.floats[1::3], first.floats)
            got = sampler.sample_packed(logits, first, at, columns, filtered, kernel)
            assert torch.equal(got, want)
            greedy = torch.tensor([r.sampling_params.is_greedy for r in reqs])
            assert torch.equal(got[greedy], logits[greedy].argmax(-1))
            assert info.packed(3) is packed  # made once per batch membership

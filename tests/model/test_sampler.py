"""The sampler's target distribution: filters keep what they promise, never an empty set."""

from __future__ import annotations

import torch

from eagleserve.model.sampler import SamplingInfo, logits_to_probs, sample


def make_info(bs: int, vocab: int, top_p: float, top_k: int, min_p: float) -> SamplingInfo:
    return SamplingInfo(
        temperatures=torch.full((bs, 1), 0.7),
        top_ps=torch.full((bs,), top_p),
        top_ks=torch.full((bs,), vocab if top_k < 0 else top_k, dtype=torch.int64),
        min_ps=torch.full((bs,), min_p),
        is_greedy=[False] * bs,
        generators=[torch.Generator().manual_seed(i) for i in range(bs)],
    )


def test_tiny_top_p_keeps_the_most_likely_token() -> None:
    # 5e-324 is 0.0 in fp32: the first token must still stay (it was an all-zero row: NaN).
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 3
    for top_p in (5e-324, 1e-9):
        probs = logits_to_probs(logits, make_info(4, 50, top_p, -1, 0.0))
        assert torch.isfinite(probs).all()
        assert torch.equal(probs.argmax(-1), logits.argmax(-1))
        assert torch.allclose(probs.max(-1).values, torch.ones(4))
        assert torch.equal(sample(logits, make_info(4, 50, top_p, -1, 0.0)), logits.argmax(-1))


def test_filters_keep_the_promised_mass() -> None:
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        logits = torch.randn(3, 64, generator=gen) * 2
        top_p = float(torch.rand(1, generator=gen)) * 0.9 + 0.05
        top_k = int(torch.randint(1, 64, (1,), generator=gen))
        probs = logits_to_probs(logits, make_info(3, 64, top_p, top_k, 0.0))
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

"""Sampled rows of a verify (spec/accept.py `accept`): the walk along the target's own seeded
draws, one per node, each with the noise of the position it would sit at (one past the
node's)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_accept import _check_result, _random_parents

from eagleserve.sampling.sampling_info import SamplingInfo
from eagleserve.sampling.seeded_noise import exponentials, position_hashes, token_uniforms
from eagleserve.spec.accept import AcceptResult, accept, verify_greedy

FIELDS = ("accept_index", "accept_lens", "output_tokens", "bonus_tokens")


def _info(seeds: list[int | None], vocab: int, temperature: float = 1.0) -> SamplingInfo:
    """Plain sampling at `temperature` (no filters); a None seed is a greedy row."""
    bs = len(seeds)
    return SamplingInfo(
        temperatures=torch.full((bs, 1), temperature),
        top_ps=torch.ones(bs),
        top_ks=torch.full((bs,), vocab),
        min_ps=torch.zeros(bs),
        is_greedy=[s is None for s in seeds],
        seeds=torch.tensor([s or 0 for s in seeds]),
        needs_top_k=False,
        needs_top_p=False,
        needs_min_p=False,
    )


def _node_positions(parents: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """[bs, n]: node i's position, for roots at positions start."""
    depth = torch.zeros_like(parents)
    for i in range(1, parents.shape[1]):
        depth[:, i] = depth.gather(1, parents[:, i : i + 1].clamp(min=0))[:, 0] + 1
    return start[:, None] + depth


def _reference_draw(probs: torch.Tensor, seed: int, position: int) -> int:
    """The race: the token of mass with the least exponential over its probability, in
    Python floats."""
    row = position_hashes(torch.tensor([seed]), torch.tensor([position]))
    e = exponentials(token_uniforms(row, torch.arange(probs.numel())))[0].tolist()
    keys = [e_t / p if p > 0 else math.inf for e_t, p in zip(e, probs.double().tolist())]
    return min(range(len(keys)), key=keys.__getitem__)


def _reference_walk(tokens, parents, probs, seed, positions) -> tuple[list[int], int]:
    """From the root: the target's draw after the current node; follow the first child that
    carries it, else it is the bonus."""
    path = [0]
    while True:
        cur = path[-1]
        # The target's choice after node cur sits one past it.
        choice = _reference_draw(probs[cur], seed, int(positions[cur]) + 1)
        kids = [c for c in range(len(tokens)) if parents[c] == cur and tokens[c] == choice]
        if not kids:
            return path, choice
        path.append(kids[0])


@pytest.mark.parametrize(("n", "vocab", "chain"), [(4, 5, True), (7, 4, False), (12, 3, False)])
def test_sampled_walk_matches_reference(n: int, vocab: int, chain: bool) -> None:
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    bs = 48
    parents = _random_parents(bs, n, gen, chain)
    tokens = torch.randint(0, vocab, (bs, n), generator=gen)
    logits = torch.randn(bs, n, vocab, generator=gen) * 2
    seeds = [random.randrange(2**63) for _ in range(bs)]
    positions = _node_positions(parents, torch.randint(1, 5000, (bs,), generator=gen))
    res = accept(_info(seeds, vocab), tokens, parents, logits, positions, chain=chain)
    _check_result(res, bs, n)
    probs = torch.softmax(logits.double(), dim=-1)
    for b in range(bs):
        path, bonus = _reference_walk(
            tokens[b].tolist(), parents[b].tolist(), probs[b], seeds[b], positions[b]
        )
        assert res.accept_index[b, : len(path)].tolist() == path
        assert res.accept_lens[b] == len(path)
        assert res.bonus_tokens[b] == bonus


def test_sampling_from_a_one_hot_distribution_is_greedy() -> None:
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    bs, n, vocab = 128, 9, 3
    parents = _random_parents(bs, n, gen, chain=False)
    tokens = torch.randint(0, vocab, (bs, n), generator=gen)
    predict = torch.randint(0, vocab, (bs, n), generator=gen)
    logits = torch.where(torch.nn.functional.one_hot(predict, vocab).bool(), 0.0, -math.inf)
    seeds = [random.randrange(2**63) for _ in range(bs)]
    positions = _node_positions(parents, torch.randint(1, 100, (bs,), generator=gen))
    sampled = accept(_info(seeds, vocab), tokens, parents, logits, positions)
    greedy = verify_greedy(tokens, parents, predict)
    for name in FIELDS:
        assert torch.equal(getattr(greedy, name), getattr(sampled, name)), name


def test_a_seeded_row_ignores_its_batch_company() -> None:
    """Rows keep their result with other rows around them, greedy or unseeded, in any order;
    other seeds give other draws."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    bs, n, vocab = 6, 6, 8
    parents = _random_parents(bs, n, gen, chain=False)
    tokens = torch.randint(0, vocab, (bs, n), generator=gen)
    logits = torch.randn(bs, n, vocab, generator=gen)
    positions = _node_positions(parents, torch.randint(1, 100, (bs,), generator=gen))
    seeds = [random.randrange(2**63) for _ in range(bs)]

    def run(row_seeds: list[int | None], rows: list[int]) -> AcceptResult:
        info = _info(row_seeds, vocab)
        return accept(info, tokens[rows], parents[rows], logits[rows], positions[rows])

    rows = list(range(bs))
    a = run(list(seeds), rows)
    c = run([None, seeds[3], seeds[0], random.randrange(2**63)], [1, 3, 0, 5])
    for j, r in enumerate([3, 0]):
        for name in FIELDS:
            assert torch.equal(getattr(c, name)[j + 1], getattr(a, name)[r]), name
    outs = {tuple(run([s] * bs, rows).output_tokens.flatten().tolist()) for s in range(20)}
    assert len(outs) > 10


def test_sampled_acceptance_is_the_target_distribution_and_skips_duplicates() -> None:
    """Root children carry tokens [2, 2, 0]: the second 2 is never taken; the first committed
    token follows the target (total variation bound), and a draft is accepted with the target
    probability of the children's distinct tokens (0.4 + 0.15)."""
    bs, vocab = 40000, 5
    parents = torch.tensor([-1, 0, 0, 0]).repeat(bs, 1)
    tokens = torch.tensor([1, 2, 2, 0]).repeat(bs, 1)
    target = torch.tensor([0.15, 0.05, 0.4, 0.1, 0.3])
    logits = torch.randn(4, vocab).repeat(bs, 1, 1)
    logits[:, 0] = target.log()
    seeds = [random.randrange(2**63) for _ in range(bs)]
    positions = _node_positions(parents, torch.randint(1, 10**6, (bs,)))
    res = accept(_info(seeds, vocab), tokens, parents, logits, positions)
    assert not (res.accept_index == 2).any()
    first = res.output_tokens[:, 0]
    freq = torch.bincount(first, minlength=vocab).double() / bs
    bound = 0.5 * sum(math.sqrt(p * (1 - p) / bs) for p in target.tolist())
    bound += math.sqrt(math.log(1e6) / (2 * bs))
    assert 0.5 * (freq - target.double()).abs().sum() < bound
    accepted = float((res.accept_lens > 1).double().mean())
    assert abs(accepted - 0.55) < 5 * math.sqrt(0.55 * 0.45 / bs)

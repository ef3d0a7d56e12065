"""Adaptive speculation's pure parts: expected tokens, the acceptance EMA, the choice of k."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from eagleserve.spec.adaptive import (
    ACCEPT_EMA,
    ACCEPT_PRIOR,
    DRAFT_MARGIN,
    MAX_PROBE_BACKOFF,
    PROBE_SHARE,
    AdaptiveController,
    CostTable,
    acceptance_prior,
    choose_num_drafts,
    depth_choices,
    expected_tokens,
    update_acceptance,
)
from eagleserve.spec.head_loader import measured_acceptance

CHAIN = depth_choices(3, is_chain=True)


def simulate_tokens(alphas: list[float], k: int, rng: random.Random, n: int) -> float:
    """Mean committed tokens of n simulated k-chains (the bonus token always counts)."""
    total = 0
    for _ in range(n):
        accepted = 0
        while accepted < k and rng.random() < alphas[accepted]:
            accepted += 1
        total += accepted + 1
    return total / n


@pytest.mark.parametrize("seed", range(4))
def test_expected_tokens_matches_simulation(seed: int) -> None:
    rng = random.Random(seed)
    alphas = [rng.uniform(0.1, 0.95) for _ in range(4)]
    every_k = expected_tokens(alphas, 4)
    assert len(every_k) == 5 and every_k[0] == 1.0
    for k in range(5):
        sim = simulate_tokens(alphas, k, rng, 40_000)
        assert every_k[k] == pytest.approx(sim, abs=0.03)
        assert expected_tokens(alphas, k) == every_k[: k + 1]  # a shallower depth, a prefix


def test_acceptance_ema_converges_to_per_depth_rates() -> None:
    rng = random.Random(7)
    true = [0.8, 0.5, 0.2]
    alphas = [0.5, 0.5, 0.5]
    hits, seen = [0.0] * 3, [0] * 3
    for _ in range(3000):
        accepted = 0
        while accepted < 3 and rng.random() < true[accepted]:
            accepted += 1
        update_acceptance(alphas, 3, accepted)
        for d in range(min(accepted + 1, 3)):
            seen[d] += 1
            hits[d] += d < accepted
    for d in range(3):
        assert alphas[d] == pytest.approx(true[d], abs=0.25)  # an EMA: noisy, but close
        assert hits[d] / seen[d] == pytest.approx(true[d], abs=0.05)


def test_acceptance_update_touches_only_judged_depths() -> None:
    alphas = [0.3, 0.6, 0.9]
    update_acceptance(alphas, 3, 1)  # depth 0 accepted, depth 1 rejected, depth 2 not judged
    assert alphas[0] == pytest.approx(0.3 + ACCEPT_EMA * 0.7)
    assert alphas[1] == pytest.approx(0.6 - ACCEPT_EMA * 0.6)
    assert alphas[2] == 0.9
    before = list(alphas)
    update_acceptance(alphas, 0, 0)  # a plain decode judges nothing
    assert alphas == before


def table(costs: list[float]) -> CostTable:
    t = CostTable((1, 4))
    for bs in (1, 4):
        for k, c in enumerate(costs):
            t.seconds[(bs, k)] = c * bs
    return t


def test_choice_follows_acceptance_and_cost() -> None:
    costs = table([1.0, 1.3, 1.6, 1.9])
    # Drafts that are rarely right do not pay for their cost: plain decode.
    assert choose_num_drafts([[0.1] * 3] * 4, costs, CHAIN) == 0
    # Drafts that are nearly always right: the full chain (E[3] = 3.7 in 1.9 time).
    assert choose_num_drafts([[0.95] * 3] * 4, costs, CHAIN) == 3
    # Acceptance that falls with depth: a short chain.
    assert choose_num_drafts([[0.9, 0.2, 0.1]] * 4, costs, CHAIN) == 1
    # Free drafting: any acceptance at all makes the full chain best.
    free = table([1.0, 1.0, 1.0, 1.0])
    assert choose_num_drafts([[0.2] * 3], free, CHAIN) == 3
    # A tie (E[1] / cost(1) == E[0] / cost(0)) goes to the shorter chain.
    assert choose_num_drafts([[0.3] * 3], costs, CHAIN) == 0


def test_choice_is_the_argmax_on_random_inputs() -> None:
    rng = random.Random(11)
    for _ in range(200):
        costs = table(sorted(rng.uniform(0.5, 3.0) for _ in range(4)))
        alphas = [[rng.random() for _ in range(3)] for _ in range(rng.randint(1, 4))]
        k = choose_num_drafts(alphas, costs, CHAIN)
        rates = [
            sum(expected_tokens(a, j)[j] for a in alphas) / costs.cost(len(alphas), j)
            for j in range(4)
        ]
        rates[0] *= 1 + DRAFT_MARGIN  # a draft must beat a plain decode by the margin
        assert rates[k] >= max(rates) * (1 - 1e-9)


def test_a_draft_must_beat_a_plain_decode_by_the_margin() -> None:
    """k = 1 promising r times the tokens per second of a plain decode is chosen only for
    r > 1 + DRAFT_MARGIN (estimates that promise less are as likely to lose)."""
    rng = random.Random()
    for _ in range(100):
        alpha = rng.uniform(0.05, 0.95)
        r = rng.uniform(0.9, 1.2)
        if abs(r - 1 - DRAFT_MARGIN) < 1e-6:
            continue
        costs = table([1.0, (1 + alpha) / r, 99.0, 99.0])  # E[1] / cost(1) = r * E[0] / cost(0)
        k = choose_num_drafts([[alpha, 0.0, 0.0]], costs, CHAIN)
        assert k == (1 if r > 1 + DRAFT_MARGIN else 0), (alpha, r)


def probe_gaps(ctl: AdaptiveController, alphas: list[float], n: int) -> list[int]:
    """Iterations from one probe (or start) to the next, over n choices at `alphas`."""
    gaps, last = [], 0
    for i in range(1, n + 1):
        k = ctl.choose([alphas])
        assert k in (0, 1), k
        if k:
            gaps.append(i - last)
            last = i
    return gaps


def test_controller_probes_the_shallowest_depth() -> None:
    """With no acceptance to speak of, a draft at depth 1 after `probe_interval` iterations
    while a probe is cheap; where a probe (depth 1 plus its catch-up) costs more, after more, so
    that probes add at most PROBE_SHARE to the decodes between them; and each probe that does
    not end the stretch doubles it, up to MAX_PROBE_BACKOFF times."""
    rng = random.Random()
    shortest = rng.randrange(3, 9)
    cheap = table([1.0, 1.0 + PROBE_SHARE * shortest * rng.uniform(0.2, 0.9), 1.6, 1.9])
    costly = table([1.0, rng.uniform(1.2, 1.5), 1.6, 1.9])
    costly.catch_up = {1: rng.uniform(0.1, 0.4)}
    stretches = [2**i for i in range(MAX_PROBE_BACKOFF.bit_length())]  # 1, 2, ..., the most
    stretches += [MAX_PROBE_BACKOFF] * 2  # ...and no further
    for costs, every in (
        (cheap, shortest),
        (costly, math.ceil((costly.cost(1, 1, catching_up=True) - 1.0) / PROBE_SHARE)),
    ):
        ctl = AdaptiveController(costs, CHAIN, probe_interval=shortest)
        gaps = probe_gaps(ctl, [0.05] * 3, every * sum(stretches))
        assert gaps == [every * s for s in stretches]


def test_a_draft_by_choice_restarts_the_probes() -> None:
    ctl = AdaptiveController(table([1.0, 1.01, 1.6, 1.9]), CHAIN, probe_interval=4)
    assert probe_gaps(ctl, [0.05] * 3, 4 + 8 + 16) == [4, 8, 16]
    assert ctl.choose([[0.99] * 3]) == 3  # pays by itself: the stretch starts over, unstretched
    assert probe_gaps(ctl, [0.05] * 3, 4) == [4]
    picks = [ctl.choose([[0.05] * 3]) for _ in range(3)] + [ctl.choose([[0.99] * 3])]
    assert picks == [0, 0, 0, 3]  # a draft by choice before the probe was due


def test_cost_table_buckets_and_ema() -> None:
    """Measured iterations scale their whole bucket: a depth the controller does not run keeps
    its start-up ratio to the ones it does, rather than its start-up figure."""
    t = CostTable((1, 2, 4, 8))
    rng = random.Random()
    start = {k: rng.uniform(0.5, 2.0) for k in range(3)}
    for k, c in start.items():
        t.seconds[(4, k)] = c
    t.seconds[(8, 0)] = 9.0
    assert t.bucket(3) == 4 and t.bucket(8) == 8 and t.bucket(50) == 8
    ratio = rng.uniform(1.1, 1.5)
    t.observe(3, 0, start[0] * ratio)  # the first measurement sets the scale
    assert [t.cost(4, k) for k in range(3)] == pytest.approx([c * ratio for c in start.values()])
    t.observe(4, 2, start[2] * 2.0)
    scaled = ratio + 0.1 * (2.0 - ratio)
    assert t.cost(4, 1) == pytest.approx(start[1] * scaled)
    assert t.cost(8, 0) == 9.0  # other buckets untouched


def test_a_tree_is_drafted_whole_or_not_at_all() -> None:
    assert CHAIN == (0, 1, 2, 3)
    tree = depth_choices(3, is_chain=False)
    assert tree == (0, 3)
    costs = table([1.0, 1.1, 1.2, 1.3])
    # Acceptance that would make a 1-deep chain best: a tree can only go all the way.
    assert choose_num_drafts([[0.9, 0.05, 0.05]], costs, CHAIN) == 1
    assert choose_num_drafts([[0.9, 0.05, 0.05]], costs, tree) == 3
    assert choose_num_drafts([[0.1, 0.05, 0.05]], costs, tree) == 0


def test_catch_up_cost_keeps_a_stretch_without_drafts_going() -> None:
    costs = table([1.0, 1.2, 1.4, 1.6])
    costs.catch_up = {1: 0.3, 4: 1.2}
    alphas = [[0.3, 0.1, 0.1]]  # E[1] = 1.3 in 1.2: drafting pays a little
    assert choose_num_drafts(alphas, costs, CHAIN) == 1
    # ...but not when it first has to catch up held inputs (1.3 in 1.5).
    assert choose_num_drafts(alphas, costs, CHAIN, catching_up=True) == 0
    assert costs.cost(1, 0, catching_up=True) == 1.0  # a plain decode never catches up
    costs.observe_catch_up(1, 0.5)
    assert costs.catch_up[1] == pytest.approx(0.32)


def test_acceptance_prior_starts_from_the_measured_depths() -> None:
    rng = random.Random()
    measured = [rng.uniform(0.05, 0.9) for _ in range(rng.randrange(1, 4))]
    steps = len(measured) + 2
    prior = acceptance_prior(measured, steps)
    assert prior[: len(measured)] == pytest.approx(measured)
    assert prior[len(measured) :] == pytest.approx([measured[-1]] * 2)  # deepest measured
    assert acceptance_prior([0.0, 1.0], 2) == [0.01, 0.99]  # no depth written off or certain
    assert acceptance_prior(None, 3) == [ACCEPT_PRIOR] * 3


def test_measured_acceptance_reads_the_training_log(tmp_path: Path) -> None:
    assert measured_acceptance(str(tmp_path)) is None
    rng = random.Random()
    accs = [rng.uniform(0.05, 0.9) for _ in range(3)]
    log = {"val_accuracy_by_depth": {f"acc{d}": a for d, a in enumerate(accs)} | {"other": 0.5}}
    (tmp_path / "training_log.json").write_text(json.dumps(log))
    assert measured_acceptance(str(tmp_path)) == pytest.approx(accs)

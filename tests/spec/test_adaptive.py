"""Adaptive speculation's pure parts: expected tokens, the acceptance estimates, the choice of k,
and the controller and its estimates together on simulated drafts."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from test_cost_table import table

from eagleserve.spec.adaptive import (
    ACCEPT_PRIOR,
    DRAFT_MARGIN,
    ENGINE_ACCEPT_EMA,
    EVIDENCE_DECAY,
    MAX_PROBE_BACKOFF,
    PRIOR_TRIALS,
    PRIOR_VERIFIES,
    PROBE_SHARE,
    WARM_DECODES,
    AdaptiveController,
    acceptance_prior,
    choose_num_drafts,
    depth_choices,
    expected_tokens,
    record_verify,
    request_acceptance,
    update_acceptance,
)
from eagleserve.spec.cost_table import STALE_WEIGHT, CostTable
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
    alphas, judged = [0.5, 0.5, 0.5], [0, 0, 0]
    hits, seen = [0.0] * 3, [0] * 3
    for _ in range(3000):
        accepted = 0
        while accepted < 3 and rng.random() < true[accepted]:
            accepted += 1
        update_acceptance(alphas, judged, 3, accepted)
        for d in range(min(accepted + 1, 3)):
            seen[d] += 1
            hits[d] += d < accepted
    assert judged == seen
    for d in range(3):
        assert alphas[d] == pytest.approx(true[d], abs=0.12)  # an EMA: noisy, but close
        assert hits[d] / seen[d] == pytest.approx(true[d], abs=0.05)


def test_acceptance_update_touches_only_judged_depths() -> None:
    alphas, judged = [0.3, 0.6, 0.9], [0, 5000, 7]
    update_acceptance(alphas, judged, 3, 1)  # depth 0 accepted, 1 rejected, 2 not judged
    # The start weighs PRIOR_VERIFIES verifies; a long-judged depth moves by the EMA's weight.
    assert alphas[0] == pytest.approx(0.3 + 0.7 / (1 + PRIOR_VERIFIES))
    assert alphas[1] == pytest.approx(0.6 - ENGINE_ACCEPT_EMA * 0.6)
    assert (alphas[2], judged) == (0.9, [1, 5001, 7])
    before = list(alphas)
    update_acceptance(alphas, judged, 0, 0)  # a plain decode judges nothing
    assert alphas == before
    hits, trials = [0.0] * 3, [0.0] * 3  # a request's evidence: the same depths judged
    record_verify(hits, trials, 3, 1)
    assert (hits, trials) == ([1.0, 0.0, 0.0], [1.0, 1.0, 0.0])
    record_verify(hits, trials, 2, 2)  # both drafts accepted: no depth rejected
    record_verify(hits, trials, 0, 0)
    assert (hits, trials) == ([2.0, 1.0, 0.0], [2.0, 2.0, 0.0])


def test_request_acceptance_is_its_own_evidence_shrunk_towards_the_engines() -> None:
    """No evidence: the engine's rate. Much evidence: the request's own rate. Evidence that is
    no longer renewed (the request stopped drafting) fades back to the engine's rate."""
    rng = random.Random()
    engine = [rng.uniform(0.3, 0.8) for _ in range(3)]
    own = [rng.uniform(0.0, 1.0) for _ in range(3)]
    hits, trials = [0.0] * 3, [0.0] * 3
    assert request_acceptance(hits, trials, engine) == pytest.approx(engine)
    steady = 1 / (1 - EVIDENCE_DECAY)  # trials' weight once aged evidence balances new
    mean = [0.0] * 3
    for i in range(400):  # every depth judged each iteration, at the request's own rate
        alphas = request_acceptance(hits, trials, engine)
        if i >= 100:
            mean = [m + a / 300 for m, a in zip(mean, alphas)]
        for d in range(3):
            hits[d] += rng.random() < own[d]
            trials[d] += 1
    assert trials[0] == pytest.approx(steady, rel=1e-6)
    for d in range(3):  # the request's rate, pulled towards the engine's by PRIOR_TRIALS
        aged = steady * EVIDENCE_DECAY
        mixed = (PRIOR_TRIALS * engine[d] + aged * own[d]) / (PRIOR_TRIALS + aged)
        assert mean[d] == pytest.approx(mixed, abs=0.06)
    for _ in range(60):
        alphas = request_acceptance(hits, trials, engine)
    assert alphas == pytest.approx(engine, abs=0.01)


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


def drafting_share(rates: list[float], costs: CostTable, seed: int) -> float:
    """The share of decode iterations that drafted, over 60 requests of 48 tokens one after
    another at batch 1, each draft at depth d accepted with probability rates[d] (given the
    ones before it were): the controller, the requests' evidence and the engine-wide rate
    (starting from a held-out accuracy above the live one, as a trained head's does), as the
    worker and the scheduler run them."""
    rng = random.Random(seed)
    engine, judged = acceptance_prior([0.7, 0.65, 0.6], 3), [0, 0, 0]
    ctl = AdaptiveController(costs, CHAIN, probe_interval=64)
    drafted = iterations = 0
    for _ in range(60):
        hits, trials = [0.0] * 3, [0.0] * 3
        left = 48
        while left > 0:
            k = ctl.choose([request_acceptance(hits, trials, engine)])
            accepted = 0
            while accepted < k and rng.random() < rates[accepted]:
                accepted += 1
            if k:
                record_verify(hits, trials, k, accepted)
                update_acceptance(engine, judged, k, accepted)
            left -= accepted + 1
            iterations += 1
            drafted += k > 0
    return drafted / iterations


@pytest.mark.parametrize("seed", range(3))
def test_drafting_goes_on_where_it_pays_and_stops_where_it_does_not(seed: int) -> None:
    """Costs as on a CPU (a 3-chain iteration ~1.8 decodes): with live acceptance 0.5 at depth
    0 a 1-chain pays by ~1.15x, and the controller must keep drafting through the runs of
    rejections that i.i.d. drafts have (where estimates that follow the last few verifies
    fall below break-even, stop drafting and are no longer corrected); at 0.2 it must not
    draft beyond its probes."""
    costs = table([1.0, 1.28, 1.53, 1.77])
    rng = random.Random(seed)
    pays = [rng.uniform(0.48, 0.55), rng.uniform(0.6, 0.7), rng.uniform(0.45, 0.55)]
    assert drafting_share(pays, costs, seed) > 0.9
    assert drafting_share([0.2, 0.3, 0.3], costs, seed) < 0.05


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
    """Resuming drafting pays the resume, spread over RESUME_HORIZON iterations; a probe's
    price (`cost(catching_up=True)`) is all of it."""
    costs = table([1.0, 1.2, 1.4, 1.6])
    costs.catch_up = {1: 1.2, 4: 4.0}
    alphas = [[0.3, 0.1, 0.1]]  # E[1] = 1.3 in 1.2: drafting pays a little
    assert choose_num_drafts(alphas, costs, CHAIN) == 1
    # ...but not when it first has to catch up held inputs (1.3 in 1.2 + 1.2 / 4).
    assert choose_num_drafts(alphas, costs, CHAIN, catching_up=True) == 0
    # Where drafting pays well, a resume spread over a run of drafts does not stop it.
    assert choose_num_drafts([[0.6, 0.5, 0.4]], costs, CHAIN, catching_up=True) == 2
    assert costs.cost(1, 2, catching_up=True) == pytest.approx(1.4 + 1.2)
    assert costs.cost(1, 0, catching_up=True) == 1.0  # a plain decode never catches up


def test_a_start_up_table_that_overprices_drafting_is_corrected_by_the_probes() -> None:
    """A start-up table timed while the host ran slow can price drafting at twice what it
    costs; a controller that believes it never drafts by choice, and its probes resume held
    inputs, so they price the resume alone. A probe that costs less than a steady iteration
    is priced shows the price too high: it refines the drafting scale, and where drafting
    pays the controller drafts nearly throughout within a few probes."""
    rng = random.Random()
    true = [1.0, 1.25, 1.35, 1.5]
    costs = table([1.0] + [2 * c for c in true[1:]])  # drafting timed at twice its cost
    ctl = AdaptiveController(costs, CHAIN, probe_interval=64)
    alphas = [0.62, 0.57, 0.3]  # E[2] = 1.97 tokens in 1.35 decodes: drafting pays
    resume = rng.uniform(0.05, 0.15)
    picks, last = [], 0
    for _ in range(1500):
        catching_up = last == 0
        k = ctl.choose([alphas], catching_up)
        seconds = true[k] * rng.uniform(0.97, 1.03) + (resume if k and catching_up else 0.0)
        ctl.observe(1, k, seconds, resumed=bool(k) and catching_up)
        picks.append(k)
        last = k
    assert sum(k > 0 for k in picks[:64]) <= 1  # at first, only the probe drafts
    assert sum(k > 0 for k in picks[750:]) / 750 >= 0.9
    assert costs.cost(1, 2) == pytest.approx(true[2], rel=0.1)


def simulate_costs(costs: CostTable, true: list[float], alphas: list[float], n: int) -> list[int]:
    """The controller's k over n iterations at batch 1, each measured at its true cost."""
    ctl = AdaptiveController(costs, CHAIN, probe_interval=64)
    picks = []
    for _ in range(n):
        k = ctl.choose([alphas])
        costs.observe(1, k, true[k] * random.uniform(0.97, 1.03))
        picks.append(k)
    return picks


def test_drafting_stops_once_a_plain_decode_is_measured_cheaper_than_it_first_was() -> None:
    """The first plain decodes measured slow (a cold start: 30-45 % over the truth), drafting
    that does not pay looks as if it did and runs; a drafting controller's plain probes measure
    the decode again, and within a few stretches it stops drafting. Where drafting does pay,
    the probes cost about one plain decode a stretch."""
    rng = random.Random()
    true = [1.0, 1.45, 1.7, 1.95]
    alphas = [0.4, 0.5, 0.3]  # E[2] = 1.6 in 1.7 decodes: drafting loses
    costs = table(true)
    for _ in range(20):
        costs.observe(1, 0, rng.uniform(1.3, 1.45))  # cold
    for _ in range(20):
        costs.observe(1, 2, true[2])  # drafting iterations, measured at their truth
    picks = simulate_costs(costs, true, alphas, 64 * 8)
    assert picks[0] > 0  # the cold decode makes drafting look worth it...
    assert 0 in picks, "no plain decode measured again: drafting for good"
    # ...until the probes measure it again: stopped within four stretches, and since then
    # drafting only in the k > 0 probes.
    assert sum(k > 0 for k in picks[64 * 4 :]) <= 4
    paying = [0.7, 0.6, 0.5]  # E[3] = 2.09 in 1.95 decodes
    picks = simulate_costs(table(true), true, paying, 64 * 8)
    assert 0.97 <= sum(k > 0 for k in picks) / len(picks) < 1.0


def test_the_decodes_right_after_a_prefill_are_not_measured() -> None:
    """The decodes after a prefill run slow for a while (the memory system warming up): the
    first WARM_DECODES decode iterations after it leave the cost table as it was, whatever
    they took; the next one is measured."""
    rng = random.Random()
    costs = table([1.0, 1.45, 1.7, 1.95])
    ctl = AdaptiveController(costs, CHAIN, probe_interval=64)
    for _ in range(2):  # and again after the next prefill
        ctl.note_prefill()
        for _ in range(WARM_DECODES):
            ctl.observe(1, rng.choice(CHAIN), rng.uniform(1.3, 3.0))
        assert costs.scale == {} and costs.catch_up == {}
        ctl.observe(1, 0, 1.1)  # from the start-up table's 1 towards 1.1, nothing cold in it
        assert 1.0 < costs.cost(1, 0) <= 1 + STALE_WEIGHT * 0.1 + 1e-9
        costs.scale.clear()


def serve(
    ctl: AdaptiveController, true: list[float], alphas: list[float], requests: int
) -> list[int]:
    """The controller's k over `requests` requests of 48 decode iterations each at batch 1, a
    prefill before each; an iteration costs its truth, times 1.45 right after the prefill,
    fading to 1 over twelve iterations (the memory system warming up)."""
    picks = []
    for _ in range(requests):
        ctl.note_prefill()
        for i in range(48):
            k = ctl.choose([alphas])
            cold = 1 + 0.45 * max(0.0, 1 - i / 12)
            ctl.observe(1, k, true[k] * cold * random.uniform(0.97, 1.03))
            picks.append(k)
    return picks


def test_a_cold_start_after_each_prefill_does_not_make_drafting_look_worth_it() -> None:
    """Every request's first decodes run slow, whatever they draft; drafting iterations come
    mostly later in a stretch. Priced from warm iterations alone, a plain decode costs what it
    does once warm, and where drafting gains nothing the controller drafts only in its probes
    (measuring every iteration, it drafted on 2-12 % of them); where it pays, it drafts nearly
    throughout."""
    true = [1.0, 1.45, 1.7, 1.95]
    costs = table(true)
    ctl = AdaptiveController(costs, CHAIN, probe_interval=64)
    # E[1] = 1.45 tokens in 1.45 decodes, E[2] = 1.675 in 1.7: drafting gains nothing.
    picks = serve(ctl, true, [0.45, 0.5, 0.3], 40)
    assert costs.cost(1, 0) == pytest.approx(true[0], rel=0.04)
    assert sum(k > 0 for k in picks) <= len(picks) // 100
    ctl = AdaptiveController(table(true), CHAIN, probe_interval=64)
    picks = serve(ctl, true, [0.7, 0.6, 0.5], 40)  # E[3] = 2.09 in 1.95 decodes
    assert sum(k > 0 for k in picks) / len(picks) >= 0.95


def test_a_controller_whose_iterations_are_not_timed_makes_no_plain_probes() -> None:
    """An accelerator's iterations run asynchronously and are not timed: a plain probe would
    measure nothing, so a drafting controller there drafts every iteration it chooses to."""
    ctl = AdaptiveController(table([1.0, 1.45, 1.7, 1.95]), CHAIN, 64, plain_probes=False)
    assert all(ctl.choose([[0.7, 0.6, 0.5]]) for _ in range(64 * 4))


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
    # A log that also scores every answer row (a token outside the draft vocabulary a miss):
    # that is what serving accepts.
    every = [a * rng.uniform(0.8, 1.0) for a in accs]
    log["val_accuracy_by_depth"] |= {f"acc{d}_all": a for d, a in enumerate(every)}
    (tmp_path / "training_log.json").write_text(json.dumps(log))
    assert measured_acceptance(str(tmp_path)) == pytest.approx(every)


def test_the_hosts_time_between_forwards_weighs_for_drafting() -> None:
    """A first draft accepted at rate a commits 1 + a tokens where a plain decode commits 1: where
    its forward costs too much more to pay alone, the host's time between forwards, which both
    pay, makes it pay. The controller measures that time between its decode forwards, not
    across a prefill."""
    rng = random.Random()
    alpha = rng.uniform(0.4, 0.8)
    draft = (1 + alpha) * rng.uniform(1.0, 1.0 + DRAFT_MARGIN / 2)  # E[1] / cost(1) < 1.05 E[0]
    ctl = AdaptiveController(table([1.0, draft, 99.0, 99.0]), CHAIN, probe_interval=10**6)
    alphas = [[alpha, 0.0, 0.0]]
    assert ctl.choose(alphas) == 0
    # Host work between forwards as long as a decode: 1 + alpha tokens in draft + 1 against
    # 1 in 2, well over the margin.
    end = 0.0
    ctl.note_prefill()
    for _ in range(60):
        ctl.note_forward(1, end + 1.0, end + 2.0)
        end += 2.0
    assert ctl.costs.between[1] == pytest.approx(1.0)
    assert ctl.choose(alphas) == 1
    # A prefill between two decode forwards: that gap is not the host's work of an iteration.
    ctl.note_prefill()
    ctl.note_forward(1, end + 2.5, end + 3.5)
    assert ctl.costs.between[1] == pytest.approx(1.0)

"""The price of one decode iteration (spec/cost_table.py): the start-up table's figures scaled
per batch bucket by measured iterations, plain decodes and drafting apart, as the host's speed
moves."""

from __future__ import annotations

import random

import pytest

from eagleserve.spec.cost_table import (
    COST_EMA,
    PAUSE_DECODES,
    SETTLE_DECODES,
    STALE_AFTER,
    STALE_WEIGHT,
    CostTable,
)


def table(costs: list[float]) -> CostTable:
    t = CostTable((1, 4))
    for bs in (1, 4):
        for k, c in enumerate(costs):
            t.seconds[(bs, k)] = c * bs
    return t


def test_cost_table_buckets_and_ema() -> None:
    """Measured plain decodes scale their whole bucket until it drafts; measured drafting
    iterations then scale every drafting depth (a depth the controller does not run keeps its
    start-up ratio to the ones it does), and plain decodes keep their own scale. A scale's
    first measurement moves it from its prior (1, the start-up table; for drafting, the decode
    scale) by STALE_WEIGHT, later consecutive ones by COST_EMA."""
    t = CostTable((1, 2, 4, 8))
    rng = random.Random()
    start = {k: rng.uniform(0.5, 2.0) for k in range(4)}
    for k, c in start.items():
        t.seconds[(4, k)] = c
    t.seconds[(8, 0)] = 9.0
    assert t.bucket(3) == 4 and t.bucket(8) == 8 and t.bucket(50) == 8
    ratio = rng.uniform(1.1, 1.5)
    t.observe(3, 0, start[0] * ratio)
    decode = 1 + STALE_WEIGHT * (ratio - 1)
    assert [t.cost(4, k) for k in range(4)] == pytest.approx([c * decode for c in start.values()])
    measured = rng.uniform(1.6, 2.0)
    t.observe(4, 2, start[2] * measured)  # a drafting iteration: its own scale from here
    drafting = decode + STALE_WEIGHT * (measured - decode)
    assert t.cost(4, 0) == pytest.approx(start[0] * decode)
    drafted = [t.cost(4, k) for k in (1, 3)]
    assert drafted == pytest.approx([start[1] * drafting, start[3] * drafting])
    t.observe(4, 3, start[3] * 2.5)
    assert t.cost(4, 1) == pytest.approx(start[1] * (drafting + COST_EMA * (2.5 - drafting)))
    assert t.cost(8, 0) == 9.0 and t.cost(8, 0, catching_up=True) == 9.0  # others untouched


@pytest.mark.parametrize("follows", [True, False])
def test_a_host_that_speeds_up_while_not_drafting_lowers_the_drafting_price_too(
    follows: bool,
) -> None:
    """Drafting measured in a slow minute, then only plain decodes measured as the host speeds
    up by a random factor: drafting's price follows the decode's, their ratio as measured
    (with `drafting_follows_decode` off, as before, drafting keeps the slow minute's price)."""
    rng = random.Random()
    start = [1.0, rng.uniform(1.2, 1.5), rng.uniform(1.5, 1.8), rng.uniform(1.8, 2.1)]
    costs = table(start)
    costs.drafting_follows_decode = follows
    slow, over = rng.uniform(1.3, 1.6), rng.uniform(0.9, 1.2)  # drafting's extra work: `over`
    for _ in range(200):
        costs.observe(1, 0, start[0] * slow)
        costs.observe(1, 2, start[2] * slow * over)
    ratio = [costs.cost(1, k) / costs.cost(1, 0) for k in range(4)]
    assert ratio == pytest.approx([s * over if k else 1.0 for k, s in enumerate(start)], rel=1e-3)
    fast = rng.uniform(0.6, 0.8)
    for _ in range(200):
        costs.observe(1, 0, start[0] * fast)
    assert costs.cost(1, 0) == pytest.approx(start[0] * fast, rel=1e-3)
    drafting = [costs.cost(1, k) for k in (1, 2, 3)]
    per_second = fast if follows else slow  # the host's speed drafting is priced at
    assert drafting == pytest.approx([s * per_second * over for s in start[1:]], rel=1e-3)


def test_the_first_decodes_correct_the_table_without_moving_drafting_price() -> None:
    """A controller that drafts from its first iteration measures drafting before any decode:
    the decode measurements that follow first correct the start-up table's decode figure (its
    own error, not the host's speed), and drafting's price stays as measured meanwhile; after
    SETTLE_DECODES of them, drafting follows the decode's scale again."""
    rng = random.Random()
    start = [1.0, 1.4, 1.7, 2.0]
    costs = table(start)
    drafted = rng.uniform(1.1, 1.3)  # a 2-chain's measured over its start-up figure
    for _ in range(100):
        costs.observe(1, 2, start[2] * drafted)
    price = costs.cost(1, 2)
    assert price == pytest.approx(start[2] * drafted, rel=1e-3)
    error = rng.uniform(0.7, 0.9)  # the start-up table's decode figure was this far off
    for _ in range(SETTLE_DECODES):
        costs.observe(1, 0, start[0] * error)
    assert costs.cost(1, 0) < start[0] * 0.95  # corrected (most of the way)...
    assert costs.cost(1, 2) == pytest.approx(price)  # ...and drafting's price untouched
    decode = costs.cost(1, 0)
    costs.observe(1, 0, decode * 0.5)  # the host speeds up
    assert costs.cost(1, 2) / costs.cost(1, 0) == pytest.approx(price / decode)


def test_a_resumed_iteration_prices_the_resume_not_the_depth() -> None:
    """A drafting iteration that caught up held inputs first (after plain decodes had the
    caches) costs more than a steady one: its excess is the resume's cost, and the drafting
    scale stays what steady iterations measured; the first probes after a stretch would
    otherwise price every drafting iteration as a resume and end drafting for good."""
    rng = random.Random()
    costs = table([1.0, 1.3, 1.5, 1.8])
    costs.observe(1, 0, 1.0)
    for _ in range(60):  # steady 3-chains: 10 % over their start-up figure
        costs.observe(1, 3, 1.8 * 1.1)
    resume = rng.uniform(0.3, 0.8)
    for _ in range(50):
        costs.observe(1, 1, 1.3 * 1.1 + resume, resumed=True)  # probes
    assert costs.cost(1, 1) == pytest.approx(1.3 * 1.1, rel=1e-3)
    assert costs.cost(1, 1, catching_up=True) == pytest.approx(1.3 * 1.1 + resume, rel=0.01)
    costs.observe(1, 0, 0.9, resumed=True)  # a plain decode resumes nothing...
    # ...and its scale, last measured 51 iterations earlier, takes it at STALE_WEIGHT.
    assert costs.cost(1, 0) == pytest.approx(1.0 + STALE_WEIGHT * (0.9 - 1.0))


def test_a_scale_not_measured_for_a_while_takes_a_measurement_at_more_weight() -> None:
    """Consecutive measurements refine a scale by COST_EMA; one that comes STALE_AFTER or more
    iterations after the scale's last (a plain probe among drafting iterations) by
    STALE_WEIGHT, so what the machine does now outweighs what it did long ago."""
    rng = random.Random()
    costs = table([1.0, 1.3, 1.5, 1.8])
    first, second, late = (rng.uniform(0.8, 1.4) for _ in range(3))
    costs.observe(1, 0, first)  # the first: from the start-up table's 1, at STALE_WEIGHT
    costs.observe(1, 0, second)
    after_first = 1 + STALE_WEIGHT * (first - 1)
    want = after_first + COST_EMA * (second - after_first)
    assert costs.cost(1, 0) == pytest.approx(want)
    for _ in range(STALE_AFTER - 1):
        costs.observe(1, 2, 1.5 * rng.uniform(0.9, 1.1))
    costs.observe(1, 0, late)
    assert costs.cost(1, 0) == pytest.approx(want + STALE_WEIGHT * (late - want))


def test_an_iteration_pays_the_hosts_time_between_forwards() -> None:
    """The gaps between decode forwards, an EMA per bucket, are added to every depth's cost
    alike; a gap longer than PAUSE_DECODES plain decodes (a pause) is not measured."""
    rng = random.Random()
    start = sorted(rng.uniform(0.5, 2.0) for _ in range(4))
    t = table(start)
    assert [t.iteration(1, k) for k in range(4)] == [t.cost(1, k) for k in range(4)]
    gaps = [rng.uniform(0.1, 0.5) * start[0] for _ in range(30)]
    expected = gaps[0]
    for g in gaps:
        t.observe_between(1, g)
    for g in gaps[1:]:
        expected += COST_EMA * (g - expected)
    t.observe_between(1, (PAUSE_DECODES + 1) * start[0])  # a pause
    for k in range(4):
        assert t.iteration(1, k) == pytest.approx(t.cost(1, k) + expected)
    assert t.iteration(4, 2) == t.cost(4, 2)  # another bucket has measured none

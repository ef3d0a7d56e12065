"""The serving benchmark's arithmetic: arrival gaps at the asked rate and burstiness, vLLM's
percentiles and latency definitions, goodput, and the speculative figures read from two /metrics
pages of a real server registry."""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest

from eagleserve.benchmark.stats import (
    RequestRecord,
    arrival_gaps,
    parse_goodput,
    percentile,
    spec_counters,
    spec_figures,
    summarize,
)
from eagleserve.messages import EngineStats
from eagleserve.server.metrics import Metrics


def test_arrivals_have_the_rate_and_burstiness_asked_for() -> None:
    rng = random.Random()
    rate = rng.uniform(2, 50)
    for burstiness in (0.5, 1.0, 4.0):
        gaps = arrival_gaps(20000, rate, burstiness, random.Random(rng.random()))
        assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.05)
        # A gamma of shape k has a squared coefficient of variation 1 / k (Poisson: 1).
        cv2 = statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2
        assert cv2 == pytest.approx(1 / burstiness, rel=0.1)
    assert arrival_gaps(5, math.inf, 1.0, rng) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_gaps(3, 0.0, 1.0, rng)


def test_percentiles_are_numpys() -> None:
    rng = np.random.default_rng()
    for n in (1, 2, 7, 100):
        values = list(rng.exponential(10, n))
        for p in (1, 50, 90, 99, 99.9, 100):
            assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))


def random_record(rng: random.Random) -> RequestRecord:
    out = rng.randint(1, 40)
    ttft = rng.uniform(0.01, 0.5)
    itls = [rng.uniform(0.001, 0.05) for _ in range(rng.randint(0, out - 1))]
    return RequestRecord(ok=True, prompt_tokens=rng.randint(1, 500), output_tokens=out,
                         ttft=ttft, latency=ttft + sum(itls), itls=itls)  # fmt: skip


def test_summary_follows_vllms_definitions() -> None:
    rng = random.Random()
    records = [random_record(rng) for _ in range(50)]
    records.insert(rng.randrange(50), RequestRecord(ok=False, error="HTTP 503"))
    duration = rng.uniform(1, 10)
    s = summarize(records, duration, ("ttft", "tpot", "itl", "e2el"), (50, 99), {"ttft": 200})
    ok = [r for r in records if r.ok]
    assert s["completed"] == 50 and s["failed"] == 1
    assert s["total_output_tokens"] == sum(r.output_tokens for r in ok)
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / duration)
    # TPOT: the time after the first token over the tokens after it; one-token answers have none.
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) * 1000 for r in ok if r.output_tokens > 1]
    assert s["mean_tpot_ms"] == pytest.approx(statistics.fmean(tpots))
    assert s["p99_tpot_ms"] == pytest.approx(float(np.percentile(tpots, 99)))
    assert s["median_itl_ms"] == pytest.approx(
        statistics.median(g * 1000 for r in ok for g in r.itls)
    )
    assert s["mean_e2el_ms"] == pytest.approx(statistics.fmean(r.latency * 1000 for r in ok))
    good = sum(r.ttft * 1000 <= 200 for r in ok)
    assert s["request_goodput"] == pytest.approx(good / duration)


def test_goodput_flags_are_checked() -> None:
    assert parse_goodput(["ttft:150", "tpot:12.5"]) == {"ttft": 150.0, "tpot": 12.5}
    for bad in (["itl:5"], ["ttft"], ["ttft:fast"], ["e2el:0"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_spec_figures_from_a_servers_metrics_pages() -> None:
    """Two /metrics pages rendered by the server's own registry around a run: tau, the drafts'
    acceptance rate and the acceptance by depth are those of the counts the run added."""
    rng = random.Random()
    metrics = Metrics("m")

    def page(verifies: int, per_position: list[int], iterations: list[int]) -> str:
        accepted = verifies + sum(per_position)  # each verify commits the bonus token too
        stats = EngineStats(spec_verify_calls_total=verifies, spec_accepted_tokens_total=accepted,
                            spec_accepted_per_position=per_position,
                            spec_proposed_tokens_total=3 * verifies,
                            spec_iterations_per_num_drafts=iterations)  # fmt: skip
        metrics.update_engine_stats(stats)
        return metrics.render().decode()

    v0 = rng.randint(0, 100)
    p0 = sorted((rng.randint(0, v0) for _ in range(3)), reverse=True)
    before = spec_counters(page(v0, p0, [1, 0, 0, v0]))
    v1 = v0 + rng.randint(10, 100)
    added = sorted((rng.randint(0, v1 - v0) for _ in range(3)), reverse=True)
    p1 = [a + b for a, b in zip(p0, added, strict=True)]
    after = spec_counters(page(v1, p1, [4, 0, 0, v1]))
    fig = spec_figures(before, after)
    assert fig is not None
    verifies = v1 - v0
    assert fig["spec_verify_steps"] == verifies
    assert fig["spec_accept_length"] == pytest.approx(1 + sum(added) / verifies)
    assert fig["spec_acceptance_by_depth"] == pytest.approx([a / verifies for a in added])
    assert fig["spec_draft_acceptance_rate"] == pytest.approx(sum(added) / (3 * verifies))
    assert fig["spec_iterations_by_num_drafts"] == {"0": 3, "1": 0, "2": 0, "3": verifies}
    assert spec_figures(after, after) is None  # no verify in between: no speculation to report


def test_adaptive_acceptance_by_depth_counts_the_steps_that_drafted_it() -> None:
    """Adaptive speculation drafts 0-3 tokens an iteration: depth d's acceptance is over the
    verify steps that drafted to depth d, not over every step."""
    rng = random.Random()
    metrics = Metrics("m")
    before = spec_counters(metrics.render().decode())
    plain, k1, k2 = (rng.randint(1, 50) for _ in range(3))
    k3 = rng.choice([0, rng.randint(1, 50)])  # 0: depth 3 never drafted
    drafted = [k1 + k2 + k3, k2 + k3, k3]
    accepted = [rng.randint(0, n) for n in drafted]
    accepted = [min(accepted[: d + 1]) for d in range(3)]  # depth d needs the ones before it
    stats = EngineStats(spec_verify_calls_total=drafted[0],
                        spec_accepted_tokens_total=drafted[0] + sum(accepted),
                        spec_accepted_per_position=accepted,
                        spec_proposed_tokens_total=k1 + 2 * k2 + 3 * k3,
                        spec_iterations_per_num_drafts=[plain, k1, k2, k3])  # fmt: skip
    metrics.update_engine_stats(stats)
    fig = spec_figures(before, spec_counters(metrics.render().decode()))
    assert fig is not None and fig["spec_drafted_by_depth"] == drafted
    shares = fig["spec_acceptance_by_depth"]
    assert shares[:2] == pytest.approx([a / n for a, n in zip(accepted[:2], drafted[:2])])
    assert shares[2] == (pytest.approx(accepted[2] / k3) if k3 else None)
    assert fig["spec_draft_acceptance_rate"] == pytest.approx(
        sum(accepted) / (k1 + 2 * k2 + 3 * k3)
    )
    assert fig["spec_iterations_by_num_drafts"] == {"0": plain, "1": k1, "2": k2, "3": k3}

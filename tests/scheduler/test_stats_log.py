"""The engine's periodic stats log (scheduler/stats_log.py): an interval's figures are the
differences of two snapshots of its counters (throughputs, hit rate, acceptance length, each
depth's acceptance among the iterations that drafted that deep), and a line is logged only for
an interval with work (tests/server/test_stats_log_api.py: a served engine's)."""

from __future__ import annotations

import dataclasses
import logging
import random
import re
import time

import pytest

from eagleserve.messages import EngineStats
from eagleserve.scheduler.stats_log import StatsLog, depth_acceptance, stats_lines


def random_stats(depths: int, adaptive: bool) -> EngineStats:
    return EngineStats(
        num_running=random.randint(0, 8),
        num_waiting=random.randint(0, 8),
        kv_used_tokens=random.randint(0, 4096),
        kv_total_tokens=4096,
        prefix_cache_queried_tokens_total=random.randint(0, 10**6),
        prefix_cache_hit_tokens_total=random.randint(0, 10**5),
        generation_tokens_total=random.randint(0, 10**6),
        spec_verify_calls_total=random.randint(0, 10**5),
        spec_accepted_tokens_total=random.randint(0, 10**6),
        spec_accepted_per_position=[random.randint(0, 10**5) for _ in range(depths)],
        spec_proposed_tokens_total=random.randint(0, 10**6),
        spec_iterations_per_num_drafts=(
            [random.randint(0, 10**5) for _ in range(depths + 1)] if adaptive else []
        ),
    )


def later(prev: EngineStats, adaptive: bool) -> tuple[EngineStats, list[int], list[int]]:
    """`prev` after an interval of random work; the interval's iterations by number of drafts
    (adaptive) and accepted drafts by depth."""
    depths = len(prev.spec_accepted_per_position)
    by_k = [random.randint(0, 50) for _ in range(depths + 1)]
    if not adaptive:
        by_k = [0] * depths + [random.randint(1, 50)]
    drafted = [sum(by_k[d + 1 :]) for d in range(depths)]
    accepted = [random.randint(0, n) for n in drafted]
    for d in range(1, depths):  # a draft is accepted only after the one before it
        accepted[d] = min(accepted[d], accepted[d - 1])
    verifies = sum(by_k[1:])
    hits = random.randint(0, 500)
    cur = dataclasses.replace(
        prev,
        num_running=random.randint(0, 8),
        prefix_cache_queried_tokens_total=prev.prefix_cache_queried_tokens_total + hits
        + random.randint(0, 500),
        prefix_cache_hit_tokens_total=prev.prefix_cache_hit_tokens_total + hits,
        generation_tokens_total=prev.generation_tokens_total + random.randint(0, 10**4),
        spec_verify_calls_total=prev.spec_verify_calls_total + verifies,
        spec_accepted_tokens_total=prev.spec_accepted_tokens_total + verifies + sum(accepted),
        spec_accepted_per_position=[a + b for a, b in
                                    zip(prev.spec_accepted_per_position, accepted)],
        spec_proposed_tokens_total=prev.spec_proposed_tokens_total
        + sum(k * n for k, n in enumerate(by_k)),
        spec_iterations_per_num_drafts=(
            [a + b for a, b in zip(prev.spec_iterations_per_num_drafts, by_k)] if adaptive else []
        ),
    )  # fmt: skip
    return cur, drafted, accepted


@pytest.mark.parametrize("adaptive", [False, True])
def test_an_interval_is_the_difference_of_two_snapshots(adaptive: bool) -> None:
    for _ in range(50):
        prev = random_stats(random.randint(1, 5), adaptive)
        cur, drafted, accepted = later(prev, adaptive)
        generated = cur.generation_tokens_total - prev.generation_tokens_total
        seconds = random.uniform(0.5, 20)
        lines = stats_lines(prev, cur, seconds)
        prompt = cur.prefix_cache_queried_tokens_total - prev.prefix_cache_queried_tokens_total
        hits = cur.prefix_cache_hit_tokens_total - prev.prefix_cache_hit_tokens_total
        assert f"prompt throughput {prompt / seconds:.1f} tokens/s" in lines[0]
        assert f"generation throughput {generated / seconds:.1f} tokens/s" in lines[0]
        assert f"running {cur.num_running} reqs, waiting {cur.num_waiting} reqs" in lines[0]
        rate = f"{100 * hits / prompt:.1f}%" if prompt else "-"
        assert lines[0].endswith(f"prefix cache hit rate {rate}")
        want = [a / n if n else None for a, n in zip(accepted, drafted)]
        assert depth_acceptance(prev, cur) == want
        verifies = cur.spec_verify_calls_total - prev.spec_verify_calls_total
        if not verifies:
            assert len(lines) == 1
            continue
        mean = (verifies + sum(accepted)) / verifies
        assert f"mean acceptance length {mean:.2f}" in lines[1]
        shown = ", ".join("-" if r is None else f"{r:.2f}" for r in want)
        assert lines[1].endswith(f"acceptance by depth {shown}")


def test_lines_come_once_per_interval_with_work(caplog: pytest.LogCaptureFixture) -> None:
    snapshot = [EngineStats(kv_total_tokens=64)]
    log = StatsLog(lambda: snapshot[0], interval_s=0.05)
    caplog.set_level(logging.INFO, logger="eagleserve.engine")
    log.tick()  # within the interval: nothing
    time.sleep(0.06)
    log.tick()  # an idle interval: nothing
    assert not caplog.records
    n = random.randint(1, 20)
    snapshot[0] = dataclasses.replace(snapshot[0], generation_tokens_total=n * (n + 1) // 2)
    log.tick()  # tokens made, not yet an interval since the last tick
    assert not caplog.records
    time.sleep(0.06)
    log.tick()
    (record,) = caplog.records
    rate = float(re.search(r"generation throughput ([0-9.]+)", record.getMessage())[1])
    assert 0 < rate <= n * (n + 1) / 2 / 0.05

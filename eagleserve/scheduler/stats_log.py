"""The engine's periodic log of its throughput and state (vLLM's stats log; `--disable-log-stats`
turns it off): every EAGLESERVE_LOG_STATS_INTERVAL seconds (10) in which the engine had work, one
line of prompt and generation throughput, requests running and waiting, KV use and the prefix
cache's hit rate, and with speculation one more: mean acceptance length, drafts accepted, and
acceptance at each draft depth. The figures are of the interval, from two `EngineStats`."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from eagleserve.messages import EngineStats

INTERVAL_ENV = "EAGLESERVE_LOG_STATS_INTERVAL"
logger = logging.getLogger("eagleserve.engine")


def log_interval_s() -> float:
    return float(os.environ.get(INTERVAL_ENV, "10"))


def percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def depth_acceptance(prev: EngineStats, cur: EngineStats) -> list[float | None]:
    """Of the interval's iterations that drafted at least d + 1 tokens, the share whose draft
    at depth d was accepted (None where none drafted that deep)."""
    accepted = [a - b for a, b in zip(cur.spec_accepted_per_position,
                                      prev.spec_accepted_per_position)]  # fmt: skip
    if cur.spec_iterations_per_num_drafts:
        iters = [a - b for a, b in zip(cur.spec_iterations_per_num_drafts,
                                       prev.spec_iterations_per_num_drafts)]  # fmt: skip
        drafted = [sum(iters[d + 1 :]) for d in range(len(accepted))]
    else:
        drafted = [cur.spec_verify_calls_total - prev.spec_verify_calls_total] * len(accepted)
    return [a / n if n else None for a, n in zip(accepted, drafted)]


def stats_lines(prev: EngineStats, cur: EngineStats, seconds: float) -> list[str]:
    """The log's lines for an interval of `seconds`."""
    prompt = cur.prefix_cache_queried_tokens_total - prev.prefix_cache_queried_tokens_total
    generated = cur.generation_tokens_total - prev.generation_tokens_total
    hits = cur.prefix_cache_hit_tokens_total - prev.prefix_cache_hit_tokens_total
    lines = [
        f"prompt throughput {prompt / seconds:.1f} tokens/s, generation throughput "
        f"{generated / seconds:.1f} tokens/s, running {cur.num_running} reqs, waiting "
        f"{cur.num_waiting} reqs, KV cache usage {percent(cur.kv_used_tokens, cur.kv_total_tokens)}"
        f", prefix cache hit rate {percent(hits, prompt)}"
    ]
    verifies = cur.spec_verify_calls_total - prev.spec_verify_calls_total
    if verifies:
        accepted = cur.spec_accepted_tokens_total - prev.spec_accepted_tokens_total
        proposed = cur.spec_proposed_tokens_total - prev.spec_proposed_tokens_total
        # Each verify's tokens: its accepted drafts and the target's own token.
        drafts_accepted = accepted - verifies
        by_depth = ", ".join("-" if r is None else f"{r:.2f}" for r in depth_acceptance(prev, cur))
        lines.append(
            f"speculation: mean acceptance length {accepted / verifies:.2f}, drafts accepted "
            f"{drafts_accepted} of {proposed} ({percent(drafts_accepted, proposed)}), "
            f"acceptance by depth {by_depth}"
        )
    return lines


class StatsLog:
    """Logs `stats_lines` once per interval that had work (none while it idles)."""

    def __init__(self, stats: Callable[[], EngineStats], interval_s: float) -> None:
        self.stats, self.interval_s = stats, interval_s
        self.last, self.last_time = stats(), time.monotonic()

    def tick(self) -> None:
        now = time.monotonic()
        seconds = now - self.last_time
        if seconds < self.interval_s:
            return
        cur = self.stats()
        last = self.last
        admitted = cur.prefix_cache_queried_tokens_total != last.prefix_cache_queried_tokens_total
        generated = cur.generation_tokens_total != last.generation_tokens_total
        if generated or admitted or cur.num_running or cur.num_waiting:
            for line in stats_lines(last, cur, seconds):
                logger.info("%s", line)
        self.last, self.last_time = cur, now

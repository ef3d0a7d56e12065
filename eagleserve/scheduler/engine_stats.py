"""The engine's counters and gauges, read off a scheduler for /metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

from eagleserve.messages import EngineStats

if TYPE_CHECKING:
    from eagleserve.scheduler.scheduler import Scheduler


def engine_stats(sched: Scheduler) -> EngineStats:
    grammars = sched.constraints.grammars
    grammar = grammars.stats if grammars is not None else None
    engine = EngineStats(
        num_running=sched.running_batch.batch_size if sched.running_batch else 0,
        num_waiting=len(sched.waiting),
        kv_used_tokens=sched.kv_pool.size - sched.prefix_cache.available_size(),
        kv_total_tokens=sched.kv_pool.size,
        kv_cached_tokens=sched.prefix_cache.cached_size,
        prefix_cache_hit_tokens_total=sched.prefix_cache.hit_tokens,
        prefix_cache_queried_tokens_total=sched.prefix_cache.queried_tokens,
        prefix_cache_evicted_tokens_total=sched.prefix_cache.evicted_tokens,
        num_retracted_total=sched.num_retracted,
        generation_tokens_total=sched.generation_tokens,
        grammar_compiles_total=grammar.compiles if grammar else 0,
        grammar_compile_seconds_total=grammar.compile_seconds if grammar else 0.0,
        grammar_cache_hits_total=grammar.cache_hits if grammar else 0,
    )
    return sched.spec_stats.with_spec_fields(engine)

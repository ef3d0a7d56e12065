"""The engine's counters and gauges, read off a scheduler for /metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

from eagleserve.messages import EngineStats

if TYPE_CHECKING:
    from eagleserve.scheduler.scheduler import Scheduler


def engine_stats(sched: Scheduler) -> EngineStats:
    spec = sched.spec_stats
    grammar = sched.grammars.stats if sched.grammars is not None else None
    return EngineStats(
        num_running=sched.running_batch.batch_size if sched.running_batch else 0,
        num_waiting=len(sched.waiting),
        kv_used_tokens=sched.kv_pool.size - sched.prefix_cache.available_size(),
        kv_total_tokens=sched.kv_pool.size,
        kv_cached_tokens=sched.prefix_cache.cached_size,
        prefix_cache_hit_tokens_total=sched.prefix_cache.hit_tokens,
        prefix_cache_queried_tokens_total=sched.prefix_cache.queried_tokens,
        prefix_cache_evicted_tokens_total=sched.prefix_cache.evicted_tokens,
        num_retracted_total=sched.num_retracted,
        spec_verify_calls_total=spec.verify_calls,
        spec_accepted_tokens_total=spec.accepted_tokens,
        spec_accepted_per_position=list(spec.accepted_per_position),
        spec_proposed_tokens_total=spec.proposed_tokens,
        spec_iterations_per_num_drafts=list(spec.iterations_per_num_drafts),
        spec_acceptance_ema=list(spec.acceptance_ema),
        grammar_compiles_total=grammar.compiles if grammar else 0,
        grammar_compile_seconds_total=grammar.compile_seconds if grammar else 0.0,
        grammar_cache_hits_total=grammar.cache_hits if grammar else 0,
    )

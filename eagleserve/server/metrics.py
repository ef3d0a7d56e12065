"""Prometheus metrics of one server (own registry, so several apps can live in one process).

Every eagleserve_* series carries a `model_name` label (the served name), as vLLM's do, so one
dashboard can tell servers apart; the registry also has the standard process_* / python_*
collectors. Engine-side figures (KV use, running/waiting, speculative acceptance) come from
`EngineStats`; request-level ones (latencies, lengths, outcomes, HTTP codes) from the server.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from eagleserve.messages import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LENGTH_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))  # 1 .. 500k
P = "eagleserve_"
# Routes whose responses are counted by path; anything else (404s of random paths) is "other",
# so a scanner cannot grow the label set without bound.
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/health",
          "/metrics")  # fmt: skip


class Metrics:
    def __init__(self, model_name: str = "") -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        for collector in (PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(collector)
        self.model_name = model_name

        def one(kind: Any, name: str, doc: str, labels: tuple[str, ...] = (), **kw: Any) -> Any:
            metric = kind(P + name, doc, ["model_name", *labels], registry=r, **kw)
            return metric if labels else metric.labels(model_name=model_name)

        self._requests = one(
            Counter,
            "requests",
            "Finished requests (abort: client gone or cut at shutdown)",
            ("endpoint", "finish_reason"),
        )
        self._aborted = one(
            Counter,
            "requests_aborted",
            "Requests ended before they finished",
            ("endpoint", "reason"),
        )
        self._http = one(
            Counter, "http_responses", "HTTP responses by route and status code", ("route", "code")
        )
        self.prompt_tokens = one(Counter, "prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = one(Counter, "generation_tokens", "Tokens generated")
        self.prompt_len = one(
            Histogram, "request_prompt_tokens", "Prompt length per request", buckets=LENGTH_BUCKETS
        )
        self.generation_len = one(
            Histogram,
            "request_generation_tokens",
            "Generated tokens per request",
            buckets=LENGTH_BUCKETS,
        )
        self.engine_alive = one(Gauge, "engine_alive", "1 while the engine process serves")
        self.num_running = one(Gauge, "num_requests_running", "Requests decoding")
        self.num_waiting = one(Gauge, "num_requests_waiting", "Requests queued")
        self.kv_used = one(Gauge, "kv_used_tokens", "KV cache slots in use")
        self.kv_total = one(Gauge, "kv_total_tokens", "KV cache slots in all")
        self.kv_usage = one(Gauge, "kv_cache_usage_ratio", "KV cache slots in use / all")
        self.num_retracted = one(
            Counter, "num_retracted", "Requests retracted (KV pool full) to be re-prefilled"
        )
        self.kv_cached = one(Gauge, "kv_cached_tokens", "KV cache slots held by cached prefixes")
        self.cache_queried = one(
            Counter, "prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache"
        )
        self.cache_hits = one(
            Counter, "prefix_cache_hit_tokens", "Prompt tokens whose KV came from the cache"
        )
        self.cache_hit_rate = one(
            Gauge, "prefix_cache_hit_rate", "Cached / looked-up prompt tokens since start-up"
        )
        self.cache_evicted = one(
            Counter, "prefix_cache_evicted_tokens", "Cached KV slots evicted for new requests"
        )
        self.ttft = one(
            Histogram, "time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS
        )
        self.itl = one(
            Histogram,
            "inter_token_latency_seconds",
            "Time between output tokens",
            buckets=LATENCY_BUCKETS,
        )
        self.e2e = one(
            Histogram, "e2e_request_latency_seconds", "Request latency", buckets=LATENCY_BUCKETS
        )
        self.queue_time = one(
            Histogram,
            "request_queue_time_seconds",
            "Time from arrival at the engine to the start of the prefill",
            buckets=LATENCY_BUCKETS,
        )
        self.prefill_time = one(
            Histogram,
            "request_prefill_time_seconds",
            "Time from the start of the prefill to the first output",
            buckets=LATENCY_BUCKETS,
        )
        self.spec_accept_length = one(
            Gauge, "spec_accept_length", "Mean tokens committed per verify step"
        )
        self.spec_verify_calls = one(
            Counter, "spec_verify_calls", "Speculative verify steps (per request)"
        )
        self.spec_accepted_tokens = one(
            Counter, "spec_accepted_tokens", "Tokens committed by verify steps"
        )
        self._accepted_per_position = one(
            Counter,
            "spec_accepted_per_position",
            "Accepted draft tokens at each draft depth",
            ("position",),
        )
        self.spec_proposed_tokens = one(
            Counter, "spec_proposed_tokens", "Draft tokens verified (accepted / proposed = rate)"
        )
        self._iterations_per_num_drafts = one(
            Counter,
            "spec_iterations",
            "Speculative decode iterations by draft depth (adaptive; 0 = a plain decode)",
            ("num_drafts",),
        )
        self._acceptance_ema = one(
            Gauge,
            "spec_acceptance_ema",
            "Acceptance rate at each draft depth, given the earlier ones were accepted (EMA)",
            ("depth",),
        )
        self.grammar_compiles = one(
            Counter, "grammar_compiles", "Grammars compiled for structured output (cache misses)"
        )
        self.grammar_compile_seconds = one(
            Counter, "grammar_compile_seconds", "Time spent compiling grammars"
        )
        self.grammar_cache_hits = one(
            Counter, "grammar_cache_hits", "Structured-output requests served a cached grammar"
        )
        self._last = EngineStats()

    def request_finished(self, endpoint: str, reason: str, prompt: int, generated: int) -> None:
        self._requests.labels(self.model_name, endpoint, reason).inc()
        self.prompt_len.observe(prompt)
        self.generation_len.observe(generated)

    def request_aborted(self, endpoint: str, reason: str) -> None:
        """`reason`: client_disconnected (the client hung up), shutdown (cut at the drain
        timeout), abort_request (SGLang's route) or error (another choice of the same call
        failed)."""
        self._requests.labels(self.model_name, endpoint, "abort").inc()
        self._aborted.labels(self.model_name, endpoint, reason).inc()

    def http_response(self, path: str, status: int) -> None:
        route = path if path in ROUTES else "other"
        self._http.labels(self.model_name, route, str(status)).inc()

    def update_engine_stats(self, s: EngineStats) -> None:
        self.num_running.set(s.num_running)
        self.num_waiting.set(s.num_waiting)
        self.kv_used.set(s.kv_used_tokens)
        self.kv_total.set(s.kv_total_tokens)
        self.kv_usage.set(s.kv_used_tokens / s.kv_total_tokens if s.kv_total_tokens else 0.0)
        self.kv_cached.set(s.kv_cached_tokens)
        last = self._last
        self.num_retracted.inc(max(0, s.num_retracted_total - last.num_retracted_total))
        queried = s.prefix_cache_queried_tokens_total
        self.cache_queried.inc(max(0, queried - last.prefix_cache_queried_tokens_total))
        self.cache_hits.inc(
            max(0, s.prefix_cache_hit_tokens_total - last.prefix_cache_hit_tokens_total)
        )
        self.cache_hit_rate.set(s.prefix_cache_hit_tokens_total / queried if queried else 0.0)
        self.cache_evicted.inc(
            max(0, s.prefix_cache_evicted_tokens_total - last.prefix_cache_evicted_tokens_total)
        )
        self.spec_verify_calls.inc(max(0, s.spec_verify_calls_total - last.spec_verify_calls_total))
        self.spec_accepted_tokens.inc(
            max(0, s.spec_accepted_tokens_total - last.spec_accepted_tokens_total)
        )
        self.spec_proposed_tokens.inc(
            max(0, s.spec_proposed_tokens_total - last.spec_proposed_tokens_total)
        )
        self._inc_each(
            self._accepted_per_position,
            s.spec_accepted_per_position,
            last.spec_accepted_per_position,
        )
        self._inc_each(
            self._iterations_per_num_drafts,
            s.spec_iterations_per_num_drafts,
            last.spec_iterations_per_num_drafts,
        )
        for depth, rate in enumerate(s.spec_acceptance_ema):
            self._acceptance_ema.labels(self.model_name, str(depth)).set(rate)
        self.grammar_compiles.inc(max(0, s.grammar_compiles_total - last.grammar_compiles_total))
        self.grammar_compile_seconds.inc(
            max(0.0, s.grammar_compile_seconds_total - last.grammar_compile_seconds_total)
        )
        self.grammar_cache_hits.inc(
            max(0, s.grammar_cache_hits_total - last.grammar_cache_hits_total)
        )
        if s.spec_verify_calls_total:
            self.spec_accept_length.set(s.spec_accepted_tokens_total / s.spec_verify_calls_total)
        self._last = s

    def _inc_each(self, counter: Any, totals: list[int], before: list[int]) -> None:
        """Counter child i (label str(i)) grows by totals[i] - before[i]."""
        for i, n in enumerate(totals):
            prev = before[i] if i < len(before) else 0
            counter.labels(self.model_name, str(i)).inc(max(0, n - prev))

    def render(self) -> bytes:
        return generate_latest(self.registry)

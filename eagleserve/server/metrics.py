"""Prometheus metrics of one server (own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from eagleserve.messages import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
P = "eagleserve_"


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            P + "requests", "Finished requests", ["endpoint", "finish_reason"], registry=r
        )
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", registry=r)
        self.num_running = Gauge(P + "num_requests_running", "Requests decoding", registry=r)
        self.num_waiting = Gauge(P + "num_requests_waiting", "Requests queued", registry=r)
        self.kv_used = Gauge(P + "kv_used_tokens", "KV cache slots in use", registry=r)
        self.kv_total = Gauge(P + "kv_total_tokens", "KV cache slots in all", registry=r)
        self.kv_usage = Gauge(P + "kv_cache_usage_ratio", "KV cache slots in use / all", registry=r)
        self.num_retracted = Counter(
            P + "num_retracted", "Requests retracted (KV pool full) to be re-prefilled", registry=r
        )
        self.ttft = Histogram(
            P + "time_to_first_token_seconds",
            "Time to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            P + "inter_token_latency_seconds",
            "Time between output tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds",
            "Request latency",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.spec_accept_length = Gauge(
            P + "spec_accept_length", "Mean tokens committed per verify step", registry=r
        )
        self.spec_verify_calls = Counter(
            P + "spec_verify_calls", "Speculative verify steps (per request)", registry=r
        )
        self.spec_accepted_tokens = Counter(
            P + "spec_accepted_tokens", "Tokens committed by verify steps", registry=r
        )
        self.spec_accepted_per_position = Counter(
            P + "spec_accepted_per_position",
            "Accepted draft tokens at each draft depth",
            ["position"],
            registry=r,
        )
        self._last = EngineStats()

    def update_engine_stats(self, s: EngineStats) -> None:
        self.num_running.set(s.num_running)
        self.num_waiting.set(s.num_waiting)
        self.kv_used.set(s.kv_used_tokens)
        self.kv_total.set(s.kv_total_tokens)
        self.kv_usage.set(s.kv_used_tokens / s.kv_total_tokens if s.kv_total_tokens else 0.0)
        last = self._last
        self.num_retracted.inc(max(0, s.num_retracted_total - last.num_retracted_total))
        self.spec_verify_calls.inc(max(0, s.spec_verify_calls_total - last.spec_verify_calls_total))
        self.spec_accepted_tokens.inc(
            max(0, s.spec_accepted_tokens_total - last.spec_accepted_tokens_total)
        )
        for pos, n in enumerate(s.spec_accepted_per_position):
            prev = last.spec_accepted_per_position
            before = prev[pos] if pos < len(prev) else 0
            self.spec_accepted_per_position.labels(position=str(pos)).inc(max(0, n - before))
        if s.spec_verify_calls_total:
            self.spec_accept_length.set(s.spec_accepted_tokens_total / s.spec_verify_calls_total)
        self._last = s

    def render(self) -> bytes:
        return generate_latest(self.registry)

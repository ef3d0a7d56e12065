"""The serving benchmark's arithmetic, free of I/O: request arrival gaps, per-request latencies,
their summary (vLLM's `bench serve` keys) and the speculative figures from two /metrics scrapes."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field

import numpy as np

# What `--percentile-metrics` may name, and the goodput SLOs' keys (vLLM's).
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds from the request's send."""

    ok: bool = False
    error: str = ""
    start: float = 0.0  # when it was sent, seconds since the benchmark began
    prompt_tokens: int = 0  # the server's usage
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)  # gaps between streamed chunks after the first
    generated_text: str = ""
    streamed: bool = True

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for a one-token answer, or one that was
        not streamed (its tokens came at once)."""
        if self.output_tokens < 2 or not self.streamed:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def arrival_gaps(n: int, request_rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Seconds to wait before each of `n` requests: none at an infinite rate, else gamma-
    distributed with mean 1 / rate and shape `burstiness` (1: a Poisson process; below 1
    burstier, above 1 more even), as vLLM draws them."""
    if burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0:
        raise ValueError("request rate must be > 0 (or inf)")
    theta = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(n)]


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (numpy's linear one, as vLLM reports); 0 for no values."""
    return float(np.percentile(values, p)) if values else 0.0


def parse_goodput(items: list[str]) -> dict[str, float]:
    """`KEY:MS` pairs (ttft, tpot, e2el) -> SLOs in milliseconds."""
    slos: dict[str, float] = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"goodput: {key!r} is none of ttft, tpot, e2el")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"goodput: {item!r} is not KEY:MILLISECONDS") from None
        if slos[key] <= 0:
            raise ValueError(f"goodput: {item!r} must be a positive number of milliseconds")
    return slos


def meets(rec: RequestRecord, slos: dict[str, float]) -> bool:
    """Whether a finished request meets every SLO (milliseconds)."""
    got = {"ttft": rec.ttft, "tpot": rec.tpot or 0.0, "e2el": rec.latency}
    return all(got[k] * 1000 <= v for k, v in slos.items())


def latency_values(records: list[RequestRecord], metric: str) -> list[float]:
    """A latency metric's values in milliseconds over the successful requests (ITL: every gap)."""
    ok = [r for r in records if r.ok]
    if metric == "ttft":
        return [r.ttft * 1000 for r in ok]
    if metric == "tpot":
        return [t * 1000 for r in ok if (t := r.tpot) is not None]
    if metric == "itl":
        return [g * 1000 for r in ok for g in r.itls]
    if metric == "e2el":
        return [r.latency * 1000 for r in ok]
    raise ValueError(f"unknown latency metric {metric!r}")


def summarize(
    records: list[RequestRecord],
    duration: float,
    metrics: tuple[str, ...],
    percentiles: tuple[float, ...],
    slos: dict[str, float] | None = None,
) -> dict[str, float | int]:
    """The run's figures, named as vLLM's `bench serve` names them in its JSON."""
    ok = [r for r in records if r.ok]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out: dict[str, float | int] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
    }
    if slos:
        good = sum(meets(r, slos) for r in ok)
        out["request_goodput"] = good / duration if duration else 0.0
    for m in metrics:
        values = latency_values(records, m)
        out[f"mean_{m}_ms"] = statistics.fmean(values) if values else 0.0
        out[f"median_{m}_ms"] = statistics.median(values) if values else 0.0
        out[f"std_{m}_ms"] = statistics.pstdev(values) if values else 0.0
        for p in percentiles:
            out[f"p{p:g}_{m}_ms"] = percentile(values, p)
    return out


def spec_counters(metrics_text: str) -> dict[str, float]:
    """The speculative counters of a /metrics page: `name` or `name[label]` -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for sample in fam.samples:
            if not (sample.name.startswith("eagleserve_spec_") and sample.name.endswith("_total")):
                continue
            key = sample.name.removeprefix("eagleserve_").removesuffix("_total")
            for label in ("position", "num_drafts"):
                if label in sample.labels:
                    key += f"[{sample.labels[label]}]"
            out[key] = sample.value
    return out


def depth_shares(shares: list[float | None]) -> str:
    """Acceptance by depth for a table: "-" for a depth no step drafted."""
    return " ".join("-" if a is None else f"{a:.2f}" for a in shares)


def spec_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, object] | None:
    """Speculation over the run, from the counters before and after it: tau (tokens committed
    per verify step, the bonus token included), the drafts' acceptance rate, and the acceptance
    by draft depth: of the verify steps that drafted to a depth (adaptive speculation drafts
    fewer at times), the share whose drafts were accepted to it (None for a depth no step
    drafted). None when the server did not speculate in the run."""

    def grown(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    verifies = grown("spec_verify_calls")
    if verifies <= 0:
        return None
    depths = sorted(
        int(k[len("spec_accepted_per_position[") : -1])
        for k in after
        if k.startswith("spec_accepted_per_position[")
    )
    iterations = {
        int(k[len("spec_iterations[") : -1]): grown(k)
        for k in after
        if k.startswith("spec_iterations[")
    }
    drafted = [sum(n for k, n in iterations.items() if k > d) if iterations else verifies
               for d in depths]  # fmt: skip
    by_depth = [
        grown(f"spec_accepted_per_position[{d}]") / n if n else None  # None: never drafted
        for d, n in zip(depths, drafted, strict=True)
    ]
    proposed = grown("spec_proposed_tokens")
    accepted_drafts = grown("spec_accepted_tokens") - verifies
    figures: dict[str, object] = {
        "spec_verify_steps": int(verifies),
        "spec_accept_length": grown("spec_accepted_tokens") / verifies,
        "spec_draft_acceptance_rate": accepted_drafts / proposed if proposed else 0.0,
        "spec_acceptance_by_depth": by_depth,
        "spec_drafted_by_depth": [int(n) for n in drafted],
    }
    if iterations:  # iterations by draft depth; under adaptive speculation 0 is a plain decode
        figures["spec_iterations_by_num_drafts"] = {
            str(k): int(v) for k, v in sorted(iterations.items())
        }
    return figures

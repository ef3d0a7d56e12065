"""Served acceptance of EAGLE3 heads, side by side, on held-out prompts (CPU, batch 1, greedy).

For each head: the default (packed) target with a 3-step chain; tau (tokens per verify, bonus
included), P(>= d drafts accepted), tokens/s next to target-only, and whether the output equals
target-only output. MT-bench first turns, HumanEval and math prompts (never trained on).

    python bench/accept_cpu.py --threads 1 --prompts-per-set 4 --new-tokens 96 \\
        --heads builtin:smollm2-135m-eagle /path/to/new/head
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import data  # noqa: E402
from bench.common import machine, print_table, write_json  # noqa: E402
from bench.spec_cpu import run_engine  # noqa: E402
from eagleserve import Engine  # noqa: E402
from eagleserve.models.loader import resolve_draft_path  # noqa: E402

CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", nargs="+", default=["builtin:smollm2-135m-eagle"])
    ap.add_argument("--prompts-per-set", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default=None, help="e.g. float32: a dense target, not packed")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "float16"],
                    help="the target's K/V cache (auto: fp16 for the packed target)")  # fmt: skip
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # "default" (not its converted folder): the GGUF's packed weights, as the server runs them.
    kw = dict(model="default", device="cpu", kv_cache_tokens=4096, max_running_requests=2,
              disable_overlap_schedule=True, kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
    if args.dtype:
        kw["dtype"] = args.dtype
    engines = {"target-only": Engine(**kw)}
    for h in args.heads:
        path = resolve_draft_path(h)
        engines[h] = Engine(**kw, speculative_algorithm="EAGLE3",
                            speculative_draft_model_path=path, **CHAIN)  # fmt: skip
    n = args.prompts_per_set
    sets = {"MT-bench": data.mt_bench(n), "HumanEval": data.human_eval(n), "math": data.math(n)}
    rows = []
    for set_name, prompts in sets.items():
        ids = [data.chat_ids(engines["target-only"].tokenizer, p) for p in prompts]
        base = run_engine(engines["target-only"], ids, 1, args.new_tokens)
        rows.append(dict(set=set_name, head="target-only", tok_s=base["tok_s"]))
        for h in args.heads:
            r = run_engine(engines[h], ids, 1, args.new_tokens)
            same = sum(a == b for a, b in zip(r["tokens"], base["tokens"])) / len(ids)
            rows.append(dict(set=set_name, head=h, tok_s=r["tok_s"], tau=r["tau"],
                             accept_by_depth=r["accept_by_depth"], lossless=same,
                             speedup=r["tok_s"] / base["tok_s"]))  # fmt: skip
    print(f"machine: {machine()}; chain 3, batch 1, greedy, {args.new_tokens} new tokens")
    print_table(
        ["set", "head", "tok/s", "x", "tau", "P(accept >= d)", "lossless"],
        [
            [r["set"], r["head"][-40:], f"{r['tok_s']:.1f}", f"{r.get('speedup', 1):.2f}",
             f"{r['tau']:.2f}" if "tau" in r else "-",
             " ".join(f"{a:.2f}" for a in r.get("accept_by_depth", [])) or "-",
             f"{r['lossless']:.0%}" if "lossless" in r else "-"]
            for r in rows
        ],
    )  # fmt: skip
    payload = {"machine": machine(), "args": vars(args), "rows": rows}
    write_json(f"accept_cpu{args.tag}.json", payload)


if __name__ == "__main__":
    main()

"""A/B two source trees of eagleserve on the default model, interleaved, tokens checked equal.

    python bench/ab_trees.py --a /path/to/before --b /path/to/after [--rounds 3]

Each round starts one process per tree (A then B, so machine drift hits both alike), with that
tree first on PYTHONPATH; the process times, on the served SmolLM2 (packed int4):
- target-only decode at batch 1 (tok/s over 64 new tokens after a warm-up request),
- the default EAGLE3 config (configs/smollm2-135m-eagle.yaml's chain) at batch 1,
- target-only at batch 16, overlap scheduler off and on (ms per decode step).
Prints medians per tree and B/A, and writes bench/results/ab_trees.json. Greedy token ids of
each case must be identical between the trees (the run fails otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash map works.",
    "List five uses of vinegar at home.",
    "def quicksort(arr):",
]
HEAD = dict(
    speculative_algorithm="EAGLE3",
    speculative_draft_model_path="builtin:smollm2-135m-eagle",
    speculative_num_steps=1,
    speculative_eagle_topk=1,
    speculative_num_draft_tokens=2,
)
CASES: dict[str, tuple[int, dict[str, Any]]] = {
    "target bs1 tok/s": (1, {}),
    "eagle chain1 bs1 tok/s": (1, HEAD),
    "target bs16 overlap off ms/step": (16, dict(disable_overlap_schedule=True)),
    "target bs16 overlap on ms/step": (16, dict(disable_overlap_schedule=False)),
}
NEW_TOKENS = 64


def measure() -> dict[str, Any]:
    """Runs in the child: every case once, after a warm-up request per engine."""
    import torch

    from eagleserve import Engine, SamplingParams

    torch.manual_seed(0)
    out: dict[str, Any] = {}
    for name, (bs, cfg) in CASES.items():
        eng = Engine(model="default", device="cpu", kv_cache_tokens=8192, **cfg)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(bs)]
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        eng.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
        t0 = time.perf_counter()
        res = eng.generate(prompts, params)
        dt = time.perf_counter() - t0
        value = bs * NEW_TOKENS / dt if bs == 1 else 1000 * dt / NEW_TOKENS
        out[name] = {"value": value, "ids": [r["token_ids"] for r in res]}
    return out


def run_tree(tree: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, os.path.abspath(__file__), "--child"]
    proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--a", help="the 'before' source tree")
    ap.add_argument("--b", help="the 'after' source tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "ab_trees.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure()))
        return
    sys.path.insert(0, HERE)
    from overlap_cpu import machine

    runs: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    for r in range(args.rounds):
        for side in ("a", "b"):
            runs[side].append(run_tree(getattr(args, side)))
            print(f"round {r + 1}/{args.rounds}: {side} done", file=sys.stderr)
    table = {}
    for case in CASES:
        a = statistics.median(x[case]["value"] for x in runs["a"])
        b = statistics.median(x[case]["value"] for x in runs["b"])
        same = all(
            x[case]["ids"] == runs["a"][0][case]["ids"] for side in runs.values() for x in side
        )
        table[case] = {"a": a, "b": b, "b_over_a": b / a, "identical_tokens": same}
    print(f"machine: {machine()}")
    print(f"{'case':<34}{'A':>10}{'B':>10}{'B/A':>8}  tokens")
    for case, row in table.items():
        print(
            f"{case:<34}{row['a']:>10.2f}{row['b']:>10.2f}{row['b_over_a']:>8.3f}  "
            f"{'identical' if row['identical_tokens'] else 'DIFFER'}"
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": machine(), "a": args.a, "b": args.b, "rounds": args.rounds,
                   "new_tokens": NEW_TOKENS, "cases": table}, f, indent=2)  # fmt: skip
    if not all(row["identical_tokens"] for row in table.values()):
        sys.exit("token ids differ between the trees")


if __name__ == "__main__":
    main()

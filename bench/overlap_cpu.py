"""Overlap scheduler on vs off on a CPU: wall time per generated token, in one interleaved run.

    python bench/overlap_cpu.py [--batches 1,16] [--new-tokens 64] [--rounds 3] [--spec]
        [--libgomp-default]

The packed-int4 default model as `make serve` runs it (greedy, EOS ignored), target-only and,
with --spec, the shipped config's adaptive EAGLE3. Every round runs each setting with overlap
off and on, side by side, the order reversed every other round; the table has the median
ms/token of the rounds and the speed with overlap on over overlap off (median of the rounds').
Tokens must be identical in both modes.

The OpenMP spin settings are those the server's engine process starts with when overlap is on
(eagleserve/scheduler/omp_spin.py), set before torch loads, for both modes alike. With
--libgomp-default they are left as the environment has them, which shows what the engine
process would do without them. Writes bench/results/overlap_cpu.json (with --libgomp-default,
overlap_cpu_libgomp_default.json).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from eagleserve.scheduler.omp_spin import OVERLAP_SPIN_ENV, use_overlap_spin  # noqa: E402

if "--libgomp-default" not in sys.argv:
    use_overlap_spin()  # before torch loads libgomp

from bench.common import machine, median, print_table, write_json  # noqa: E402
from eagleserve import Engine, SamplingParams  # noqa: E402

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash map works.",
    "List five uses of vinegar at home.",
    "def quicksort(arr):",
    "What causes the seasons on Earth?",
    "Translate 'good morning' into French, Spanish and German.",
    "Summarize the plot of Romeo and Juliet.",
    "Give me a recipe for pancakes.",
]
ADAPTIVE = dict(
    speculative_algorithm="EAGLE3",
    speculative_draft_model_path="builtin:smollm2-135m-eagle",
    speculative_num_steps=3,
    speculative_eagle_topk=1,
    speculative_num_draft_tokens=4,
    speculative_adaptive=True,
)


def timed(engine: Engine, prompts: list[str], new_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    return time.perf_counter() - t0, [o["token_ids"] for o in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--spec", action="store_true", help="also the shipped adaptive EAGLE3")
    ap.add_argument("--libgomp-default", action="store_true", help="leave the OpenMP env alone")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    settings: dict[str, dict[str, Any]] = {"target-only": {}}
    if args.spec:
        settings["adaptive EAGLE3"] = ADAPTIVE
    engines = {
        (name, overlap): Engine(
            model="default",
            device="cpu",
            max_total_tokens=16384,
            max_running_requests=max(batches),
            disable_overlap_schedule=not overlap,
            **kw,
        )
        for name, kw in settings.items()
        for overlap in (False, True)
    }
    for eng in engines.values():
        timed(eng, PROMPTS[:2], 8)  # warm-up
    rows, table = [], []
    for bs in batches:
        prompts = (PROMPTS * -(-bs // len(PROMPTS)))[:bs]
        for name in settings:
            secs: dict[bool, list[float]] = {False: [], True: []}
            tokens: dict[bool, list[list[int]]] = {}
            for r in range(args.rounds):
                for overlap in (False, True) if r % 2 == 0 else (True, False):
                    dt, tokens[overlap] = timed(engines[(name, overlap)], prompts, args.new_tokens)
                    secs[overlap].append(dt)
            ratios = [off / on for off, on in zip(secs[False], secs[True], strict=True)]
            per_token = {m: 1e3 * median(s) / (bs * args.new_tokens) for m, s in secs.items()}
            row = {
                "setting": name,
                "batch": bs,
                "ms_per_token_off": per_token[False],
                "ms_per_token_on": per_token[True],
                "on_vs_off": median(ratios),
                "on_vs_off_range": [min(ratios), max(ratios)],
                "identical_tokens": tokens[False] == tokens[True],
            }
            rows.append(row)
            table.append([
                name, bs, per_token[False], per_token[True], row["on_vs_off"],
                f"{min(ratios):.2f}-{max(ratios):.2f}", row["identical_tokens"],
            ])  # fmt: skip
    spin = {k: os.environ.get(k) for k in OVERLAP_SPIN_ENV}
    title = f"{machine()}; {args.new_tokens} new tokens, {args.rounds} rounds; OpenMP env {spin}"
    headers = ["setting", "bs", "ms/tok off", "ms/tok on", "speed on/off", "range", "same tokens"]
    print_table(headers, table, title)
    name = "overlap_cpu_libgomp_default.json" if args.libgomp_default else "overlap_cpu.json"
    write_json(name, {"machine": machine(), "omp_env": spin, "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()

"""Overlap scheduler on vs off: wall time per decode step at batch 16 on CPU, in one run.

    python bench/overlap_cpu.py [--batch 16] [--new-tokens 64] [--draft PATH]

Prints a table and writes bench/results/overlap_cpu.json (medians of interleaved runs). Tokens
must be identical in both modes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from eagleserve.scheduler.omp_spin import OVERLAP_SPIN_ENV, user_set_spin

# Before torch loads libgomp, for both modes alike: what the server's engine process gets with
# overlap on a CPU (scheduler/omp_spin.py); without overlap it changes nothing.
if not user_set_spin():
    os.environ.update(OVERLAP_SPIN_ENV)

import torch  # noqa: E402

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


def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"


def run(engine: Engine, prompts: list[str], new_tokens: int) -> tuple[float, int, list]:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, temperature=0.0))  # warm-up
    sched = engine.scheduler
    steps = 0
    real_step = sched.step

    def counting_step() -> list:
        nonlocal steps
        steps += 1
        return real_step()

    sched.step = counting_step  # type: ignore[method-assign]
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    sched.step = real_step  # type: ignore[method-assign]
    return dt, steps, [o["token_ids"] for o in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--draft", default=None, help="EAGLE head folder: also measure a chain")
    ap.add_argument("--repeats", type=int, default=3, help="median of this many runs per mode")
    ap.add_argument("--out", default="bench/results/overlap_cpu.json")
    args = ap.parse_args()
    prompts = (PROMPTS * ((args.batch + len(PROMPTS) - 1) // len(PROMPTS)))[: args.batch]
    settings: list[tuple[str, dict]] = [("target-only", {})]
    if args.draft:
        settings.append(
            (
                "EAGLE chain 3",
                dict(
                    speculative_algorithm="EAGLE",
                    speculative_draft_model_path=args.draft,
                    speculative_num_steps=3,
                    speculative_eagle_topk=1,
                    speculative_num_draft_tokens=4,
                ),
            )
        )
    rows = []
    for name, kw in settings:
        results = {}
        for overlap in (False, True):
            eng = Engine(
                model=args.model,
                device="cpu",
                kv_cache_tokens=16384,
                max_running_requests=max(args.batch, 8),
                disable_overlap_schedule=not overlap,
                **kw,
            )
            results[overlap] = run(eng, prompts, args.new_tokens)
            del eng
        (t_off, s_off, tok_off), (t_on, s_on, tok_on) = results[False], results[True]
        rows.append(
            dict(
                setting=name,
                batch=args.batch,
                new_tokens=args.new_tokens,
                ms_per_step_off=1000 * t_off / s_off,
                ms_per_step_on=1000 * t_on / s_on,
                steps_off=s_off,
                steps_on=s_on,
                tok_s_off=args.batch * args.new_tokens / t_off,
                tok_s_on=args.batch * args.new_tokens / t_on,
                identical_tokens=tok_off == tok_on,
            )
        )
    print(f"machine: {machine()}")
    print(
        f"{'setting':<16}{'bs':>4}{'ms/step off':>13}{'ms/step on':>12}{'tok/s off':>11}"
        f"{'tok/s on':>10}{'same tokens':>13}"
    )
    for r in rows:
        print(
            f"{r['setting']:<16}{r['batch']:>4}{r['ms_per_step_off']:>13.1f}"
            f"{r['ms_per_step_on']:>12.1f}{r['tok_s_off']:>11.1f}{r['tok_s_on']:>10.1f}"
            f"{str(r['identical_tokens']):>13}"
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": machine(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()

"""Prefix cache and chunked prefill on a CPU, in-process (the scheduler's own step loop, so the
times are the engine's, without HTTP):

1. A 4-turn conversation whose first turn is ~1,500 tokens, each turn re-sending the whole
   conversation: time to first token of every turn, radix cache on vs off.
2. 16 requests sharing a ~600-token system prompt, in 2 waves of 8: throughput on vs off.
3. A ~1,500-token prompt arriving while 8 streams decode: the streams' inter-token times while
   it is prefilled (p99 of the gaps that overlap its prefill) against their median without it,
   chunked prefill on vs off.

    python bench/prefix_cpu.py [--threads 2] [--spec]

Prints a table and writes bench/results/prefix_cpu.json. --spec serves with the shipped config's
EAGLE3 head (configs/smollm2-135m-eagle.yaml); the default is the target alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine_info, write_json  # noqa: E402
from eagleserve import Engine, SamplingParams  # noqa: E402
from eagleserve.messages import GenerateReqInput  # noqa: E402

TEXT = (
    "The committee met on a grey morning to review the harbour plans, the budget for the new "
    "bridge, the school timetable and the library's opening hours. Each member read a short "
    "statement, and the chair asked for questions before the vote. "
)
QUESTIONS = ["Summarise the meeting.", "What was decided about the bridge?",
             "Who asked questions?", "What comes next?", "Name one topic.",
             "Was there a vote?", "Describe the morning.", "What about the library?"]  # fmt: skip


def make_engine(args: argparse.Namespace, **kw: Any) -> Engine:
    spec: dict[str, Any] = {}
    if args.spec:
        spec = dict(speculative_algorithm="EAGLE3",
                    speculative_draft_model_path="builtin:smollm2-135m-eagle",
                    speculative_num_steps=3, speculative_eagle_topk=1,
                    speculative_num_draft_tokens=4, speculative_adaptive=True)  # fmt: skip
    return Engine(model="default", device="cpu", max_running_requests=16,
                  max_total_tokens=16384, **spec, **kw)  # fmt: skip


def tokens_of(engine: Engine, text: str, n: int) -> list[int]:
    """About `n` tokens of `text` repeated (whole sentences)."""
    tok = engine.tokenizer
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(text, add_special_tokens=False)
    return ids[:n]


def first_token_time(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple:
    """(seconds to the first token, all tokens) of one request run alone."""
    sched = engine.scheduler
    t0 = time.perf_counter()
    sched.add_request(GenerateReqInput("r", prompt, params))
    ttft, out = None, []
    while sched.has_work():
        for o in sched.step():
            if o.new_token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            out += o.new_token_ids
    return ttft, out


def conversation(args: argparse.Namespace, cache: bool) -> list[float]:
    engine = make_engine(args, disable_radix_cache=not cache)
    params = SamplingParams(max_new_tokens=32, temperature=0.0)
    first_token_time(engine, tokens_of(engine, TEXT, 64), params)  # warm-up
    prompt = tokens_of(engine, TEXT, 1500) + engine.tokenizer.encode(QUESTIONS[0])
    ttfts = []
    for turn in range(4):
        ttft, out = first_token_time(engine, prompt, params)
        ttfts.append(ttft)
        prompt = prompt + out + engine.tokenizer.encode(" " + QUESTIONS[turn + 1])
    return ttfts


def shared_system_prompt(args: argparse.Namespace, cache: bool) -> dict[str, float]:
    engine = make_engine(args, disable_radix_cache=not cache)
    system = tokens_of(engine, TEXT, 600)
    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    engine.generate([tokens_of(engine, "Warm up.", 8)], params)
    t0 = time.perf_counter()
    tokens = 0
    for wave in range(2):
        prompts = [system + engine.tokenizer.encode(f" ({wave}.{i}) {q}")
                   for i, q in enumerate(QUESTIONS)]  # fmt: skip
        tokens += sum(len(o["token_ids"]) for o in engine.generate(prompts, params))
    elapsed = time.perf_counter() - t0
    return {"seconds": elapsed, "tokens_per_s": tokens / elapsed}


def long_prompt_during_decode(
    args: argparse.Namespace, chunk: int | None, dynamic: bool = False, mixed: bool = False
) -> dict[str, Any]:
    """`dynamic`: chunks cut next to decodes (--enable-dynamic-chunking); `mixed`: a chunk runs
    in the decode step's forward (--enable-mixed-chunk)."""
    engine = make_engine(args, chunked_prefill_size=chunk, enable_dynamic_chunking=dynamic,
                         enable_mixed_chunk=mixed)  # fmt: skip
    sched = engine.scheduler
    params = SamplingParams(max_new_tokens=96, temperature=0.0, ignore_eos=True)
    engine.generate([tokens_of(engine, "Warm up.", 8)], params)
    for i, q in enumerate(QUESTIONS):
        # Streams: each token's gap is timed as it comes.
        sched.add_request(GenerateReqInput(f"s{i}", engine.tokenizer.encode(q), params, True))
    last: dict[str, float] = {}
    gaps: list[tuple[float, float]] = []  # (time of the token, gap before it)
    steps, arrival, first = 0, None, None
    long_prompt = tokens_of(engine, TEXT, 1500)
    while sched.has_work():
        if steps == 24:
            arrival = time.perf_counter()
            sched.add_request(
                GenerateReqInput("long", long_prompt, SamplingParams(max_new_tokens=4))
            )
        outs = sched.step()
        now = time.perf_counter()
        steps += 1
        for o in outs:
            if o.rid == "long":
                first = first or (now if o.new_token_ids else None)
            elif o.new_token_ids:
                if o.rid in last:
                    gaps += [(now, (now - last[o.rid]) / len(o.new_token_ids))] * len(
                        o.new_token_ids
                    )
                last[o.rid] = now
    assert arrival is not None and first is not None
    # A token's gap overlaps the long prefill when it ends after the arrival and starts before
    # the long prompt's first token; the median is that of the undisturbed gaps.
    overlaps = [t >= arrival and t - g <= first for t, g in gaps]
    during = [g for (_, g), o in zip(gaps, overlaps) if o] or [0.0]
    median = statistics.median(g for (_, g), o in zip(gaps, overlaps) if not o)
    ranked = sorted(during)

    def pct(q: float) -> float:
        return ranked[min(len(ranked) - 1, round(q * (len(ranked) - 1)))]

    p99 = pct(0.99)
    return {"chunked_prefill_size": sched.chunk_budget.max_tokens,
            "dynamic_chunking": sched.chunk_budget.dynamic, "mixed_chunk": sched.mixed_chunk,
            "itl_median_ms": 1e3 * median,
            "itl_p99_during_prefill_ms": 1e3 * p99, "ratio": p99 / median,
            "itl_during_prefill_ms": {q: 1e3 * pct(q) for q in (0.5, 0.9, 0.95, 0.99, 1.0)},
            "gaps_during_prefill": len(during),
            "long_prompt_ttft_s": first - arrival}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--spec", action="store_true", help="the shipped EAGLE3 head (adaptive)")
    p.add_argument("--chunk", type=int, default=None, help="chunk size (default: the CPU's)")
    p.add_argument(
        "--only-chunking",
        type=str,
        default=None,
        metavar="SIZES",
        help="only part 3, for these chunk sizes (comma-separated; 0 = one shot; N:dynamic = "
        "chunks of at most N, cut next to decodes: --enable-dynamic-chunking; N:mixed = chunks "
        "inside the decode step: --enable-mixed-chunk; N:dynamic:mixed = both)",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.only_chunking is not None:
        sizes = args.only_chunking.split(",")
        runs = {
            size: long_prompt_during_decode(
                args,
                int(size.split(":")[0]),
                dynamic="dynamic" in size.split(":"),
                mixed="mixed" in size.split(":"),
            )
            for size in sizes
        }
        print(f"machine: {machine_info()['description']}")
        for size, r in runs.items():
            print(
                f"long prompt during 8 decodes, chunk {size:>16}: ITL median "
                f"{r['itl_median_ms']:.1f} ms, p99 while prefilling "
                f"{r['itl_p99_during_prefill_ms']:.1f} ms ({r['ratio']:.2f}x; goal <= 2x), "
                f"its TTFT {r['long_prompt_ttft_s']:.2f} s"
            )
        write_json("prefix_cpu_chunking.json", {"args": vars(args), "machine": machine_info(),
                                                "long_prompt_during_decode": runs})  # fmt: skip
        return 0
    turns = {cache: conversation(args, cache) for cache in (False, True)}
    print("TTFT per turn (s), cache off / on:", turns, flush=True)
    shared = {cache: shared_system_prompt(args, cache) for cache in (False, True)}
    print("shared system prompt, cache off / on:", shared, flush=True)
    chunk_on = long_prompt_during_decode(args, args.chunk)
    chunk_off = long_prompt_during_decode(args, 0)
    speedup = statistics.mean(turns[False][1:]) / statistics.mean(turns[True][1:])
    print(f"machine: {machine_info()['description']}")
    print("TTFT per turn (s)         " + "  ".join(f"turn {i + 1:>2}" for i in range(4)))
    for cache in (False, True):
        row = "  ".join(f"{t:7.3f}" for t in turns[cache])
        print(f"  cache {'on ' if cache else 'off'}                {row}")
    print(f"  turns 2-4: {speedup:.1f}x lower TTFT with the cache (goal >= 5x)")
    print("shared system prompt: tokens/s off {:.1f}, on {:.1f} ({:.2f}x)".format(
        shared[False]["tokens_per_s"], shared[True]["tokens_per_s"],
        shared[True]["tokens_per_s"] / shared[False]["tokens_per_s"]))  # fmt: skip
    for name, r in (("chunked", chunk_on), ("one-shot", chunk_off)):
        print(
            f"long prompt during 8 decodes, {name:>8}: ITL median {r['itl_median_ms']:.1f} ms, "
            f"p99 while prefilling {r['itl_p99_during_prefill_ms']:.1f} ms "
            f"({r['ratio']:.2f}x; goal <= 2x), its TTFT {r['long_prompt_ttft_s']:.2f} s"
        )
    path = write_json("prefix_cpu.json", {
        "args": vars(args), "machine": machine_info(),
        "ttft_s_per_turn": {"cache_off": turns[False], "cache_on": turns[True]},
        "turn2plus_ttft_speedup": speedup,
        "shared_system_prompt": {"cache_off": shared[False], "cache_on": shared[True]},
        "long_prompt_during_decode": {"chunked": chunk_on, "one_shot": chunk_off},
    })  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Greedy decode throughput on CPU: eagleserve vs transformers `generate`, same model, one run.

    python bench/decode_cpu.py [--new-tokens 64] [--batches 1,16] [--repeats 3] [--threads N]
        [--overlap-row]

SmolLM2-135M-Instruct (the default model, a Q4_1/Q8_0 GGUF), 64 new tokens per sequence (EOS
ignored, so every sequence has exactly that many). transformers loads the GGUF as it can, de-
quantized to fp32, and runs `generate(do_sample=False)` with left padding for batches > 1.
eagleserve runs through the offline `Engine` with its CPU defaults (no overlap scheduler) on the
same fp32 weights, and on the GGUF's own packed 4-bit weights (its default for a GGUF on CPU).
Both also run the weights rounded to bf16 (transformers' fastest CPU dtype here).
Tokens/s = new tokens of the batch / wall time of the whole call (prefill included),
median of `--repeats` runs after one warm-up. Prints a table and writes
bench/results/decode_cpu.json.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine, machine_info, median, print_table, time_runs, write_json  # noqa: E402
from eagleserve import Engine, SamplingParams  # noqa: E402
from eagleserve.models.loader import gguf_source, resolve_model_path  # noqa: E402

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash map works.",
    "List five uses of vinegar at home.",
    "def quicksort(arr):",
    "What causes the seasons on Earth?",
    "Translate 'good morning' into French, Spanish and German.",
    "Summarize the plot of Romeo and Juliet.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue? Answer in two sentences.",
    "Write a haiku about autumn leaves.",
    "What is the difference between a list and a tuple in Python?",
    "Describe the water cycle.",
    "Name three famous painters and one work by each.",
    "How do vaccines work?",
    "Write a limerick about a cat who loves to code.",
    "Explain recursion to a five year old.",
]


def eagleserve_runner(engine: Engine, prompts: list[list[int]], new_tokens: int) -> Any:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    def run() -> list[list[int]]:
        outs = engine.generate(prompts, params)
        assert all(len(o["token_ids"]) == new_tokens for o in outs)
        return [o["token_ids"] for o in outs]

    return run


def hf_runner(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int) -> Any:
    # No EOS: exactly `new_tokens` per sequence, as eagleserve with ignore_eos (min_new_tokens
    # would instead mask EOS and change the tokens).
    gen_cfg = copy.deepcopy(model.generation_config)
    gen_cfg.eos_token_id = None
    gen_cfg.pad_token_id = pad_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run() -> list[list[int]]:
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                generation_config=gen_cfg,
                max_new_tokens=new_tokens,
                do_sample=False,
            )
        return out[:, width:].tolist()

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--overlap-row", action="store_true", help="also eagleserve fp32, overlap on")
    ap.add_argument("--no-hf-bf16", action="store_true", help="skip the two bf16 rows")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    assert max(batches) <= len(PROMPTS)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    # Chat-formatted prompts, so the model answers instead of ending at once.
    prompt_ids = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for p in PROMPTS
    ]
    prompt_ids = [list(p) for p in prompt_ids]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    print(f"machine: {machine()}")
    info = machine_info()

    systems: dict[str, Any] = {}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    systems["transformers"] = lambda p: hf_runner(hf, p, args.new_tokens, pad_id)
    if not args.no_hf_bf16:
        hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        systems["transformers bf16"] = lambda p: hf_runner(hf16, p, args.new_tokens, pad_id)
    common_args = dict(
        device="cpu", dtype="float32", max_running_requests=max(batches), max_total_tokens=8192
    )
    engines = {"eagleserve fp32": Engine(model=path, **common_args)}
    if not args.no_hf_bf16:
        engines["eagleserve bf16"] = Engine(model=path, **{**common_args, "dtype": "bfloat16"})
    if args.overlap_row:
        engines["eagleserve fp32 (overlap)"] = Engine(
            model=path, disable_overlap_schedule=False, **common_args
        )
    if gguf_source(args.model) is not None:
        # The GGUF's own Q4_1/Q8_0 weights, packed (bf16 activations inside the matmuls).
        int4_args = {**common_args, "dtype": "auto", "quantization": "gguf"}
        engines["eagleserve int4 (default)"] = Engine(model=args.model, **int4_args)
    for name, engine in engines.items():
        systems[name] = lambda p, e=engine: eagleserve_runner(e, p, args.new_tokens)

    rows: list[list[Any]] = []
    results: list[dict[str, Any]] = []
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    for bs in batches:
        runs = {name: make(prompt_ids[:bs]) for name, make in systems.items()}
        for run in runs.values():
            run()  # warm-up
        # Repeats interleaved across systems, so that load from other jobs hits all alike.
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, run in runs.items():
                secs, tokens[(name, bs)] = time_runs(run, 1)
                times[name] += secs
        base = median(times["transformers"])
        for name, ts in times.items():
            t = median(ts)
            tps = bs * args.new_tokens / t
            rows.append([name, bs, tps, base / t, 1000 * t / args.new_tokens, min(ts), max(ts)])
            results.append(
                {
                    "system": name,
                    "batch": bs,
                    "new_tokens": args.new_tokens,
                    "tokens_per_s": tps,
                    "x_transformers_fp32": base / t,
                    "ms_per_step": 1000 * t / args.new_tokens,
                    "wall_s": ts,
                }
            )
            print(f"  {name:<26} batch {bs:>2}: {tps:8.1f} tok/s", flush=True)
    for bs in batches:
        ref = tokens[("transformers", bs)]
        for name in engines:
            same = sum(a == b for a, b in zip(tokens[(name, bs)], ref, strict=True))
            for r in results:
                if r["system"] == name and r["batch"] == bs:
                    r["sequences_equal_to_transformers"] = f"{same}/{bs}"
    print()
    print_table(
        ["system", "batch", "tok/s", "x transformers", "ms/step", "min s", "max s"],
        rows,
        title=f"greedy decode, {args.new_tokens} new tokens, SmolLM2-135M -- {machine()}",
    )
    for r in results:
        if "sequences_equal_to_transformers" in r:
            print(
                f"{r['system']} batch {r['batch']}: sequences equal to transformers: "
                f"{r['sequences_equal_to_transformers']}"
            )
    info["load_average_1min_end"] = machine_info()["load_average_1min"]
    path_out = write_json(
        "decode_cpu.json",
        {
            "benchmark": "decode_cpu",
            "model": path,
            "dtype": "transformers and eagleserve fp32: float32; int4: the GGUF's packed weights",
            "machine": info,
            "repeats": args.repeats,
            "results": results,
        },
    )
    print(f"wrote {path_out}")


if __name__ == "__main__":
    main()

"""Sampled decoding: what each sampling setting costs, and whether seeded requests give the
target's own tokens under speculation, in one run.

    python bench/sampling.py [--device cpu] [--model default] [--deterministic] [--prompts 6]
                             [--new-tokens 64] [--rounds 3] [--batch 1] [--threads N]
                             [--torch-sampling] [--argmax-drafts] [--out PATH]

The default model (on a CPU the packed target as served), held-out MT-bench chat prompts, one
request at a time (`--batch N`: N at once), EOS ignored; `--deterministic` serves with
`--enable-deterministic-inference` (a GPU in half precision needs it for equal tokens).
Sampling settings: greedy, temperature 1, temperature 0.7 with top_p 0.9, temperature 1 with
top_p 0.95, temperature 0.8 with top_k 50; every sampled request has its own seed. Each runs
through target-only, EAGLE with the built-in EAGLE-3 head as a fixed 3-step chain, and `make
serve`'s adaptive depth 0..3. Per cell: tokens/s (median round), tau and acceptance by depth
(P(at least d drafts accepted) per verify), and how many requests' tokens equal target-only's
with the same seed (all rounds), so "lossless" here means equal token ids. `--torch-sampling`
adds target-only and chain-3 rows that sample with torch ops instead of the device's sampling
kernel (on a CPU kernels/cpu_sample.cpp, on a GPU kernels/triton_sample.py and, for rows
without top-k / top-p, kernels/triton_top1.py: what `--disable-fused-kernels` does to the
target's sampling; a GPU's draft graphs keep the kernels they were captured with), on the same
engines. `--argmax-drafts` adds a chain-3 row whose sampled requests draft the head's argmax
(the chain's drafts before they were drawn on the target's noise, spec/draft_extend.py
`DraftDraw`; on a GPU in the greedy batches' draft graphs) on the same engine and texts: the
draw's effect on tau alone. Rounds interleave
settings and engines, reversing the order every other round. Prints a table; writes
bench/results/sampling_<device>.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import data  # noqa: E402
from bench.common import (  # noqa: E402
    against_baseline,
    interleaved_rounds,
    machine,
    machine_info,
    print_table,
    write_json,
)
from bench.gpu_table import chain  # noqa: E402
from eagleserve import Engine, SamplingParams  # noqa: E402

SPEC = chain(3)  # the built-in EAGLE-3 head, a fixed 3-step chain
SETTINGS = {  # name -> SamplingParams fields
    "greedy": dict(temperature=0.0),
    "T=1": dict(temperature=1.0),
    "T=0.7 top_p=0.9": dict(temperature=0.7, top_p=0.9),
    "T=1 top_p=0.95": dict(temperature=1.0, top_p=0.95),
    "T=0.8 top_k=50": dict(temperature=0.8, top_k=50),
}


@contextmanager
def torch_sampling(engine: Engine) -> Iterator[None]:
    """The engine's sampled rows drawn by torch ops for a while (its batches made meanwhile)."""
    runner = engine.scheduler.worker.runner
    saved, runner.draw_kernel = runner.draw_kernel, None
    try:
        yield
    finally:
        runner.draw_kernel = saved


@contextmanager
def argmax_drafts(engine: Engine) -> Iterator[None]:
    """The engine's sampled requests drafting the head's argmax for a while: its drafter's
    `_draw` (which makes their drafts draws) answers None, as for greedy rows, and its draft
    graphs (an accelerator's) are those of greedy batches."""
    drafter = engine.scheduler.worker.drafter
    drafter._draw = lambda sampling, positions: None  # type: ignore[method-assign]
    saved, drafter.draw_modes = drafter.draw_modes, ("argmax",)
    try:
        yield
    finally:
        del drafter._draw
        drafter.draw_modes = saved


def run(
    engine: Engine, prompts: list[list[int]], params: list[SamplingParams], batch: int
) -> dict[str, Any]:
    before = engine.stats()
    t0 = time.perf_counter()
    tokens = [
        out["token_ids"]
        for i in range(0, len(prompts), batch)
        for out in engine.generate(prompts[i : i + batch], params[i : i + batch])
    ]
    dt = time.perf_counter() - t0
    after = engine.stats()
    res: dict[str, Any] = dict(tok_s=sum(map(len, tokens)) / dt, tokens=tokens)
    calls = after.spec_verify_calls_total - before.spec_verify_calls_total
    if calls:
        res["tau"] = (after.spec_accepted_tokens_total - before.spec_accepted_tokens_total) / calls
        per = zip(after.spec_accepted_per_position, before.spec_accepted_per_position)
        res["accept_by_depth"] = [round((a - b) / calls, 3) for a, b in per]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="default")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="requests generated at once")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--torch-sampling", action="store_true",
                    help="also target-only and chain 3 sampling with torch ops")  # fmt: skip
    ap.add_argument("--argmax-drafts", action="store_true",
                    help="also chain 3, its sampled requests drafting the argmax")  # fmt: skip
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/...)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    common = dict(model=args.model, device=args.device,
                  max_total_tokens=max(4096, 512 * args.batch),
                  max_running_requests=max(4, args.batch),
                  enable_deterministic_inference=args.deterministic)  # fmt: skip
    engines = {
        "target-only": Engine(**common),
        "EAGLE chain 3": Engine(**common, **SPEC),
        "EAGLE adaptive": Engine(**common, **SPEC, speculative_adaptive=True),
    }
    tok = engines["target-only"].tokenizer
    prompts = [data.chat_ids(tok, q) for q in data.mt_bench(args.prompts)]
    params = {
        name: [SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, seed=1000 + i, **kw)
               for i in range(len(prompts))]
        for name, kw in SETTINGS.items()
    }  # fmt: skip
    for eng in engines.values():  # warm-up, at the batch size measured (its first shapes)
        eng.generate(prompts[: args.batch], SamplingParams(max_new_tokens=8))
    # name -> (engine, what runs it differently: None, "torch sampling" or "argmax drafts")
    variants: dict[str, tuple[Engine, str | None]] = {
        name: (eng, None) for name, eng in engines.items()
    }
    if args.torch_sampling:
        for name in ("target-only", "EAGLE chain 3"):
            variants[f"{name}, torch sampling"] = (engines[name], "torch sampling")
    if args.argmax_drafts:
        variants["EAGLE chain 3, argmax drafts"] = (engines["EAGLE chain 3"], "argmax drafts")

    def one(setting: str, name: str) -> dict[str, Any]:
        eng, how = variants[name]
        if how is None:
            return run(eng, prompts, params[setting], args.batch)
        with torch_sampling(eng) if how == "torch sampling" else argmax_drafts(eng):
            return run(eng, prompts, params[setting], args.batch)

    runs = interleaved_rounds(args.rounds, list(SETTINGS), list(variants), one)
    rows: list[dict[str, Any]] = []
    for setting in SETTINGS:
        for name in variants:
            rs = runs[(setting, name)]
            cell = against_baseline(rs, runs[(setting, "target-only")])
            rows.append(dict(setting=setting, engine=name, **cell,
                             accept_by_depth=rs[0].get("accept_by_depth")))  # fmt: skip
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else None
    print(f"machine: {machine()}" + (f", {gpu}" if gpu else ""))
    print_table(
        ["sampling", "engine", "tok/s", "x target-only", "tau", "accept by depth", "= target-only"],
        [
            [
                r["setting"],
                r["engine"],
                f"{r['tok_s']:.1f}",
                f"{r['speedup']:.2f}",
                "-" if r["tau"] is None else f"{r['tau']:.2f}",
                " ".join(f"{a:.2f}" for a in r["accept_by_depth"] or []) or "-",
                f"{r['equal']}/{r['compared']}",
            ]
            for r in rows
        ],
        title=f"batch {args.batch}, {len(prompts)} MT-bench prompts x {args.new_tokens} tokens, "
        f"{args.rounds} rounds",
    )
    payload = dict(machine=machine_info(), gpu=gpu, args=vars(args), rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=2)
        path = args.out
    else:
        suffix = f"_batch{args.batch}" if args.batch > 1 else ""
        path = write_json(f"sampling_{args.device}{suffix}.json", payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

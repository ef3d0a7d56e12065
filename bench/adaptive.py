"""Adaptive speculation vs fixed chains vs target-only, on the default model, in one run.

    python bench/adaptive.py [--batches 1,4,16] [--sets mtbench,humaneval,copy] [--rounds 2]
        [--draft HEAD] [--out NAME.json]
        [--new-tokens 48] [--overlap] [--threads N] [--whole-chains] [--pricing-twins]

For every prompt set and batch size, one row per setting: target-only, fixed 1- and 3-chains
(the shipped EAGLE3 head, or `--draft`), and adaptive (chain lengths 0..3 chosen per iteration).
Settings run interleaved (adaptive beside target-only, the order rotated one place from one
round to the next: with as many rounds as settings, each takes every place once; a batch smaller
than 8 runs in waves of distinct prompts, 8 requests in all, the settings taking turns wave by
wave, the order reversed from one wave to the next), on the packed-int4 SmolLM2 as `make serve`
runs it (greedy, EOS ignored; the prefix cache off, so that every round prefills its prompts
whole, the head's share of a prefill included). Reports tok/s (median over rounds), the ratio to
target-only (median and range of each round's ratio to the same round's target-only run), tau,
acceptance by depth, the chain lengths adaptive chose (and, for the chains, the lengths they
drafted: a chain stops short where the head is unsure of its drafts,
--speculative-min-path-prob; with `--whole-chains`, chain 3 and adaptive also run drafting every
step, each beside its twin; with `--pricing-twins`, adaptive also runs as it priced before three
changes, one at a time: its cut chains priced as whole ones (before spec/chain_cut.py), its
drafting iterations priced on a scale of their own, not over the decode's
(`CostTable.drafting_follows_decode`), and its iterations priced without the host's time
between forwards (`CostTable.iteration`)), and whether every setting's tokens equal target-only's.
Writes bench/results/adaptive.json.

Prompt sets: MT-bench first turns, HumanEval, "copy" (passages the answer must repeat:
acceptance is high there, so longer chains pay), and "mixed" (the three interleaved in one
batch). Also writes a PNG of the ratios to target-only.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from eagleserve.scheduler.omp_spin import use_overlap_spin  # noqa: E402

# Before torch loads libgomp, for every setting alike: what the server's engine process gets
# with --overlap on a CPU (scheduler/omp_spin.py); without overlap it changes nothing.
use_overlap_spin()

import torch  # noqa: E402

from bench.common import machine, median, print_table, rotated, write_json  # noqa: E402
from bench.data import human_eval, mt_bench  # noqa: E402
from eagleserve import Engine, SamplingParams  # noqa: E402

BUILTIN_HEAD = "builtin:smollm2-135m-eagle"


def settings(
    draft: str, whole_chains: bool = False, pricing_twins: bool = False
) -> dict[str, dict[str, Any]]:
    """Each setting's engine arguments; `whole_chains` adds chain 3 and adaptive drafting every
    step (--speculative-min-path-prob 0) beside the default's chains cut by the head's path
    probability; `pricing_twins` adaptive as the default runs it, twice more, each controller
    then pricing as before one change (`PRICING_TWINS`)."""
    head = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                speculative_eagle_topk=1)  # fmt: skip
    chain3 = dict(head, speculative_num_steps=3, speculative_num_draft_tokens=4)
    out = {
        "target-only": {},
        "chain 1": dict(head, speculative_num_steps=1, speculative_num_draft_tokens=2),
        "chain 3": chain3,
        "adaptive 0..3": dict(chain3, speculative_adaptive=True),
    }
    if whole_chains:
        out[WHOLE["chain 3"]] = dict(chain3, speculative_min_path_prob=0.0)
        out[WHOLE["adaptive 0..3"]] = dict(chain3, speculative_adaptive=True,
                                           speculative_min_path_prob=0.0)  # fmt: skip
    if pricing_twins:
        out |= dict.fromkeys(PRICING_TWINS, out["adaptive 0..3"])
    return out


def price_as_before(name: str, engine: Engine) -> None:
    """The engine's adaptive controller as it priced before one change: learning nothing of cut
    chains (spec/chain_cut.py), so every planned depth is priced whole; its drafting scale its
    own, not a ratio over the decode scale; or without the host's time between forwards
    (`CostTable.iteration`)."""
    controller = engine.scheduler.worker.controller  # type: ignore[union-attr]
    if name == PRICED_WHOLE:
        controller.observe_chain = lambda *args: None
    elif name == NO_GAPS:
        controller.note_forward = lambda *args: None
    else:
        controller.costs.drafting_follows_decode = False


PRICED_WHOLE = "adaptive 0..3, cut chains priced whole"
OWN_SCALE = "adaptive 0..3, drafting on its own scale"
NO_GAPS = "adaptive 0..3, no time between forwards"
PRICING_TWINS = (PRICED_WHOLE, OWN_SCALE, NO_GAPS)
# Run order within a round (rotated from round to round, `rotated`): adaptive beside target-only,
# and each setting beside its whole-chain twin where there is one.
ORDER = ["target-only", "adaptive 0..3", "adaptive 0..3, whole chains", PRICED_WHOLE, OWN_SCALE,
         NO_GAPS, "chain 1", "chain 3", "chain 3, whole chain"]  # fmt: skip
WHOLE = {"chain 3": "chain 3, whole chain", "adaptive 0..3": "adaptive 0..3, whole chains"}
MIN_REQUESTS = 8
COPY_TEXT = [
    "The mitochondria is the powerhouse of the cell. It produces energy through respiration.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    "Roses are red, violets are blue, sugar is sweet, and so are you.",
    "To be, or not to be, that is the question: whether tis nobler in the mind to suffer.",
]


def prompt_set(name: str, n: int) -> list[str]:
    if name == "mtbench":
        return mt_bench(n)
    if name == "humaneval":
        return human_eval(n)
    if name == "copy":
        return [f"Repeat this text exactly, twice:\n\n{t}" for t in COPY_TEXT][:n]
    if name == "mixed":  # one batch holds all three kinds of request
        parts = [prompt_set(s, n) for s in ("mtbench", "humaneval", "copy")]
        return [p for group in zip(*parts) for p in group][:n]
    raise SystemExit(f"unknown prompt set {name!r}")


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )


def run_round(
    engines: dict[str, Engine], order: list[str], prompts: list[list[int]], batch: int, new: int
) -> dict[str, dict[str, Any]]:
    """One round: every setting generates the same waves of `batch` distinct prompts
    (MIN_REQUESTS requests at least, so that a small batch's figure is not one short
    generation's), setting after setting within each wave in `order`, reversed from one wave
    to the next: a drift in the host's speed meets every setting alike."""
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    waves = math.ceil(MIN_REQUESTS / batch)
    before = {name: engines[name].stats() for name in order}
    secs = dict.fromkeys(order, 0.0)
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in order}
    for w in range(waves):
        reqs = [prompts[(w * batch + i) % len(prompts)] for i in range(batch)]
        for name in order if w % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            out[name] += engines[name].generate(reqs, params)
            secs[name] += time.perf_counter() - t0
    return {
        name: summary(before[name], engines[name].stats(), waves * batch * new / secs[name],
                      [o["token_ids"] for o in out[name]])
        for name in order
    }  # fmt: skip


def summary(before: Any, after: Any, tok_s: float, tokens: list[list[int]]) -> dict[str, Any]:
    verifies = after.spec_verify_calls_total - before.spec_verify_calls_total
    accepted = after.spec_accepted_tokens_total - before.spec_accepted_tokens_total
    depth = [
        (a - b) / verifies if verifies else 0.0
        for a, b in zip(after.spec_accepted_per_position, before.spec_accepted_per_position)
    ]
    chosen = [
        a - b
        for a, b in zip(after.spec_iterations_per_num_drafts, before.spec_iterations_per_num_drafts)
    ]
    return {
        "tok_s": tok_s,
        "tau": accepted / verifies if verifies else None,
        "acceptance_by_depth": depth,
        "iterations_per_k": chosen,
        "tokens": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--sets", default="mtbench,humaneval,copy,mixed")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--overlap", action="store_true", help="overlap scheduler on (CPU: off)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--draft", default=BUILTIN_HEAD, help="the EAGLE3 head (default: shipped)")
    ap.add_argument("--whole-chains", action="store_true",
                    help="also chain 3, adaptive at --speculative-min-path-prob 0")  # fmt: skip
    ap.add_argument("--pricing-twins", action="store_true",
                    help="also adaptive pricing as before each of three changes")  # fmt: skip
    ap.add_argument("--out", default=None, help="JSON name under bench/results (and its PNG)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    engines = {
        name: Engine(
            model="default",
            device="cpu",
            max_total_tokens=16384,
            max_running_requests=max(batches),
            disable_overlap_schedule=not args.overlap,
            disable_radix_cache=True,  # every round prefills its prompts whole, as fresh ones
            **kw,
        )
        for name, kw in settings(args.draft, args.whole_chains, args.pricing_twins).items()
    }
    for name in PRICING_TWINS if args.pricing_twins else ():
        price_as_before(name, engines[name])
    tok = engines["target-only"].tokenizer
    warm = SamplingParams(max_new_tokens=8, temperature=0.0)
    for eng in engines.values():
        eng.generate(["Hello"], warm)
    rows, table = [], []
    for set_name in args.sets.split(","):
        prompts = [chat_ids(tok, p) for p in prompt_set(set_name, 16)]
        for bs in batches:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
            for r in range(args.rounds):
                order = rotated([n for n in ORDER if n in engines], r)
                for name, result in run_round(engines, order, prompts, bs, args.new_tokens).items():
                    runs[name].append(result)
            base = [r["tok_s"] for r in runs["target-only"]]
            ref = runs["target-only"][0]["tokens"]
            for name, rs in runs.items():
                tok_s = median([r["tok_s"] for r in rs])
                # Each round's ratio to the same round's target-only run (the machine's speed
                # drifts between rounds, less within one): median and range.
                ratios = sorted(r["tok_s"] / b for r, b in zip(rs, base, strict=True))
                last = rs[-1]
                row = {
                    "set": set_name,
                    "batch": bs,
                    "setting": name,
                    "tok_s": tok_s,
                    "x_target": median(ratios),
                    "x_target_range": [ratios[0], ratios[-1]],
                    "tau": last["tau"],
                    "acceptance_by_depth": last["acceptance_by_depth"],
                    "iterations_per_k": last["iterations_per_k"],
                    "lossless": all(r["tokens"] == ref for r in rs),
                }
                rows.append(row)
                table.append([
                    set_name, bs, name, tok_s, row["x_target"],
                    f"{ratios[0]:.2f}-{ratios[-1]:.2f}",
                    "-" if row["tau"] is None else round(row["tau"], 2),
                    " ".join(f"{a:.2f}" for a in row["acceptance_by_depth"]) or "-",
                    " ".join(str(c) for c in row["iterations_per_k"]) or "-",
                    row["lossless"],
                ])  # fmt: skip
                print(table[-1], flush=True)
    title = (
        f"{machine()}; greedy, {args.new_tokens} new tokens, overlap "
        f"{'on' if args.overlap else 'off'}, median of {args.rounds} interleaved rounds"
    )
    print_table(
        ["set", "bs", "setting", "tok/s", "x target", "range", "tau", "accept by depth",
         "iters per k", "lossless"],
        table,
        title,
    )  # fmt: skip
    name = args.out or ("adaptive_overlap.json" if args.overlap else "adaptive.json")
    meta = {"machine": machine(), "new_tokens": args.new_tokens, "rounds": args.rounds,
            "draft": args.draft, "whole_chains": args.whole_chains,
            "pricing_twins": args.pricing_twins}  # fmt: skip
    # What the controller decided from, at the end: its costs (ms per iteration, by batch
    # bucket and k) and the engine-wide acceptance by depth.
    adaptive = engines["adaptive 0..3"].scheduler
    costs = adaptive.worker.controller.costs  # type: ignore[union-attr]
    meta["adaptive_costs_ms"] = {
        f"{b},{k}": 1e3 * costs.cost(b, k) for b, k in sorted(costs.seconds)
    }
    meta["adaptive_acceptance_ema"] = list(adaptive.spec_stats.acceptance_ema)
    print("adaptive costs (ms by bucket,k):", meta["adaptive_costs_ms"])
    path = write_json(name, {**meta, "overlap": args.overlap, "rows": rows})
    plot(rows, path.replace(".json", ".png"), title)
    print(path)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r["set"], r["batch"]) for r in rows}, key=lambda c: (c[0], c[1]))
    names = [n for n in ORDER if n != "target-only" and any(r["setting"] == n for r in rows)]
    fig, ax = plt.subplots(figsize=(max(8, len(cells) * 0.9), 4))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        by = {(r["set"], r["batch"]): r["x_target"] for r in rows if r["setting"] == name}
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(cells))]
        ax.bar(xs, [by[c] for c in cells], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(0.98, color="gray", linewidth=0.6, linestyle="--")
    ax.set_xticks(range(len(cells)), [f"{s}\nbs {b}" for s, b in cells], fontsize=8)
    ax.set_ylabel("tok/s / target-only")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

"""Speculative decoding on CPU: the default model with its EAGLE head, on held-out prompts.

    python bench/spec_cpu.py [--prompts-per-set 4] [--new-tokens 128] [--batches 1,4] [--quick]

In one run, greedy, `--new-tokens` new tokens (EOS ignored), the default packed target (or
`--target-dtype float32`): transformers `generate`; eagleserve
without speculation; chains with 3 and 5 steps, drafted whole (`--speculative-min-path-prob
0`: each tau is the head's over every depth, as before chains were cut short; the server's
default cuts them, bench/adaptive.py --whole-chains compares); a tree (top-k 2). For each
prompt set (MT-bench first, then HumanEval and math; bench/data.py; none seen in training) and
batch size: tokens/s, speedup over each baseline, mean accepted length tau (bonus token
included), acceptance by draft depth, and losslessness (speculative tokens == eagleserve
target-only tokens). A cost profile (mean ms per target decode, verify, draft step, draft
extend) says what limits the speedup. Prints tables; writes bench/results/spec_cpu.json and
.png (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import data  # noqa: E402
from bench.common import machine, machine_info, print_table, write_json  # noqa: E402
from eagleserve import Engine, SamplingParams  # noqa: E402
from eagleserve.models.loader import resolve_draft_path, resolve_model_path  # noqa: E402

# The chains draft every step (--speculative-min-path-prob 0): tau and acceptance by depth are
# the head's over whole chains, as every tau here before chains were cut short.
WHOLE = dict(speculative_eagle_topk=1, speculative_min_path_prob=0.0)
SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("eagleserve", {}),
    ("chain 3", dict(WHOLE, speculative_num_steps=3, speculative_num_draft_tokens=4)),
    ("chain 5", dict(WHOLE, speculative_num_steps=5, speculative_num_draft_tokens=6)),
    (
        "tree k2",
        dict(speculative_num_steps=4, speculative_eagle_topk=2, speculative_num_draft_tokens=8),
    ),
]


class Timers:
    """Wall time per call of wrapped bound methods (instance attributes shadow the class's)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, obj: Any, attr: str, name: str | None = None) -> None:
        fn = getattr(obj, attr)

        def timed(*a: Any, **kw: Any) -> Any:
            key = name or f"{attr}:{a[0].mode}"  # runner.forward(fb): keyed by forward mode
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            self.total[key] += time.perf_counter() - t0
            self.calls[key] += 1
            return out

        setattr(obj, attr, timed)

    def ms(self) -> dict[str, float]:
        return {k: 1000 * self.total[k] / self.calls[k] for k in self.total}


def run_engine(engine: Engine, prompts: list[list[int]], bs: int, new: int) -> dict[str, Any]:
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    before = engine.stats()
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), bs):
        outs += engine.generate(prompts[i : i + bs], params)
    dt = time.perf_counter() - t0
    after = engine.stats()
    calls = after.spec_verify_calls_total - before.spec_verify_calls_total
    res: dict[str, Any] = dict(tok_s=len(prompts) * new / dt, tokens=[o["token_ids"] for o in outs])
    if calls:
        res["accept_lengths"] = [o["spec_accept_length"] for o in outs]  # tau of each prompt
        res["tau"] = (after.spec_accepted_tokens_total - before.spec_accepted_tokens_total) / calls
        per = [
            a - b
            for a, b in zip(after.spec_accepted_per_position, before.spec_accepted_per_position)
        ]
        res["accept_by_depth"] = [round(p / calls, 3) for p in per]  # P(>= d+1 drafts accepted)
    return res


def run_hf(model: Any, prompts: list[list[int]], bs: int, new: int, pad: int) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(prompts), bs):
        chunk = prompts[i : i + bs]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad,
        )
    return len(prompts) * new / (time.perf_counter() - t0)


def build_engines(
    draft: str, algorithm: str, target_dtype: str, kv_cache_dtype: str = "auto"
) -> tuple[dict[str, Engine], dict]:
    """`target_dtype` "auto" is the default model as served (the GGUF's packed 4-bit weights on
    a CPU); "float32" the same weights de-quantized. `kv_cache_dtype` as --kv-cache-dtype."""
    engines, timers = {}, {}
    for name, kw in SETTINGS:
        spec = dict(speculative_algorithm=algorithm, speculative_draft_model_path=draft, **kw)
        eng = Engine(
            model="default",
            dtype=target_dtype,
            device="cpu",
            max_total_tokens=8192,
            max_running_requests=8,
            disable_overlap_schedule=True,
            kv_cache_dtype=kv_cache_dtype,
            **(spec if kw else {}),
        )
        t = Timers()
        worker = eng.scheduler.worker
        if kw:
            t.wrap(worker.runner, "forward")
            t.wrap(worker.drafter, "_step", "draft step")
            t.wrap(worker.drafter, "extend", "draft extend")
        else:
            t.wrap(worker.runner, "forward")
        engines[name], timers[name] = eng, t
    return engines, timers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--draft", default="builtin:smollm2-135m-eagle")
    ap.add_argument("--prompts-per-set", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--quick", action="store_true", help="2 prompts per set, 48 tokens, batch 1")
    ap.add_argument("--sets", default=data.DEFAULT_SETS,
                    help=f"comma-separated, of {', '.join(data.SETS)}")  # fmt: skip
    ap.add_argument("--out", default="spec_cpu.json", help="file name in bench/results (and .png)")
    ap.add_argument(
        "--target-dtype",
        default="auto",
        choices=["auto", "float32"],
        help="auto: the packed GGUF target as served; float32: de-quantized",
    )
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "float16"],
                    help="the K/V cache's type (auto: fp16 for the packed target)")  # fmt: skip
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.prompts_per_set, args.new_tokens, args.batches = 2, 48, "1"
    batches = [int(b) for b in args.batches.split(",")]
    path = resolve_model_path("default")
    draft = resolve_draft_path(args.draft)
    with open(os.path.join(draft, "config.json")) as f:
        algorithm = "EAGLE3" if "Eagle3" in json.load(f)["architectures"][0] else "EAGLE"
    engines, timers = build_engines(draft, algorithm, args.target_dtype, args.kv_cache_dtype)
    tok = engines["eagleserve"].tokenizer
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n = args.prompts_per_set
    sets = {name: data.SETS[name](n) for name in args.sets.split(",")}
    rows: list[dict[str, Any]] = []
    for set_name, prompts in sets.items():
        ids = [data.chat_ids(tok, p) for p in prompts]
        for bs in batches:
            engines["eagleserve"].generate(ids[:1], SamplingParams(max_new_tokens=4))  # warm-up
            hf_tps = None
            if hf is not None:
                with torch.inference_mode():
                    hf_tps = run_hf(hf, ids, bs, args.new_tokens, tok.pad_token_id or 0)
                rows.append(dict(set=set_name, batch=bs, setting="transformers", tok_s=hf_tps))
            base = run_engine(engines["eagleserve"], ids, bs, args.new_tokens)
            for name, _ in SETTINGS:
                r = (
                    base
                    if name == "eagleserve"
                    else run_engine(engines[name], ids, bs, args.new_tokens)
                )
                same = sum(a == b for a, b in zip(r["tokens"], base["tokens"])) / len(ids)
                row = dict(set=set_name, batch=bs, setting=name, lossless=same)
                row.update({k: v for k, v in r.items() if k != "tokens"})
                row["speedup_vs_eagleserve"] = r["tok_s"] / base["tok_s"]
                if hf_tps:
                    row["speedup_vs_transformers"] = r["tok_s"] / hf_tps
                rows.append(row)
    report(rows, timers, args, algorithm)


def report(rows: list[dict[str, Any]], timers: dict[str, Timers], args: Any, algo: str) -> None:
    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    table = [
        [
            r["set"],
            r["batch"],
            r["setting"],
            f"{r['tok_s']:.1f}",
            f(r.get("speedup_vs_eagleserve"), ".2f"),
            f(r.get("speedup_vs_transformers"), ".2f"),
            f(r.get("tau"), ".2f"),
            " ".join(f"{a:.2f}" for a in r.get("accept_by_depth", [])) or "-",
            f(r.get("lossless") and 100 * r["lossless"], ".0f"),
        ]
        for r in rows
    ]
    print_table(
        [
            "set",
            "bs",
            "setting",
            "tok/s",
            "x eagleserve",
            "x transformers",
            "tau",
            "P(accept >= d)",
            "lossless %",
        ],
        table,
        title=f"spec_cpu ({algo} head {args.draft}) on {machine()}",
    )
    profile = {name: t.ms() for name, t in timers.items()}
    print("\nmean ms per call (all batch sizes mixed):")
    for name, ms in profile.items():
        print(f"  {name:10s} " + ", ".join(f"{k}={v:.1f}" for k, v in sorted(ms.items())))
    out = write_json(
        args.out,
        {
            "machine": machine_info(),
            "args": vars(args),
            "algorithm": algo,
            "rows": rows,
            "profile_ms": profile,
        },
    )
    plot(rows, out.replace(".json", ".png"))


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = [r for r in rows if r.get("tau")]
    labels = [f"{r['set']}\nbs{r['batch']}\n{r['setting']}" for r in spec]
    fig, ax = plt.subplots(figsize=(max(6, len(spec) * 0.9), 4))
    ax.bar(range(len(spec)), [r["speedup_vs_eagleserve"] for r in spec], label="speedup")
    ax.plot(range(len(spec)), [r["tau"] for r in spec], "ro-", label="tau (tokens/verify)")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(spec)), labels, fontsize=7)
    ax.set_title("EAGLE on CPU: speedup over eagleserve target-only, and tau")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

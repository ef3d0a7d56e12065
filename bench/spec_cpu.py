"""Speculative decoding on CPU: the default model with its EAGLE head, on held-out prompts.

    python bench/spec_cpu.py [--prompts-per-set 4] [--new-tokens 128] [--batches 1,4] [--quick]

In one run, greedy, `--new-tokens` new tokens (EOS ignored): transformers `generate`; eagleserve
without speculation; EAGLE chains with 3 and 5 steps; an EAGLE tree (top-k 2). For each prompt
set (MT-bench first, then HumanEval and math; see bench/data.py) and batch size: tokens/s,
speedup over each baseline, mean accepted length tau, and losslessness (speculative tokens ==
eagleserve target-only tokens). Prints a table; writes bench/results/spec_cpu.json and .png.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import data  # noqa: E402
from bench.common import machine, machine_info, print_table, write_json  # noqa: E402
from eagleserve import Engine, SamplingParams  # noqa: E402
from eagleserve.model.loader import resolve_draft_path, resolve_model_path  # noqa: E402

SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("eagleserve", {}),
    (
        "EAGLE chain 3",
        dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4),
    ),
    (
        "EAGLE chain 5",
        dict(speculative_num_steps=5, speculative_eagle_topk=1, speculative_num_draft_tokens=6),
    ),
    (
        "EAGLE tree k2",
        dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6),
    ),
]


def chat_ids(tok: Any, prompt: str) -> list[int]:
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return tok.encode(text, add_special_tokens=False)


def run_engine(
    engine: Engine, prompts: list[list[int]], bs: int, new: int
) -> tuple[float, list[list[int]], float | None]:
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    before = engine.stats()
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), bs):
        outs += engine.generate(prompts[i : i + bs], params)
    dt = time.perf_counter() - t0
    after = engine.stats()
    calls = after.spec_verify_calls_total - before.spec_verify_calls_total
    tau = (
        (after.spec_accepted_tokens_total - before.spec_accepted_tokens_total) / calls
        if calls
        else None
    )
    return len(prompts) * new / dt, [o["token_ids"] for o in outs], tau


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--draft", default="builtin:smollm2-135m-eagle")
    ap.add_argument("--prompts-per-set", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--quick", action="store_true", help="2 prompts per set, 48 tokens, batch 1")
    args = ap.parse_args()
    if args.quick:
        args.prompts_per_set, args.new_tokens, args.batches = 2, 48, "1"
    batches = [int(b) for b in args.batches.split(",")]
    path = resolve_model_path("default")
    draft = resolve_draft_path(args.draft)
    engines = {
        name: Engine(
            model=path,
            device="cpu",
            kv_cache_tokens=8192,
            max_running_requests=8,
            disable_overlap_schedule=True,
            **(
                {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": draft, **kw}
                if kw
                else {}
            ),
        )
        for name, kw in SETTINGS
    }
    tok = engines["eagleserve"].tokenizer
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n = args.prompts_per_set
    sets = {"MT-bench": data.mt_bench(n), "HumanEval": data.human_eval(n), "math": data.math(n)}
    rows, table = [], []
    for set_name, prompts in sets.items():
        ids = [chat_ids(tok, p) for p in prompts]
        for bs in batches:
            engines["eagleserve"].generate(ids[:1], SamplingParams(max_new_tokens=4))  # warm-up
            with torch.inference_mode():
                hf_tps = run_hf(hf, ids, bs, args.new_tokens, tok.pad_token_id or 0)
            base_tps, base_tokens, _ = run_engine(engines["eagleserve"], ids, bs, args.new_tokens)
            rows.append(dict(set=set_name, batch=bs, setting="transformers", tok_s=hf_tps))
            for name, _ in SETTINGS:
                if name == "eagleserve":
                    tps, tokens, tau = base_tps, base_tokens, None
                else:
                    tps, tokens, tau = run_engine(engines[name], ids, bs, args.new_tokens)
                same = sum(a == b for a, b in zip(tokens, base_tokens)) / len(tokens)
                rows.append(
                    dict(
                        set=set_name,
                        batch=bs,
                        setting=name,
                        tok_s=tps,
                        tau=tau,
                        speedup_vs_eagleserve=tps / base_tps,
                        speedup_vs_transformers=tps / hf_tps,
                        lossless=same,
                    )
                )
    for r in rows:
        table.append(
            [
                r["set"],
                r["batch"],
                r["setting"],
                f"{r['tok_s']:.1f}",
                f"{r.get('speedup_vs_eagleserve', 0):.2f}x" if "lossless" in r else "-",
                f"{r.get('speedup_vs_transformers', 1):.2f}x" if "lossless" in r else "-",
                f"{r['tau']:.2f}" if r.get("tau") else "-",
                f"{100 * r['lossless']:.0f}%" if "lossless" in r else "-",
            ]
        )
    print_table(
        ["set", "bs", "setting", "tok/s", "vs eagleserve", "vs transformers", "tau", "lossless"],
        table,
        title=f"spec_cpu on {machine()}",
    )
    out = write_json("spec_cpu.json", {"machine": machine_info(), "args": vars(args), "rows": rows})
    plot(rows, out.replace(".json", ".png"))


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = [r for r in rows if r.get("tau")]
    labels = [f"{r['set']}\nbs{r['batch']}\n{r['setting'].replace('EAGLE ', '')}" for r in spec]
    fig, ax = plt.subplots(figsize=(max(6, len(spec) * 0.9), 4))
    ax.bar(range(len(spec)), [r["speedup_vs_eagleserve"] for r in spec], label="speedup")
    ax.plot(range(len(spec)), [r["tau"] for r in spec], "ro-", label="tau (accepted/step)")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(spec)), labels, fontsize=7)
    ax.set_title("EAGLE on CPU: speedup over eagleserve target-only, and tau")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

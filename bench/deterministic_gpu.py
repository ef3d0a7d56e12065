"""--enable-deterministic-inference on one GPU in bf16: greedy answers equal to target-only's, and
the speed with the mode on and off.

Settings (greedy, EOS ignored, held-out MT-bench prompts as chats): target-only, EAGLE chain 3,
tree (3 steps, top-k 2, 6 tokens), adaptive 0..3, chain 3 with the prefix cache on and chain 3
with the overlap scheduler off, with the mode on; target-only and chain 3 with it off (the
baseline: what the issue measured). Batch 1 (the first `batch1_prompts` prompts one at a time)
and batch 16 (all `prompts` in waves of 16). Each setting's answers are compared with the
target-only answers of the same mode, prompt by prompt; tok/s counts generated tokens
over the generate calls' wall time. One engine at a time (closed before the next).

    python bench/deterministic_gpu.py --out bench/results/deterministic_gpu.json
CPU smoke test (Triton interpreter, a tiny model and head; slow, so tiny sizes):
    TRITON_INTERPRET=1 python bench/deterministic_gpu.py --model DIR --draft DIR --device cpu \
        --prompts 2 --batch1-prompts 1 --max-new 4 --out /tmp/det.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from typing import Any

import torch

from eagleserve import Engine, SamplingParams

CHAIN3 = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)
# name: (mode on, speculative settings or None, other engine settings)
SETTINGS: dict[str, tuple[bool, dict[str, Any] | None, dict[str, Any]]] = {
    "target-only det": (True, None, {}),
    "chain 3 det": (True, CHAIN3, {}),
    "target-only off": (False, None, {}),
    "chain 3 off": (False, CHAIN3, {}),
    "tree det": (True, TREE, {}),
    "adaptive 0..3 det": (True, {**CHAIN3, "speculative_adaptive": True}, {}),
    # The chat template's shared system prefix and the batch-16 pass over prompts the batch-1
    # pass already served both hit the radix cache: extends that start mid-sequence.
    "chain 3 det prefix cache": (True, CHAIN3, {"disable_radix_cache": False}),
    "chain 3 det overlap off": (True, CHAIN3, {"disable_overlap_schedule": True}),
}


def held_out_prompts(tokenizer: Any, n: int, vocab: int) -> list[list[int]]:
    """MT-bench first turns as chat token ids; random ids for a model without a tokenizer."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(1, vocab - 1, (5 + i % 7,), generator=g).tolist() for i in range(n)]
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from data import mt_bench

    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=True, add_generation_prompt=True,
            return_dict=False,
        )
        for p in mt_bench(n)
    ]  # fmt: skip


def generate(eng: Engine, prompts: list[list[int]], batch: int, new: int) -> tuple[list, float]:
    """(token ids per prompt, tok/s) generating `prompts` in waves of `batch`."""
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    out: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        out += [o["token_ids"] for o in eng.generate(prompts[i : i + batch], params)]
    secs = time.perf_counter() - t0
    return out, sum(len(t) for t in out) / secs


def run(
    model_path: str = "default",
    out_json: str | None = None,
    prompts: int = 24,
    max_new: int = 64,
    batch1_prompts: int = 24,
    draft: str = "builtin:smollm2-135m-eagle",
    algorithm: str = "EAGLE3",
    device: str = "cuda",
    settings: list[str] | None = None,
) -> dict[str, Any]:
    results: dict[str, Any] = {"device": device, "prompts": prompts, "max_new": max_new,
                               "batch1_prompts": batch1_prompts, "rows": {}}  # fmt: skip
    if device != "cpu" and torch.cuda.is_available():
        results["gpu"] = torch.cuda.get_device_name()
    tokens: dict[str, dict[int, list[list[int]]]] = {}
    ids: list[list[int]] | None = None
    for name in settings or list(SETTINGS):
        det, spec, other = SETTINGS[name]
        kw: dict[str, Any] = {"disable_radix_cache": True, **other}
        if spec:
            kw.update(speculative_algorithm=algorithm, speculative_draft_model_path=draft, **spec)
        t_load = time.perf_counter()
        eng = Engine(
            model=model_path,
            device=device,
            dtype="bfloat16",
            max_total_tokens=8192,
            max_running_requests=16,
            cuda_graph_max_bs=16,
            attention_backend="triton",
            enable_deterministic_inference=det,
            # every setting prefills whole prompts unless it says otherwise
            **kw,
        )
        load_s = time.perf_counter() - t_load
        if ids is None:
            vocab = eng.scheduler.model_config.vocab_size
            ids = held_out_prompts(eng.tokenizer, prompts, vocab)
        generate(eng, ids[:1], 1, 4)  # warm-up (Triton compiles)
        row: dict[str, Any] = {"load_s": load_s}
        tokens[name] = {}
        for bs, ps in ((1, ids[:batch1_prompts]), (16, ids)):
            got, tok_s = generate(eng, ps, bs, max_new)
            tokens[name][bs] = got
            row[f"bs{bs}_tok_s"] = tok_s
        eng.close()
        eng.close()
        del eng
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        results["rows"][name] = row
        ref_name = "target-only det" if det else "target-only off"
        if ref_name in tokens:
            for bs in (1, 16):
                ref, got = tokens[ref_name][bs], tokens[name][bs]
                row[f"bs{bs}_equal"] = f"{sum(a == b for a, b in zip(got, ref))}/{len(ref)}"
        print(name, json.dumps(row), flush=True)
    rows = results["rows"]
    for bs in (1, 16):  # cost of the mode, where both sides ran
        for on, off in (("target-only det", "target-only off"), ("chain 3 det", "chain 3 off")):
            if on in rows and off in rows:
                key = f"{on.split(' det')[0]} bs{bs} det/off"
                results[key] = rows[on][f"bs{bs}_tok_s"] / rows[off][f"bs{bs}_tok_s"]
    if out_json:
        os.makedirs(os.path.dirname(os.path.abspath(out_json)), exist_ok=True)
        with open(out_json, "w") as f:
            json.dump(results, f, indent=1)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--draft", default="builtin:smollm2-135m-eagle")
    ap.add_argument("--algorithm", default="EAGLE3")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--batch1-prompts", type=int, default=24)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument(
        "--settings", default=None, help="comma-separated subset of: " + ", ".join(SETTINGS)
    )
    ap.add_argument("--out", default="bench/results/deterministic_gpu.json")
    a = ap.parse_args()
    res = run(
        a.model, a.out, a.prompts, a.max_new, a.batch1_prompts, a.draft, a.algorithm, a.device,
        a.settings.split(",") if a.settings else None,
    )  # fmt: skip
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()

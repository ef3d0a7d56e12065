"""Host time per decode iteration, split by stage: target-only, adaptive speculation held at
k = 0, adaptive as shipped, EAGLE3 chains of 1 and 3, and an EAGLE3 tree (3 steps, top-4, 8
tokens).

    python bench/host_overhead.py [--model tiny|default|PATH.gguf] [--device cpu|cuda]
        [--batches 1,32] [--new-tokens 32]
        [--settings target-only,adaptive-k0,adaptive,chain1,chain3,tree]
        [--out bench/results/host_overhead.json]

"adaptive, k = 0" is the shipped config's adaptive controller told to draft nothing, so every
decode iteration is the k = 0 path a plain decode must match; "adaptive 0..3" lets it choose
(with the tiny model's random head it mostly stays at 0 and probes). Besides the stage times,
one more pass per setting counts per decode iteration (medians): the tensor ops dispatched
outside the target forward (on a GPU the forward is one graph replay, so these are the
launches the host adds), the target and head forwards, and host reads (`.item()`-like reads
and ops whose output shape depends on values, e.g. boolean-mask indexing: each one a device
sync on a GPU; on a CPU, reads of the scheduler's host mirrors count too). Forwards replayed
inside a captured graph (the GPU's draft loop) are not counted. On a GPU each profiled run
also lists the host's top ops by self time (syncs, copies and compiles show up by name).

Every stage is a method of the running engine wrapped from here (nothing in the engine is
changed); a wrapped call's time excludes the wrapped calls it makes, so the stages add up to
the iteration. Stages:
  schedule      Scheduler.get_next_batch_to_run (admission, retraction checks)
  batch prep    worker.prepare_for_decode, and Scheduler.run_batch's own work (sampling info,
                grammar, the adaptive plan, host lengths) before the forward
  forward       worker.forward_batch_generation and runner.forward: ForwardBatch building, the
                eager kernels or a graph replay, and on EAGLE the verify bookkeeping
  draft         EAGLE: the drafter's k steps and its extend over the accepted tokens
  sampling      sample_next (target-only, EAGLE prefill) and the verify's acceptance walk
  output        Scheduler.process_batch_result (token appends, stop checks, outputs)
  detokenize    the server's incremental detokenizer fed every iteration's new tokens
  other         the rest of Scheduler.step
On a GPU nothing here synchronizes: a stage's time is what the host spent in it, a sync it
makes included (that is the point: a sync is host time the GPU does not overlap). With
`--profile` (default on a GPU) the GPU's idle share of the decode iterations is measured from
the torch profiler: 1 - (union of device kernel/memcpy intervals) / wall, over the profiled
run's wall and over the same run's wall without the profiler (whose host work inflates the
first), with the overlap scheduler off and on, and the device syncs per iteration by site,
overlap off and on (on, its forward thread's included: a sync there empties the GPU's
queue). The stage split runs with overlap off (one thread; with overlap the forward runs on
its own thread and the stages interleave).

`--model tiny` (the default on a CPU) is a random 8-layer Llama (hidden 64, vocab 512) with a
random EAGLE3 head, so the forward is small and the host's share shows; its tokenizer is the
default model's (ids < 512 decode to real text), when the default model is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from bench.common import format_table, machine  # noqa: E402
from bench.host_probes import (  # noqa: E402
    COUNTS,
    STAGES,
    OpCounter,
    StageClock,
    instrument,
    prompts,
    sync_sites,
)
from eagleserve import Engine, SamplingParams  # noqa: E402

SETTING_KEYS = {"target-only": "target-only", "adaptive-k0": "adaptive, k = 0",
                "adaptive": "adaptive 0..3", "chain1": "EAGLE3 chain 1", "chain3": "EAGLE3 chain 3",
                "tree": "EAGLE3 tree 3x4/8"}  # fmt: skip
# What runs unless --settings says otherwise (chain 1 on request: the depth adaptive mostly runs)
DEFAULT_SETTINGS = ("target-only", "adaptive-k0", "adaptive", "chain3", "tree")
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def run_iterations(
    engine: Engine, clock: StageClock, batch: int, new: int, vocab: int, seed: int
) -> list[dict[str, float]]:
    """Steps the scheduler over `batch` prompts to the end; returns the decode iterations'
    stage rows (prefill iterations dropped), each with its wall time under "total"."""
    from eagleserve.messages import GenerateReqInput
    from eagleserve.server.detokenizer import IncrementalDetokenizer

    s = engine.scheduler
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    detok: dict[str, Any] = {}
    for i, ids in enumerate(prompts(batch, vocab, 24, seed)):
        rid = f"host-{seed}-{i}"
        s.add_request(GenerateReqInput(rid, ids, params, stream=True))  # output every step
        if engine.tokenizer is not None:
            detok[rid] = IncrementalDetokenizer(engine.tokenizer)
    rows = []
    clock.take()
    while s.has_work():
        t0 = time.perf_counter()
        outs = s.step()
        t1 = time.perf_counter()
        for out in outs:
            d = detok.get(out.rid)
            if d is not None:
                d.add(out.new_token_ids)
        t2 = time.perf_counter()
        row = clock.take()
        row["detokenize"] = t2 - t1
        row["other"] = (t1 - t0) - sum(row.values()) + row["detokenize"]
        row["total"] = t2 - t0
        if clock.mode == "decode":
            rows.append(row)
    return rows


def summarize(rows: list[dict[str, float]]) -> dict[str, float]:
    """Mean microseconds per iteration by stage (the first two iterations skipped: warm-up)."""
    use = rows[2:] if len(rows) > 4 else rows
    return {k: 1e6 * sum(r.get(k, 0.0) for r in use) / len(use) for k in (*STAGES, "total")}


def gpu_idle(engine: Engine, batch: int, new: int, vocab: int) -> dict[str, float]:
    """The device's idle share of the wall time of a generate call's decode-dominated run: of
    the profiled run's wall, and of the same run's wall unprofiled (the profiler records every
    host op, which slows the host, not the kernels: the device's busy time over the plain
    wall is the idle share the run has without it)."""
    from torch.profiler import ProfilerActivity, profile

    dev = engine.scheduler.device
    mod = torch.get_device_module(dev)
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    ps = prompts(batch, vocab, 24, 7)
    engine.generate(ps, params)  # warm
    mod.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.generate(ps, params)
        mod.synchronize()
        wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate(ps, params)
    mod.synchronize()
    plain_wall = time.perf_counter() - t0
    device_events = [
        e for e in prof.events() if e.device_type.name in ("CUDA", "HIP", "PrivateUse1")
    ]
    spans = sorted((e.time_range.start, e.time_range.end) for e in device_events)
    busy, cur_s, cur_e = 0.0, None, None
    for a, b in spans:
        if cur_e is None or a > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    if cur_e is not None:
        busy += cur_e - cur_s
    kernels = len(spans)
    steps = max(engine.stats().spec_verify_calls_total, 1)
    # Where the host's time went (syncs, copies, launches, compiles show up by name), and the
    # device's: kernels by name (a graph's one by one), launches and µs per step of the batch
    # (the run generates `new` tokens per request).
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    by_kernel: dict[str, list[float]] = {}
    for e in device_events:
        by_kernel.setdefault(e.name[:80], []).append(e.time_range.elapsed_us())
    kernels_top = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:15]
    return {
        "wall_ms": 1e3 * wall,
        "device_busy_ms": busy / 1e3,
        "idle_fraction": max(0.0, 1 - (busy / 1e6) / wall),
        "unprofiled_wall_ms": 1e3 * plain_wall,
        "idle_fraction_unprofiled": max(0.0, 1 - (busy / 1e6) / plain_wall),
        "device_ops": kernels,
        "verify_calls_total": steps,
        "top_host_ops": [[e.key, e.count, round(e.self_cpu_time_total)] for e in top],
        "top_device_ops_per_token_step": [
            [name, round(len(ts) / new, 2), round(sum(ts) / new, 1)] for name, ts in kernels_top
        ],
    }


def tiny_dirs(tmp: str, device: str) -> tuple[str, str]:
    """A random tiny target (dummy weights, the default model's tokenizer when installed)
    and a random EAGLE3 head for it."""
    from eagleserve.spec.head_loader import init_eagle_head, save_eagle_head

    target = os.path.join(tmp, "tiny")
    os.makedirs(target, exist_ok=True)
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(TINY, f)
    try:
        from eagleserve.models.loader import resolve_model_path

        src = resolve_model_path("default")
        for name in os.listdir(src):
            if name.startswith("tokenizer") or name == "special_tokens_map.json":
                shutil.copy(os.path.join(src, name), target)
    except (FileNotFoundError, OSError) as exc:
        print(f"no tokenizer for the tiny model ({exc}): detokenization not measured")
    eng = Engine(model=target, device=device, load_format="dummy", max_total_tokens=1024)
    head = init_eagle_head("EAGLE3", eng.scheduler.worker.runner.model, 256, seed=0)
    head_dir = os.path.join(tmp, "head")
    save_eagle_head(head, head_dir)
    return target, head_dir


def settings(head: str) -> dict[str, dict[str, Any]]:
    eagle = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head)
    # Whole chains (an iteration of each depth as it was before chains were cut short).
    chain = dict(eagle, speculative_num_steps=3, speculative_eagle_topk=1,
                 speculative_num_draft_tokens=4, speculative_min_path_prob=0.0)  # fmt: skip
    return {
        "target-only": {},
        "adaptive, k = 0": dict(chain, speculative_adaptive=True),
        "adaptive 0..3": dict(chain, speculative_adaptive=True),
        "EAGLE3 chain 1": dict(chain, speculative_num_steps=1, speculative_num_draft_tokens=2),
        "EAGLE3 chain 3": chain,
        "EAGLE3 tree 3x4/8": dict(
            eagle, speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8
        ),
    }


def make_engine(name: str, **kw: Any) -> Engine:
    """The setting's engine; "adaptive, k = 0" with its controller held at k = 0."""
    eng = Engine(**kw)
    if name == "adaptive, k = 0":
        controller = eng.scheduler.worker.controller
        controller.choose = lambda alphas, catching_up=False: 0
    return eng


def run(
    model: str = "tiny",
    device: str = "auto",
    batches: tuple[int, ...] = (1, 32),
    new_tokens: int = 32,
    profile_gpu: bool | None = None,
    out: str | None = None,
    which: tuple[str, ...] = DEFAULT_SETTINGS,
) -> dict[str, Any]:
    from eagleserve.device import pick_device

    dev = pick_device(device)
    tmp = tempfile.mkdtemp()
    extra: dict[str, Any] = {}
    if model == "tiny":
        target, head = tiny_dirs(tmp, str(dev))
        extra["load_format"] = "dummy"
        vocab = TINY["vocab_size"]
    else:
        target, head = model, "builtin:smollm2-135m-eagle"
        vocab = 49152
    if profile_gpu is None:
        profile_gpu = dev.type != "cpu"
    res: dict[str, Any] = {
        "machine": machine(),
        "device": str(dev)
        if dev.type == "cpu"
        else torch.get_device_module(dev).get_device_name(dev),
        "model": model,
        "new_tokens": new_tokens,
        "rows": [],
    }
    table = []
    chosen = {SETTING_KEYS[k] for k in which}
    for name, kw in settings(head).items():
        if name not in chosen:
            continue
        common = dict(
            model=target,
            device=str(dev),
            max_total_tokens=max(batches) * (new_tokens + 64) + 1024,
            max_running_requests=max(batches),
            disable_radix_cache=True,
            **extra,
            **kw,
        )
        eng = make_engine(name, **common, disable_overlap_schedule=True)
        clock = StageClock()
        instrument(eng, clock)
        for bs in batches:
            run_iterations(eng, clock, bs, 8, vocab, 0)  # warm-up (graphs, compiles)
            rows = run_iterations(eng, clock, bs, new_tokens, vocab, 1)
            us = summarize(rows)
            row: dict[str, Any] = {"setting": name, "batch": bs, "iterations": len(rows),
                                   "host_us": us}  # fmt: skip
            counter = OpCounter(eng)
            row["per_iteration"] = counter.run(eng, bs, min(new_tokens, 16), vocab)
            counter.close()
            if profile_gpu:
                row["gpu_overlap_off"] = gpu_idle(eng, bs, new_tokens, vocab)
                row["syncs_per_iteration"] = sync_sites(eng, bs, min(new_tokens, 16), vocab)
            res["rows"].append(row)
            table.append([name, bs, len(rows), *(round(us[k]) for k in (*STAGES, "total")),
                          *(row["per_iteration"][k] for k in COUNTS)])  # fmt: skip
            print(table[-1], flush=True)
        clock.restore()
        eng.close()
        del eng
        if profile_gpu:
            eng = make_engine(name, **common)  # the device's default: overlap on
            for row in res["rows"]:
                if row["setting"] == name:
                    row["gpu_overlap_default"] = gpu_idle(eng, row["batch"], new_tokens, vocab)
                    # with the forward thread: a sync there leaves the GPU's queue empty
                    row["syncs_per_iteration_overlap"] = sync_sites(
                        eng, row["batch"], min(new_tokens, 16), vocab
                    )
            eng.close()
            del eng
        if out:
            _save(res, out)
    print(f"{res['device']}; {machine()}; mean us per decode iteration, overlap off")
    print(format_table(["setting", "bs", "iters", *STAGES, "total", *COUNTS], table))
    for row in res["rows"]:
        for key, mode in (("syncs_per_iteration", "off"), ("syncs_per_iteration_overlap", "on")):
            syncs = row.get(key)
            if syncs:
                top = ", ".join(f"{site} x{n}" for site, n in list(syncs.items())[:4])
                print(f"{row['setting']} bs {row['batch']}: {sum(syncs.values()):.1f} device "
                      f"syncs per iteration (overlap {mode}): {top}")  # fmt: skip
        for key in ("gpu_overlap_off", "gpu_overlap_default"):
            if key in row:
                g = row[key]
                print(f"{row['setting']} bs {row['batch']} {key}: GPU idle "
                      f"{100 * g['idle_fraction']:.1f}% of {g['wall_ms']:.1f} ms profiled, "
                      f"{100 * g['idle_fraction_unprofiled']:.1f}% of the same run's "
                      f"{g['unprofiled_wall_ms']:.1f} ms unprofiled")  # fmt: skip
    if out:
        _save(res, out)
    return res


def _save(res: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=2)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny, default, or a .gguf / model folder")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--profile", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--settings", default=",".join(DEFAULT_SETTINGS), help=", ".join(SETTING_KEYS))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "host_overhead.json"))
    args = ap.parse_args(argv)
    prof = {"auto": None, "on": True, "off": False}[args.profile]
    batches = tuple(int(b) for b in args.batches.split(","))
    which = tuple(args.settings.split(","))
    run(args.model, args.device, batches, args.new_tokens, prof, args.out, which)


if __name__ == "__main__":
    main()

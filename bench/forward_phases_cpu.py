"""Where a CPU target forward's time goes, phase by phase: a decode and verifies of 2-4 tokens
after a few context lengths, and the EAGLE3 head's draft step.

The packed target's layers run in one C++ call (kernels/cpu_layers.cpp) that times its phases
when asked (`cpu_ext.phase_times`; no profiler, whose cost per recorded op would inflate a
forward by half): each phase's wall time over `--reps` forwards of each kind (the kinds take
turns in `--rounds` rounds), in ms per forward, beside the layers' call, the lm_head and the
rest of the forward's wall time (Python, the ForwardBatch, the final norm), each timed around
its call. A phase's time includes its threads' waits for each other. The context is a real
prefill of random tokens. The draft step's phases (`eagle3_layer::...`, per head step) come
from a served EAGLE3 chain-3 generation.

    python bench/forward_phases_cpu.py [--contexts 128,1024] [--reps 20] [--threads 2]
        [--out forward_phases_cpu.json]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import data  # noqa: E402
from bench.common import machine, print_table, write_json  # noqa: E402
from bench.forwards import scratch_batch, scratch_request  # noqa: E402
from eagleserve import Engine, SamplingParams  # noqa: E402
from eagleserve.kernels import cpu_ext  # noqa: E402
from eagleserve.models.loader import resolve_draft_path  # noqa: E402

LAYER_PHASES = ("input_norm", "qkv_proj", "rope", "kv_store_attention", "o_proj", "post_norm",
                "gate_up_proj", "silu_mul", "down_proj")  # fmt: skip
HEAD_PHASES = ("norms_qkv_proj", "rope_kv_store_attention", "o_proj", "mlp", "lm_head")


@contextlib.contextmanager
def timed_calls(obj: Any, name: str, into: dict[str, float], key: str) -> Iterator[None]:
    """Adds the wall seconds of every call of obj.name to into[key] while open."""
    original = getattr(obj, name)

    def timed(*args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original(*args, **kw)
        finally:
            into[key] += time.perf_counter() - t0

    setattr(obj, name, timed)
    try:
        yield
    finally:
        setattr(obj, name, original)


def phase_seconds(on: bool, into: dict[str, float]) -> None:
    """Adds the layers' phase timers since the last call to `into`; turns them on or off."""
    for name, (seconds, _) in cpu_ext.phase_times(on).items():
        into[name] += seconds


@torch.inference_mode()
def target_phases(engine: Engine, context: int, reps: int, rounds: int) -> list[dict[str, Any]]:
    """Per n = 1..4 new tokens after `context` tokens: ms per forward of each layer phase (all
    layers), the layers' call, the lm_head and the forward's wall time."""
    runner = engine.scheduler.worker.runner
    vocab = runner.config.vocab_size
    totals: dict[int, dict[str, float]] = {n: defaultdict(float) for n in range(1, 5)}
    per = max(1, reps // rounds)
    with scratch_request(runner, context + 4) as row:
        runner.forward(scratch_batch(runner, row, torch.randint(0, vocab, (context,)), 0))
        for n in totals:  # warm each kind once
            runner.forward(scratch_batch(runner, row, torch.randint(0, vocab, (n,)), context))
        for _ in range(rounds):
            for n, acc in totals.items():
                batches = [scratch_batch(runner, row, torch.randint(0, vocab, (n,)), context)
                           for _ in range(per)]  # fmt: skip
                cpu_ext.phase_times(True)  # on, and nothing from before
                with timed_calls(cpu_ext, "decoder_layers", acc, "layers"), \
                        timed_calls(cpu_ext, "q8_matmul", acc, "lm_head"):  # fmt: skip
                    t0 = time.perf_counter()
                    for fb in batches:
                        runner.forward(fb)
                    acc["wall"] += time.perf_counter() - t0
                phase_seconds(False, acc)
    missing = [p for p in LAYER_PHASES if f"decoder_layers::{p}" not in totals[1]]
    if missing:
        raise SystemExit(f"the layers' call timed no phase {missing}: the CPU kernels "
                         "(kernels/cpu_layers.cpp) and LAYER_PHASES disagree")  # fmt: skip
    rows = []
    for n, acc in totals.items():
        ms = {key: 1e3 * v / (per * rounds) for key, v in acc.items()}
        phases = {p: ms[f"decoder_layers::{p}"] for p in LAYER_PHASES}
        rows.append(dict(context=context, tokens=n, phases_ms=phases, layers_ms=ms["layers"],
                         layers_outside_phases_ms=ms["layers"] - sum(phases.values()),
                         lm_head_ms=ms["lm_head"],
                         rest_ms=ms["wall"] - ms["layers"] - ms["lm_head"],
                         wall_ms=ms["wall"]))  # fmt: skip
    return rows


def head_phases(threads: int, new_tokens: int) -> dict[str, Any]:
    """us per draft step of each phase of the shipped head's layer call, from a served chain-3
    generation (2 MT-bench prompts)."""
    eng = Engine(model="default", device="cpu", max_total_tokens=4096, max_running_requests=2,
                 disable_overlap_schedule=True, speculative_algorithm="EAGLE3",
                 speculative_draft_model_path=resolve_draft_path("builtin:smollm2-135m-eagle"),
                 speculative_num_steps=3, speculative_eagle_topk=1,
                 speculative_num_draft_tokens=4, speculative_min_path_prob=0.0)  # fmt: skip
    ids = [data.chat_ids(eng.tokenizer, p) for p in data.mt_bench(3)]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    eng.generate(ids[:1], params)
    acc: dict[str, float] = defaultdict(float)
    cpu_ext.phase_times(True)
    with timed_calls(cpu_ext, "eagle3_layer", acc, "call"):
        eng.generate(ids[1:], params)
    times = cpu_ext.phase_times(False)
    steps = times["eagle3_layer::lm_head"][1]
    return dict(steps=steps, threads=threads,
                phases_us={p: 1e6 * times[f"eagle3_layer::{p}"][0] / steps for p in HEAD_PHASES},
                call_us=1e6 * acc["call"] / steps)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64, help="of the head's generation")
    ap.add_argument("--out", default="forward_phases_cpu.json", help="file name in bench/results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    engine = Engine(model="default", device="cpu", max_total_tokens=max(contexts) + 64,
                    max_running_requests=1, disable_overlap_schedule=True)  # fmt: skip
    rows = [r for c in contexts for r in target_phases(engine, c, args.reps, args.rounds)]
    del engine
    head = head_phases(args.threads, args.new_tokens)
    print(f"machine: {machine()}; the default model (packed Q4_1, fp16 K/V cache), batch 1; ms "
          f"per forward, {args.reps} forwards of each kind")  # fmt: skip
    decode = {r["context"]: r["wall_ms"] for r in rows if r["tokens"] == 1}
    print_table(
        ["context", "tokens", *LAYER_PHASES, "layers other", "lm_head", "rest", "wall",
         "x decode"],
        [[r["context"], r["tokens"], *(f"{r['phases_ms'][p]:.3f}" for p in LAYER_PHASES),
          f"{r['layers_outside_phases_ms']:.3f}", f"{r['lm_head_ms']:.3f}",
          f"{r['rest_ms']:.3f}", f"{r['wall_ms']:.3f}",
          f"{r['wall_ms'] / decode[r['context']]:.2f}"] for r in rows],
    )  # fmt: skip
    print_table(
        ["head steps", *HEAD_PHASES, "call"],
        [[head["steps"], *(f"{head['phases_us'][p]:.1f}" for p in HEAD_PHASES),
          f"{head['call_us']:.1f}"]],
        title="the shipped head's draft step (eagle3_layer), us per step",
    )  # fmt: skip
    write_json(args.out, {"args": vars(args), "machine": machine(), "target": rows,
                          "head": head})  # fmt: skip


if __name__ == "__main__":
    main()

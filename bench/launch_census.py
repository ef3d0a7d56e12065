"""Kernel launches per decode iteration on the accelerator path, counted on a CPU: where a
speculative iteration's launches go (host, target graphs, draft loop, seed extend) against a
target-only decode's; and the host's time per iteration by stage on that layout, with the
replays' and kernels' own time left out (`time_host`), warm as a GPU's host runs (each graph
replayed once) and with every replay interpreted in between (the caches cold; one request).
`--batch N` times the host with N requests decoding together (warm only).

    python bench/launch_census.py [--dtype bfloat16] [--temperature 0] [--settings NAMES]
                                  [--batch 1] [--out bench/results/launch_census_cpu.json]

The engines run a GPU's layout under the Triton interpreter: the target's layers and the EAGLE3
head's on the fused Triton kernels (the GEMV ones at these sizes), the device graphs replaced by
the CPU stand-in of the tests (tests/spec/graph_standin.py: a replay runs the captured function
again), overlap off so the host's own launches are counted apart. A launch is a Triton kernel
or a torch op that computes (views, allocations, a `to` that returns its input, the
interpreter's own copies and the stand-in replay's copies into its outputs are not); on a GPU
each is one kernel, inside a graph or launched by the host. The target is the tests' random
8-layer Llama (hidden 64) with a random EAGLE3 head: counts per layer and per head step are the
default model's, only the layer count differs (30 there). One request, greedy (or sampled with
a seed at `--temperature`, drawn as an accelerator draws: kernels/triton_sample.py), decode
iterations 3-6 averaged. "adaptive, k = 0" is the shipped config's controller held at k = 0:
the iteration that must cost what a target-only decode costs (the flush of its held head
inputs, once per probe interval of 64 iterations, falls outside iterations 3-6).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "spec")):
    sys.path.insert(0, path)

import pytest  # noqa: E402
import torch  # noqa: E402
from graph_standin import LaunchCensus, StandInGraph, graphs_on_cpu  # noqa: E402  (tests/spec)

from bench.common import format_table, machine  # noqa: E402
from bench.host_probes import STAGES, StageClock, instrument  # noqa: E402

HOST_STAGES = tuple(st for st in STAGES if st != "detokenize")  # no detokenizer here


def name_graphs(census: LaunchCensus, worker: Any) -> None:
    for g in worker.runner.graphs:
        census.names[id(g)] = f"target {g.mode}"
    drafter = getattr(worker, "drafter", None)
    if drafter is None:
        return
    for (k, mode), g in drafter.loop_graphs.items():
        census.names[id(g)] = f"draft loop (k={k}, {mode})"
    if drafter.extend_graphs is not None:
        for (w, mode), g in drafter.extend_graphs.graphs.items():
            census.names[id(g)] = f"seed extend (w={w}, {mode})"
    if drafter.graph is not None:
        census.names[id(drafter.graph)] = "draft step"


def sampling(temperature: float, new: int) -> Any:
    from eagleserve import SamplingParams

    seed = 1 if temperature > 0 else None
    return SamplingParams(max_new_tokens=new, temperature=temperature, seed=seed, ignore_eos=True)


def run_setting(
    name: str, spec: dict[str, Any], target: str, dtype: str, temperature: float, batch: int = 1
) -> dict[str, Any]:
    from eagleserve import Engine
    from eagleserve.messages import GenerateReqInput
    from eagleserve.model_executor import model_runner
    from eagleserve.models import fused_forward

    census = LaunchCensus()
    census.active = False
    mp = pytest.MonkeyPatch()
    mp.setattr(model_runner, "use_fused_kernels", lambda device, backend, *_: backend == "triton")
    mp.setattr(fused_forward, "gemv_max_rows", lambda *args: 64)
    # Sampled rows draw as on a GPU (the draft graphs capture their draw kernel at start-up).
    mp.setattr(model_runner, "draw_kernel", lambda device: "triton")
    try:
        with graphs_on_cpu(mp):
            eng = Engine(model=target, device="cpu", max_total_tokens=max(256, 64 * batch),
                         dtype=dtype, max_running_requests=max(2, batch), context_length=48,
                         attention_backend="triton",
                         disable_overlap_schedule=True, disable_radix_cache=True,
                         **spec)  # fmt: skip
            worker = eng.scheduler.worker
            if getattr(worker, "controller", None) is not None:  # held at k = 0
                worker.controller.choose = lambda *args, **kwargs: 0
            if hasattr(worker, "paths"):
                worker.paths.fixed_shape = True  # as on an accelerator
            name_graphs(census, worker)
            sched = eng.scheduler
            rng = random.Random(0)
            params = sampling(temperature, 16)
            ids = [rng.randrange(3, 90) for _ in range(9)]
            sched.add_request(GenerateReqInput("census", ids, params))
            decodes = counted = 0
            with census.counting():
                while sched.has_work():
                    decode = sched.running_batch is not None and not sched.waiting
                    census.active = decode and 2 <= decodes < 6
                    counted += census.active
                    sched.step()
                    decodes += decode

            def prompts() -> list[list[int]]:
                return [[rng.randrange(3, 90) for _ in range(9)] for _ in range(batch)]

            # Every replay interpreted takes minutes an iteration for a batch: one request only.
            host_cold = time_host(eng, prompts(), temperature) if batch == 1 else None
            with replays_once():
                host_us = time_host(eng, prompts(), temperature)
    finally:
        mp.undo()
    per_iter = {where: {op: n / counted for op, n in c.most_common()}
                for where, c in census.tally.items()}  # fmt: skip
    return {"setting": name, "iterations": counted, "host_batch": batch,
            "launches": {where: sum(ops.values()) for where, ops in per_iter.items()},
            "ops": per_iter, "host_us": host_us,
            "host_us_kernels_interpreted": host_cold}  # fmt: skip


@contextlib.contextmanager
def replays_once() -> Iterator[None]:
    """While open, each stand-in graph runs its function at its first replay only; later
    replays leave its outputs as that one wrote them. A GPU's host does not run a graph's
    kernels, but on a CPU the interpreter does, between the host's ops, and evicts their code
    and data from the caches: every host op after it then costs several times what it costs on
    a warm host. The host's ops see valid outputs of the same shapes, so they do the same
    work (the token values repeat)."""
    real = StandInGraph.replay
    replayed: set[int] = set()

    def replay(self: StandInGraph) -> None:
        if id(self) not in replayed:
            replayed.add(id(self))
            real(self)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(StandInGraph, "replay", replay)
        yield


def time_host(
    eng: Any, prompts: list[list[int]], temperature: float, new: int = 24, skip: int = 4
) -> dict[str, float]:
    """Host microseconds per decode iteration of `prompts` decoded together, by stage
    (bench/host_probes.py), the census's
    mode off: a stand-in replay's and a Triton launch's time go to "device" and out of the
    host's (on a GPU a replay is one call, a launch a few microseconds of the host's), so the
    stages are the Python and torch dispatch a GPU's host runs. Decode iterations after the
    first `skip` averaged. Under `replays_once` the host runs warm, as a GPU's does."""
    import triton.runtime.interpreter as interp

    from eagleserve.messages import GenerateReqInput

    clock = StageClock()
    instrument(eng, clock)
    clock.wrap(StandInGraph, "replay", "device")
    clock.wrap(interp.GridExecutor, "__call__", "device")
    sched = eng.scheduler
    for i, ids in enumerate(prompts):
        params = sampling(temperature, new)  # streamed: the server's output every iteration
        sched.add_request(GenerateReqInput(f"timed-{i}", ids, params, stream=True))
    rows = []
    try:
        while sched.has_work():
            clock.take()
            t0 = time.perf_counter()
            sched.step()
            row = clock.take()
            row["other"] = time.perf_counter() - t0 - sum(row.values())
            if clock.mode == "decode":
                rows.append(row)
    finally:
        clock.restore()
    rows = rows[skip:]
    us = {st: 1e6 * sum(r.get(st, 0.0) for r in rows) / len(rows) for st in HOST_STAGES}
    return {**us, "host total": sum(us.values()), "iterations": len(rows)}


def main(argv: list[str] | None = None) -> None:
    from conftest import SPEC_VOCAB, save_spec_target

    from eagleserve.config import ModelConfig
    from eagleserve.model_executor.model_runner import ModelRunner
    from eagleserve.spec.head_loader import init_eagle_head, save_eagle_head

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--settings", default="target-only,adaptive,chain3,tree")
    ap.add_argument("--batch", type=int, default=1, help="requests decoded together in the host "
                    "timing (the launch count is of one request)")  # fmt: skip
    ap.add_argument("--out", default=os.path.join(HERE, "results", "launch_census_cpu.json"))
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp()
    target = save_spec_target(os.path.join(tmp, "target"), 1234, SPEC_VOCAB - 1, 0)
    runner = ModelRunner(ModelConfig.from_dir(target), target, torch.device("cpu"),
                         torch.float32, 64, 1, 512)  # fmt: skip
    head = os.path.join(tmp, "head")
    save_eagle_head(init_eagle_head("EAGLE3", runner.model, draft_vocab_size=48, seed=1), head)
    chain3 = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                  speculative_num_steps=3, speculative_eagle_topk=1,
                  speculative_num_draft_tokens=4)  # fmt: skip
    adaptive = dict(chain3, speculative_adaptive=True)
    tree = dict(chain3, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    settings = {
        "target-only": ("target-only", {}),
        "adaptive": ("adaptive, k = 0", adaptive),
        "chain3": ("EAGLE3 chain 3", chain3),
        "tree": ("EAGLE3 tree 3x4/8", tree),
    }
    rows = [run_setting(*settings[key], target, args.dtype, args.temperature, args.batch)
            for key in args.settings.split(",")]  # fmt: skip
    table = [[r["setting"], where, round(n, 1)] for r in rows for where, n in r["launches"].items()]
    table += [[r["setting"], "total", round(sum(r["launches"].values()), 1)] for r in rows]
    how = f"sampled at temperature {args.temperature}" if args.temperature else "greedy"
    print(f"launches per decode iteration, {args.dtype}, {how}, 8-layer target (CPU stand-ins)")
    print(format_table(["setting", "where", "launches"], table))
    print(
        f"host us per decode iteration of {args.batch} request(s) outside replays and Triton "
        f"launches ({machine()}); "
        "warm: each graph replayed once; the last column with every replay interpreted (one "
        "request only)"
    )
    cols = (*HOST_STAGES, "host total")
    cold = [r["host_us_kernels_interpreted"] for r in rows]
    host_rows = [[r["setting"], *(round(r["host_us"][k]) for k in cols),
                  "-" if c is None else round(c["host total"])]
                 for r, c in zip(rows, cold, strict=True)]  # fmt: skip
    print(format_table(["setting", *cols, "interpreted"], host_rows))
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    res = {"machine": machine(), "commit": commit, "dtype": args.dtype, "batch": args.batch,
           "temperature": args.temperature,
           "target": "random 8-layer Llama, hidden 64 (tests' spec target), EAGLE3 head",
           "rows": rows}  # fmt: skip
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()

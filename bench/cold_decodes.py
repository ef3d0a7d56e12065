"""How long a CPU decode iteration takes by its place after a prefill, or after idle time: the
warm-up that the adaptive controller leaves unmeasured (spec/adaptive.py, WARM_DECODES).

    python bench/cold_decodes.py [--requests 8] [--new-tokens 24] [--out cold_decodes.json]

The default model, target-only, one request at a time, greedy. Cases: a 4-token prompt right
after the last request (barely a prefill), the same after 0.3 s idle, and 64- and 512-token
prompts right after the last request. For each, the median time of decode iteration i (its
`forward_batch_generation`) over the requests, i counted from the first decode after the
prefill, and its ratio to the last ones. Beside them, the same warm-up in plain memory
streaming: a numpy sum over the packed weights' size (66 MB) after 0.3 s idle, pass by pass,
which shows it is the memory system's warm-up, not the engine's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from statistics import median
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine, print_table, write_json  # noqa: E402
from eagleserve import Engine, SamplingParams  # noqa: E402

CASES = (("4-token prompt", 4, 0.0), ("4-token prompt after 0.3 s idle", 4, 0.3),
         ("64-token prompt", 64, 0.0), ("512-token prompt", 512, 0.0))  # fmt: skip
SHOWN = (0, 1, 2, 3, 5, 8, 12, 16)


def decode_times(eng: Engine, prompt_len: int, idle: float, requests: int, new: int) -> list:
    """Median seconds of each decode iteration's forward, by its index after the prefill."""
    worker = eng.scheduler.worker
    forward = worker.forward_batch_generation
    times: list[tuple[str, float]] = []

    def timed(batch: Any, *args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = forward(batch, *args, **kw)
        times.append((batch.mode, time.perf_counter() - t0))
        return out

    worker.forward_batch_generation = timed
    by_index: list[list[float]] = [[] for _ in range(new - 1)]
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    try:
        for r in range(requests):
            gen = torch.Generator().manual_seed(1000 * prompt_len + r)
            ids = torch.randint(100, 40000, (prompt_len,), generator=gen).tolist()
            time.sleep(idle)
            times.clear()
            eng.generate([ids], params)
            decodes = [t for mode, t in times if mode == "decode"]
            for i, t in enumerate(decodes[: new - 1]):
                by_index[i].append(t)
    finally:
        worker.forward_batch_generation = forward
    return [median(ts) for ts in by_index]


def streaming_passes(nbytes: int, passes: int, idle: float) -> list[float]:
    """Seconds of each summing pass over nbytes after `idle` seconds asleep."""
    a = np.ones(nbytes // 8, dtype=np.float64)
    a.sum()
    time.sleep(idle)
    out = []
    for _ in range(passes):
        t0 = time.perf_counter()
        a.sum()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--out", default="cold_decodes.json")
    args = ap.parse_args()
    eng = Engine(model="default", device="cpu", disable_radix_cache=True,
                 disable_overlap_schedule=True, chunked_prefill_size=0)  # fmt: skip
    eng.generate(["Hello"], SamplingParams(max_new_tokens=8, temperature=0.0))
    shown = [i for i in SHOWN if i < args.new_tokens - 1]
    rows, table = [], []
    for name, prompt_len, idle in CASES:
        ms = [t * 1e3 for t in decode_times(eng, prompt_len, idle, args.requests, args.new_tokens)]
        steady = median(ms[-4:])
        rows.append({"case": name, "prompt_tokens": prompt_len, "idle_s": idle, "decode_ms": ms})
        table.append([name] + [f"{ms[i]:.2f} ({ms[i] / steady:.2f})" for i in shown])
    mem = [t * 1e3 for t in streaming_passes(66 << 20, 10, 0.3)]
    print(f"{machine()}; ms per decode iteration by its index after the prefill (x the last ones)")
    print_table(["case"] + [f"decode {i}" for i in shown], table)
    print("66 MB summing passes after 0.3 s idle, ms:", " ".join(f"{t:.2f}" for t in mem))
    path = write_json(args.out, {"machine": machine(), "rows": rows, "streaming_ms": mem})
    print("wrote", path)


if __name__ == "__main__":
    main()

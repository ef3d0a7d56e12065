"""How long a CPU decode iteration takes by its place after a prefill, or after idle time: the
warm-up that the adaptive controller leaves unmeasured (spec/adaptive.py, WARM_DECODES).

    python bench/cold_decodes.py [--requests 8] [--new-tokens 24] [--gaps-ms 0,0.5,1.5,3]
        [--out cold_decodes.json]

The default model, target-only, one request at a time, greedy. Cases: a 4-token prompt right
after the last request (barely a prefill), the same after 0.3 s idle, and 64- and 512-token
prompts right after the last request. For each, the median time of decode iteration i (its
`forward_batch_generation`) over the requests, i counted from the first decode after the
prefill, and its ratio to the last ones. Beside them, the same warm-up in plain memory
streaming (one read per cache line over the packed weights' size, 66 MB, after 0.3 s idle,
pass by pass): the memory system's warm-up, not the engine's. And the same in small: the
median decode forward with a gap of other work (a busy wait of `--gaps-ms` ms, the host's own
time between two forwards) before each one, as a speculative iteration's head steps and
bookkeeping put between two target forwards.
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


def forward_after_gaps(eng: Engine, gaps_ms: list[float], requests: int, new: int) -> list:
    """Median seconds of a decode forward with a busy wait of each gap before it."""
    runner = eng.scheduler.worker.runner
    forward = runner.forward
    gap, times = [0.0], []

    def gapped(fb: Any, *args: Any, **kw: Any) -> Any:
        if fb.mode != "decode":
            return forward(fb, *args, **kw)
        t = time.perf_counter()
        while time.perf_counter() - t < gap[0]:
            pass
        t0 = time.perf_counter()
        out = forward(fb, *args, **kw)
        times.append(time.perf_counter() - t0)
        return out

    runner.forward = gapped
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    medians = {g: [] for g in gaps_ms}
    try:
        for r in range(requests):
            gen = torch.Generator().manual_seed(r)
            ids = torch.randint(100, 40000, (16,), generator=gen).tolist()
            for g in gaps_ms if r % 2 == 0 else gaps_ms[::-1]:  # the gaps take turns
                gap[0] = g / 1e3
                times.clear()
                eng.generate([ids], params)
                medians[g].append(median(times[12:]))  # past the warm-up after the prefill
    finally:
        runner.forward = forward
    return [median(medians[g]) for g in gaps_ms]


def streaming_passes(nbytes: int, passes: int, idle: float, trials: int = 5) -> list[float]:
    """Median seconds of each pass over nbytes after `idle` seconds asleep, one float64 read per
    64-byte line (a memory stream, little arithmetic), run before any engine exists: no other
    thread of this process is awake."""
    a = np.ones(nbytes // 8, dtype=np.float64)
    lines = a[::8]
    lines.sum()
    by_pass: list[list[float]] = [[] for _ in range(passes)]
    for _ in range(trials):
        time.sleep(idle)
        for i in range(passes):
            t0 = time.perf_counter()
            lines.sum()
            by_pass[i].append(time.perf_counter() - t0)
    return [median(ts) for ts in by_pass]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--gaps-ms", default="0,0.5,1.5,3")
    ap.add_argument("--out", default="cold_decodes.json")
    args = ap.parse_args()
    mem = [t * 1e3 for t in streaming_passes(66 << 20, 10, 0.3)]
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
    gaps = [float(g) for g in args.gaps_ms.split(",")]
    gapped = [t * 1e3 for t in forward_after_gaps(eng, gaps, args.requests, 48)]
    print(f"{machine()}; ms per decode iteration by its index after the prefill (x the last ones)")
    print_table(["case"] + [f"decode {i}" for i in shown], table)
    print(
        "66 MB streaming passes after 0.3 s idle (medians of 5), ms:",
        " ".join(f"{t:.2f}" for t in mem),
    )
    print(
        "decode forward after a busy gap:",
        ", ".join(f"{g} ms gap {t:.2f} ms ({t / gapped[0]:.2f})" for g, t in zip(gaps, gapped)),
    )
    path = write_json(args.out, {"machine": machine(), "rows": rows, "streaming_ms": mem,
                                 "gaps_ms": gaps, "forward_after_gap_ms": gapped})  # fmt: skip
    print("wrote", path)


if __name__ == "__main__":
    main()

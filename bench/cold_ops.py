"""What the host's work between two forwards costs on a CPU once a forward has streamed the
weights through its caches: each torch op of a speculative iteration's bookkeeping, timed warm
(back to back) and cold (right after reading a buffer as large as the packed target's
weights), and the one-call kernels that replace a chain's greedy walk and its draft's top-1.

    python bench/cold_ops.py [--stream-mb 96] [--reps 200] [--out cold_ops.json]

A decode's forward reads every weight once, more bytes than the last-level cache holds, and the
interpreter's and the dispatcher's code and data are gone from the caches after it: a small op
then costs several times its warm time, and a speculative iteration runs a few dozen of them
between its verify and its next forward. Rows (medians of `--reps`, microseconds):
- one tiny op (`x + 1` on 10 elements), and nothing (the timer alone);
- a greedy chain's acceptance over 2 verify rows of the default vocabulary: the torch path
  (`greedy_ids`, then `verify_greedy_chain`'s dozen ops) against `cpu_ext.greedy_chain_walk`;
- a chain draft's seed from a head's 8,192 logits: softmax, max and the id map's gather
  (`top_candidates` and `to_target_ids`) against `cpu_ext.top1_rows`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from statistics import median

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine, print_table, write_json  # noqa: E402
from eagleserve.kernels import cpu_ext  # noqa: E402
from eagleserve.sampling.sampler import greedy_ids  # noqa: E402
from eagleserve.spec.accept import verify_greedy_chain  # noqa: E402
from eagleserve.spec.draft_extend import top_candidates  # noqa: E402


def timed(fn: Callable[[], object], reps: int, before: Callable[[], object] | None) -> float:
    """Median microseconds of `fn`, each run after `before` (untimed) where given."""
    for _ in range(10):
        fn()
    ts = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e6 * median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--stream-mb", type=int, default=96, help="bytes read before a cold run")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default="cold_ops.json")
    args = ap.parse_args()
    if not cpu_ext.load():
        raise SystemExit("the CPU kernels do not load here")
    gen = torch.Generator().manual_seed(0)
    big = torch.randint(0, 100, (args.stream_mb << 18,), dtype=torch.int32, generator=gen)
    x = torch.arange(10)
    verify_logits = torch.randn(2, 49152, generator=gen)
    tokens = torch.randint(0, 49152, (1, 2), generator=gen)
    head_logits = torch.randn(1, 8192, generator=gen)
    id_map = torch.randperm(49152, generator=gen)[:8192]

    def torch_walk() -> object:
        return verify_greedy_chain(tokens, greedy_ids(verify_logits).view(1, 2))

    def torch_top1() -> object:
        p, ids = top_candidates(head_logits, 1)
        return p, id_map[ids]

    cases = {
        "nothing (the timer)": lambda: None,
        "one tiny op (x + 1)": lambda: x + 1,
        "greedy chain walk, torch ops": torch_walk,
        "greedy chain walk, greedy_chain_walk": lambda: cpu_ext.greedy_chain_walk(
            tokens, verify_logits
        ),
        "chain draft's top-1, torch ops": torch_top1,
        "chain draft's top-1, top1_rows": lambda: cpu_ext.top1_rows(head_logits, id_map),
    }
    rows, table = [], []
    for name, fn in cases.items():
        warm = timed(fn, args.reps, None)
        cold = timed(fn, args.reps, big.max)
        rows.append({"case": name, "warm_us": warm, "cold_us": cold})
        table.append([name, f"{warm:.1f}", f"{cold:.1f}", f"{cold / max(warm, 1e-9):.1f}"])
    print(f"{machine()}; median us, cold: after reading {args.stream_mb} MB")
    print_table(["case", "warm", "cold", "x"], table)
    path = write_json(args.out, {"machine": machine(), "stream_mb": args.stream_mb,
                                 "reps": args.reps, "rows": rows})  # fmt: skip
    print(path)


if __name__ == "__main__":
    main()

"""What each extra row costs the packed-int4 GEMV: the decode (1 row) against verifies (2-4)
and prefill-sized passes, on each ISA the CPU has (AVX2, and AVX-512 VNNI where it has that).

    python bench/gemv_rows_cpu.py [--threads 2] [--repeats 15] [--rows 1,2,3,4,8,16]
        [--isas avx2,avx512_vnni] [--out gemv_rows_cpu.json]

The default model's 30 decoder layers as `make serve` packs them (q/k/v, o, gate/up, down: the
Q4 tiles the one-call layers run), through `q4_matmul` with `--rows` M rows of fresh random
activations:

- cold: the 30 layers one after the other, as a forward runs them: every weight comes from
  memory (the weights outsize the caches), so this is what a decode or a verify pays;
- hot: the first layer's four matmuls 30 times: the same arithmetic on cache-resident weights,
  so what is left is the kernel's own compute.

If the cold M = 1 time were the memory stream alone, the extra rows' integer dots could hide
under it; the hot column says how much compute each row brings. (Where the last-level cache
holds all the weights, as on some Xeons' 480 MB L3, "cold" reads them from it, not from memory.)
Fastest of `--repeats` runs, interleaved over M and the ISAs. "x 1 row" is against the same
ISA's single row, "x VNNI" the cold time against AVX-512 VNNI's for as many rows. Prints a table and
writes bench/results/gemv_rows_cpu.json (`--out`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine, machine_info, print_table, write_json  # noqa: E402
from eagleserve import Engine  # noqa: E402
from eagleserve.kernels import cpu_ext  # noqa: E402

# cpu_layers.cpp's 14 tensors per layer: the (w, d, m) tiles of each matmul, in order.
TILES = ((1, 2, 3), (4, 5, 6), (8, 9, 10), (11, 12, 13))

Matmul = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]  # w, d, m, n out, k in


def packed_matmuls() -> list[Matmul]:
    eng = Engine(model="default", device="cpu", max_total_tokens=256, max_running_requests=1)
    layers = eng.scheduler.worker.runner.model.cpu_layers
    assert layers is not None, "the default model did not load packed (no AVX2/F16C CPU?)"
    out: list[Matmul] = []
    for i in range(len(layers.weights) // 14):
        w, n = layers.weights[i * 14 : (i + 1) * 14], layers.out_features[i * 4 : (i + 1) * 4]
        # d tiles are [tiles, blocks, 16]: one fp16 scale per 32 inputs (cpu_ext._scale_tiles)
        out += [(w[a], w[b], w[c], n[j], 32 * w[b].shape[1]) for j, (a, b, c) in enumerate(TILES)]
    return out


def sweep(mats: list[Matmul], rows: int) -> float:
    xs = {k: torch.randn(rows, k) for k in {m[4] for m in mats}}
    t0 = time.perf_counter()
    for w, d, m, n, k in mats:
        cpu_ext.q4_matmul(xs[k], w, d, m, n)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rows", default="1,2,3,4,8,16")
    ap.add_argument("--isas", default=None, help="default: every one this CPU has")
    ap.add_argument("--out", default="gemv_rows_cpu.json", help="file name in bench/results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mats = packed_matmuls()
    isas = args.isas.split(",") if args.isas else sorted({"avx2", cpu_ext.gemv_isa("auto")})
    counts = [int(m) for m in args.rows.split(",")]
    layers = len(mats) // 4
    hot_mats = mats[:4] * layers
    nbytes = sum(t.numel() * t.element_size() for mat in mats for t in mat[:3])
    keys = [(isa, kind, m) for isa in isas for kind in ("cold", "hot") for m in counts]
    best = dict.fromkeys(keys, float("inf"))
    try:
        for _ in range(args.repeats):
            for isa, kind, m in keys:
                cpu_ext.gemv_isa(isa)
                best[isa, kind, m] = min(
                    best[isa, kind, m], sweep(mats if kind == "cold" else hot_mats, m)
                )
    finally:
        cpu_ext.gemv_isa("auto")
    base = "avx512_vnni" if "avx512_vnni" in isas else None
    rows, table = [], []
    for isa in isas:
        for m in counts:
            cold, hot = best[isa, "cold", m], best[isa, "hot", m]
            row = {
                "isa": isa,
                "rows": m,
                "cold_ms": 1e3 * cold,
                "cold_x_decode": cold / best[isa, "cold", counts[0]],
                "cold_gb_s": nbytes / cold / 1e9,
                "hot_ms": 1e3 * hot,
                "hot_x_decode": hot / best[isa, "hot", counts[0]],
                "cold_x_vnni": cold / best[base, "cold", m] if base else None,
            }
            rows.append(row)
            table.append([isa, m, row["cold_ms"], row["cold_x_decode"], row["cold_gb_s"],
                          row["hot_ms"], row["hot_x_decode"],
                          "-" if base is None else row["cold_x_vnni"]])  # fmt: skip
    title = (
        f"{machine()}, {args.threads} threads; {layers} layers' q4 matmuls, "
        f"{nbytes / 1e6:.1f} MB packed, fastest of {args.repeats}"
    )
    print_table(
        ["isa", "rows", "cold ms", f"x {counts[0]} row", "GB/s", "hot ms", f"x {counts[0]} row",
         "x VNNI"], table, title,
    )  # fmt: skip
    path = write_json(
        args.out,
        {"machine": machine_info(), "threads": args.threads, "packed_mb": nbytes / 1e6,
         "repeats": args.repeats, "rows": rows},
    )  # fmt: skip
    print(path)


if __name__ == "__main__":
    main()

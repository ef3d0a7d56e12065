"""What each extra row costs the packed-int4 GEMV: the decode (1 row) against verifies (2-4)
and prefill-sized passes, on each ISA the CPU has (AVX2; AVX-512 VNNI and AMX-INT8, whose tile
multiplies take each 16 rows of a call, where it has those).

    python bench/gemv_rows_cpu.py [--threads 2] [--repeats 15] [--rows 1,2,3,4,8,16]
        [--isas avx2,avx512_vnni,amx] [--out gemv_rows_cpu.json]

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
ISA's single row, "x VNNI" the cold time against AVX-512 VNNI's for as many rows.

`--prefills 150,600,1500 --decode-batch 16` add what a user sees: the default model served
through the engine (one thread team, the prefix cache off) prefilling a prompt of each length
(one token generated; chunks of 64 rows, the CPU default) and `--decode-batch` requests of 40
tokens decoding 64 greedy tokens together, each ISA in turns for `--rounds` rounds; best and
median ms, and whether every ISA gave the same tokens. Prints the tables and writes
bench/results/gemv_rows_cpu.json (`--out`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine, machine_info, median, print_table, write_json  # noqa: E402
from eagleserve import Engine, SamplingParams  # noqa: E402
from eagleserve.kernels import cpu_ext  # noqa: E402

# cpu_layers.cpp's 14 tensors per layer: the (w, d, m) tiles of each matmul, in order.
TILES = ((1, 2, 3), (4, 5, 6), (8, 9, 10), (11, 12, 13))

Matmul = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]  # w, d, m, n out, k in


def packed_matmuls(eng: Engine) -> list[Matmul]:
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


def served(
    eng: Engine, isas: list[str], prefills: list[int], batch: int, rounds: int
) -> list[dict]:
    """Wall seconds of each prefill length and of the batch's decode, per ISA, in turns."""
    gen = torch.Generator().manual_seed(0)
    jobs = [(f"prefill {n}", [torch.randint(100, 40000, (n,), generator=gen).tolist()], 1)
            for n in prefills]  # fmt: skip
    if batch:
        prompts = [torch.randint(100, 40000, (40,), generator=gen).tolist() for _ in range(batch)]
        jobs.append((f"decode, batch {batch}, 64 tokens", prompts, 64))
    out = []
    try:
        for name, prompts, new_tokens in jobs:
            params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            eng.generate(prompts, params)  # warm
            walls: dict[str, list[float]] = {isa: [] for isa in isas}
            tokens = set()
            for r in range(rounds):
                for isa in isas if r % 2 == 0 else isas[::-1]:
                    cpu_ext.gemv_isa(isa)
                    t0 = time.perf_counter()
                    got = eng.generate(prompts, params)
                    walls[isa].append(time.perf_counter() - t0)
                    tokens.add(tuple(tuple(o["token_ids"]) for o in got))
            for isa in isas:
                out.append({"job": name, "isa": isa, "wall_s": sorted(walls[isa]),
                            "same_tokens_every_isa": len(tokens) == 1})  # fmt: skip
    finally:
        cpu_ext.gemv_isa("auto")
    return out


def vnni_of(serve: list[dict], row: dict) -> dict | None:
    return next((r for r in serve if r["job"] == row["job"] and r["isa"] == "avx512_vnni"), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rows", default="1,2,3,4,8,16")
    ap.add_argument("--isas", default=None, help="default: every one this CPU has")
    ap.add_argument("--prefills", default="", help="prompt lengths served, e.g. 150,600,1500")
    ap.add_argument("--decode-batch", type=int, default=0, help="requests decoding together")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of the served jobs")
    ap.add_argument("--out", default="gemv_rows_cpu.json", help="file name in bench/results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    eng = Engine(model="default", device="cpu", max_total_tokens=8192,
                 max_running_requests=max(1, args.decode_batch), disable_radix_cache=True,
                 disable_overlap_schedule=True)  # fmt: skip
    mats = packed_matmuls(eng)
    every = ["avx2", "avx512_vnni", "amx"]  # each ISA includes the ones before it
    isas = args.isas.split(",") if args.isas else every[: every.index(cpu_ext.gemv_isa("auto")) + 1]
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
    prefills = [int(n) for n in args.prefills.split(",") if n]
    serve = served(eng, isas, prefills, args.decode_batch, args.rounds)
    if serve:
        print_table(
            ["served", "isa", "best ms", "median ms", "x VNNI (median)", "same tokens"],
            [[r["job"], r["isa"], 1e3 * r["wall_s"][0], 1e3 * median(r["wall_s"]),
              median(r["wall_s"]) / median(v["wall_s"]) if (v := vnni_of(serve, r)) else "-",
              r["same_tokens_every_isa"]] for r in serve],
            f"{machine()}, {args.threads} threads; the default model served, {args.rounds} rounds",
        )  # fmt: skip
    path = write_json(
        args.out,
        {"machine": machine_info(), "threads": args.threads, "packed_mb": nbytes / 1e6,
         "repeats": args.repeats, "rows": rows, "served": serve},
    )  # fmt: skip
    print(path)


if __name__ == "__main__":
    main()

"""The CPU paged attention kernel alone (kernels/cpu_attention.cpp): how much of a long
context's attention is arithmetic and how much waits on memory.

One request's rows (a decode, a verify) attend over `keys` keys in each of `--layers` layers'
own K/V pools (the default model's shape: 9 query heads over 3 K/V heads of 64; fp16 or fp32),
the layers one after another as a forward runs them, so a pool is out of the caches when its
layer comes again. The keys' slots come in three orders: in slot order (a request's K/V as the
allocator hands it out), shuffled (a fragmented pool), and all in the same 32 rows ("cached":
the same arithmetic with every row in L1, the kernel's own cost). Beside them, a plain sum over
the same bytes on one thread: what one core streams from where the pools live.

Each shape runs once per instruction set of `--isa` (default: AVX2 and, where the CPU has it,
AVX-512, which the kernel takes for units of 5 or more rows on one slot list: a prefill chunk's,
a long chain verify's; fewer rows run AVX2 either way). `--prefills` then times the default
model's whole prefill of that many tokens (target-only, packed, through the engine) with each
set in turns, and its attention phase (`cpu_ext.phase_times`). Both sets give the same bits.

    python bench/attention_cpu.py [--keys 1024,4000] [--rows 1,4,8] [--dtype float16]
        [--isa avx2,avx512] [--prefills 600,1500] [--layers 30] [--reps 20] [--threads 2]
        [--out attention_cpu.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    machine,
    machine_info,
    median,
    print_table,
    time_runs,
    write_json,
)
from eagleserve import Engine, SamplingParams  # noqa: E402
from eagleserve.kernels import cpu_ext  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M's attention
ORDERS = ("slot order", "shuffled", "cached")


def slot_rows(order: str, keys: int, slots: int) -> torch.Tensor:
    """The request's req_to_token row: which pool slot holds each of its keys."""
    if order == "slot order":
        return torch.arange(keys)
    if order == "shuffled":
        return torch.randperm(slots)[:keys]
    return torch.arange(keys) % 32


def time_layers(fn: Any, layers: int, reps: int) -> float:
    """Best of `reps` passes over every layer (after one untimed), in microseconds a layer."""

    def one_pass() -> None:
        for i in range(layers):
            fn(i)

    one_pass()
    times, _ = time_runs(one_pass, reps)
    return min(times) / layers * 1e6


def measure(
    keys: int, rows: int, dtype: torch.dtype, layers: int, reps: int, isa: str
) -> dict[str, Any]:
    cpu_ext.attention_isa(isa)
    slots = keys + 64
    k_pools = [torch.randn(slots, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(layers)]
    v_pools = [torch.randn(slots, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(layers)]
    q = torch.randn(rows, HEADS, HEAD_DIM)
    # req_pool_indices, prefix_lens, extend_lens, kv_lens of the one request
    lens = tuple(torch.tensor([x]) for x in (0, keys - rows, rows, keys))
    out: dict[str, Any] = {
        "keys": keys, "rows": rows, "isa": isa, "dtype": str(dtype).removeprefix("torch."),
    }  # fmt: skip
    for order in ORDERS:
        r2t = slot_rows(order, keys, slots).view(1, -1)

        def attend(i: int, r2t: torch.Tensor = r2t) -> None:
            cpu_ext.paged_attention(q, k_pools[i], v_pools[i], r2t, *lens, None, HEAD_DIM**-0.5)

        out[order] = time_layers(attend, layers, reps)
    kv_bytes = 2 * keys * KV_HEADS * HEAD_DIM * k_pools[0].element_size()
    out["kv_mb_per_layer"] = kv_bytes / 1e6
    out["gb_per_s"] = {o: kv_bytes / (out[o] * 1e-6) / 1e9 for o in ORDERS[:2]}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    pools = [torch.cat([k[:keys].flatten(), v[:keys].flatten()]) for k, v in zip(k_pools, v_pools)]
    sum_us = time_layers(lambda i: pools[i].sum(), layers, reps)
    torch.set_num_threads(threads)
    out["sum_1_thread_us"] = sum_us
    out["sum_1_thread_gb_per_s"] = kv_bytes / (sum_us * 1e-6) / 1e9
    return out


def row_cells(r: dict[str, Any]) -> list[Any]:
    times = [round(r[o], 1) for o in ORDERS]
    return [r["keys"], r["rows"], r["isa"], *times, round(r["gb_per_s"]["slot order"], 1),
            round(r["sum_1_thread_gb_per_s"], 1)]  # fmt: skip


def prefills(lengths: list[int], isas: list[str], rounds: int) -> list[dict[str, Any]]:
    """Each prompt length's prefill (one generated token) with each ISA in turns, `rounds`
    times: wall seconds and the attention phase's, best and median; the first token compared."""
    engine = Engine(model="default", device="cpu", max_total_tokens=8192,
                    max_running_requests=1, disable_overlap_schedule=True,
                    disable_radix_cache=True)  # fmt: skip
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    out = []
    for n in lengths:
        ids = torch.randint(100, 40000, (n,), generator=gen).tolist()
        engine.generate([ids], params)  # warm
        runs: dict[str, list[tuple[float, float]]] = {isa: [] for isa in isas}
        first = set()
        for r in range(rounds):
            for isa in isas if r % 2 == 0 else isas[::-1]:
                cpu_ext.attention_isa(isa)
                cpu_ext.phase_times(True)
                t0 = time.perf_counter()
                first.add(engine.generate([ids], params)[0]["token_ids"][0])
                wall = time.perf_counter() - t0
                attention = cpu_ext.phase_times(False)["decoder_layers::kv_store_attention"][0]
                runs[isa].append((wall, attention))
        for isa, rs in runs.items():
            walls, atts = sorted(w for w, _ in rs), sorted(a for _, a in rs)
            out.append({"tokens": n, "isa": isa, "wall_s": walls, "attention_s": atts,
                        "same_first_token": len(first) == 1})  # fmt: skip
    cpu_ext.attention_isa("auto")
    return out


def best_median_ms(seconds: list[float]) -> str:
    return f"{min(seconds) * 1e3:.1f} / {median(seconds) * 1e3:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--keys", default="1024,4000", help="context lengths, comma-separated")
    ap.add_argument(
        "--rows",
        default="1,4,8",
        help="query rows (1 a decode, 4 a chain-3 verify, 8 a prefill's unit)",
    )
    ap.add_argument("--dtype", default="float16", choices=("float16", "float32"))
    ap.add_argument("--isa", default=None, help="avx2,avx512 (default: those the CPU has)")
    ap.add_argument("--prefills", default="", help="prompt lengths to time whole prefills of")
    ap.add_argument("--rounds", type=int, default=4, help="of each prefill, the ISAs in turns")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="attention_cpu.json", help="file name in bench/results")
    args = ap.parse_args()
    if not cpu_ext.load():
        sys.exit("the CPU kernels did not build (kernels/cpu_ext.py): nothing to measure")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    best = cpu_ext.attention_isa("auto")
    isas = args.isa.split(",") if args.isa else sorted({"avx2", best})
    shapes = [(int(k), int(r)) for k in args.keys.split(",") for r in args.rows.split(",")]
    results = [measure(k, r, dtype, args.layers, args.reps, i) for k, r in shapes for i in isas]
    cpu_ext.attention_isa("auto")
    print(machine())
    print_table(
        [
            "keys",
            "rows",
            "isa",
            *(f"{o} us" for o in ORDERS),
            "slot order GB/s",
            "1-thread sum GB/s",
        ],
        [row_cells(r) for r in results],
        title=f"paged attention a layer ({args.dtype} K/V, {args.layers} layers' pools in turn)",
    )
    lengths = [int(n) for n in args.prefills.split(",") if n]
    prefill = prefills(lengths, isas, args.rounds) if lengths else []
    if prefill:
        print_table(
            ["tokens", "isa", "prefill ms (best / median)", "attention ms (best / median)",
             "same first token"],
            [[p["tokens"], p["isa"], best_median_ms(p["wall_s"]), best_median_ms(p["attention_s"]),
              p["same_first_token"]]
             for p in prefill],
            title="the default model's prefill (target-only, packed, 1 token generated)",
        )  # fmt: skip
    path = write_json(args.out, {"args": vars(args), "machine": machine_info(), "rows": results,
                                 "prefills": prefill})  # fmt: skip
    print("wrote", path)


if __name__ == "__main__":
    main()

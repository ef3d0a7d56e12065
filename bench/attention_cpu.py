"""The CPU paged attention kernel alone (kernels/cpu_attention.cpp): how much of a long
context's attention is arithmetic and how much waits on memory.

One request's rows (a decode, a verify) attend over `keys` keys in each of `--layers` layers'
own K/V pools (the default model's shape: 9 query heads over 3 K/V heads of 64; fp16 or fp32),
the layers one after another as a forward runs them, so a pool is out of the caches when its
layer comes again. The keys' slots come in three orders: in slot order (a request's K/V as the
allocator hands it out), shuffled (a fragmented pool), and all in the same 32 rows ("cached":
the same arithmetic with every row in L1, the kernel's own cost). Beside them, a plain sum over
the same bytes on one thread: what one core streams from where the pools live.

    python bench/attention_cpu.py [--keys 1024,4000] [--rows 1,4] [--dtype float16]
        [--layers 30] [--reps 20] [--threads 2] [--out attention_cpu.json]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine, machine_info, print_table, time_runs, write_json  # noqa: E402
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


def measure(keys: int, rows: int, dtype: torch.dtype, layers: int, reps: int) -> dict[str, Any]:
    slots = keys + 64
    k_pools = [torch.randn(slots, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(layers)]
    v_pools = [torch.randn(slots, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(layers)]
    q = torch.randn(rows, HEADS, HEAD_DIM)
    # req_pool_indices, prefix_lens, extend_lens, kv_lens of the one request
    lens = tuple(torch.tensor([x]) for x in (0, keys - rows, rows, keys))
    out: dict[str, Any] = {"keys": keys, "rows": rows, "dtype": str(dtype).removeprefix("torch.")}
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
    return [r["keys"], r["rows"], *times, round(r["gb_per_s"]["slot order"], 1),
            round(r["sum_1_thread_gb_per_s"], 1)]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--keys", default="1024,4000", help="context lengths, comma-separated")
    ap.add_argument("--rows", default="1,4", help="query rows (1 a decode, 4 a chain-3 verify)")
    ap.add_argument("--dtype", default="float16", choices=("float16", "float32"))
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
    shapes = [(int(k), int(r)) for k in args.keys.split(",") for r in args.rows.split(",")]
    results = [measure(k, r, dtype, args.layers, args.reps) for k, r in shapes]
    print(machine())
    print_table(
        ["keys", "rows", *(f"{o} us" for o in ORDERS), "slot order GB/s", "1-thread sum GB/s"],
        [row_cells(r) for r in results],
        title=f"paged attention a layer ({args.dtype} K/V, {args.layers} layers' pools in turn)",
    )
    path = write_json(args.out, {"args": vars(args), "machine": machine_info(), "rows": results})
    print("wrote", path)


if __name__ == "__main__":
    main()

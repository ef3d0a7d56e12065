"""Scaling out on one CPU machine: data-parallel replicas behind nginx, and tensor parallelism.

    python bench/scale_cpu.py [--clients 32] [--duration 30] [--replicas 1,2] [--tp 1,2]

- Replicas: `eagleserve serve --dp-size N` (the cores split between the replicas) behind
  nginx running deploy/nginx.conf; `--clients` concurrent clients send greedy completions
  (`--max-tokens` each, EOS ignored) for `--duration` seconds; output tokens per second.
- Tensor parallelism: the offline Engine with `--tp-size T` (gloo on CPU, the cores split
  between the ranks), batch 1, greedy: milliseconds per output token, from the time of
  `--new-tokens` tokens minus the time of one (the prefill).

The default model (SmolLM2-135M, packed int4 on CPU) unless --dtype float32. Writes
bench/results/scale_cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import load_average, machine_info, median, print_table, write_json  # noqa: E402
from bench.nginx_proc import Nginx, ensure_nginx  # noqa: E402

TOPICS = ["the sea", "prime numbers", "bread", "a robot", "the moon", "chess", "bees", "rain"]


def start_replicas(n: int, args: argparse.Namespace) -> tuple[subprocess.Popen[str], list[str]]:
    cmd = [sys.executable, "-m", "eagleserve", "serve", "--model", args.model, "--dtype",
           args.dtype, "--device", "cpu", "--port", "0", "--log-level", "warning",
           "--dp-size", str(n), "--max-running-requests", str(args.clients),
           "--max-total-tokens", "8192"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    urls: list[str] = []
    while len(urls) < n:
        if proc.poll() is not None:
            raise RuntimeError(f"--dp-size {n} exited with {proc.returncode}")
        if select.select([proc.stdout], [], [], 1.0)[0]:
            line = proc.stdout.readline()
            if line.startswith("eagleserve ready: "):
                urls.append(line.split()[2])
    return proc, urls


async def drive(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """`args.clients` clients sending completions back to back for `args.duration` s."""
    tokens, latencies = 0, []
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = time.monotonic()
        deadline = start + args.duration

        async def client(i: int) -> None:
            nonlocal tokens
            k = 0
            while time.monotonic() < deadline:
                body = {"model": args.model, "max_tokens": args.max_tokens, "temperature": 0,
                        "ignore_eos": True,
                        "prompt": f"Tell me about {TOPICS[(i + k) % len(TOPICS)]}."}  # fmt: skip
                t0 = time.monotonic()
                resp = await http.post("/v1/completions", json=body)
                resp.raise_for_status()
                tokens += resp.json()["usage"]["completion_tokens"]
                latencies.append(time.monotonic() - t0)
                k += 1

        await asyncio.gather(*(client(i) for i in range(args.clients)))
        elapsed = time.monotonic() - start
    return {"tokens": tokens, "requests": len(latencies), "elapsed_s": round(elapsed, 2),
            "tokens_per_s": tokens / elapsed,
            "latency_p50_s": median(latencies) if latencies else None}  # fmt: skip


def bench_replicas(n: int, nginx_bin: str, args: argparse.Namespace) -> dict[str, Any]:
    supervisor, urls = start_replicas(n, args)
    nginx = Nginx(nginx_bin, [u.removeprefix("http://") for u in urls])
    try:
        for _ in range(2):  # warm-up: first requests pay one-time costs
            httpx.post(nginx.url + "/v1/completions", timeout=300,
                       json={"model": args.model, "prompt": "Hi", "max_tokens": 4})  # fmt: skip
        return {"replicas": n, **asyncio.run(drive(nginx.url, args))}
    finally:
        nginx.stop()
        supervisor.send_signal(signal.SIGTERM)
        supervisor.wait(60)


def per_token_ms(tp: int, args: argparse.Namespace) -> dict[str, Any]:
    from eagleserve import Engine, SamplingParams

    torch.set_num_threads(os.cpu_count() or 1)  # TP=1 gets every core; ranks split them
    engine = Engine(args.model, device="cpu", dtype=args.dtype, tp_size=tp)
    prompt = "Write a short story about a lighthouse keeper."

    def run(n: int) -> float:
        t0 = time.perf_counter()
        engine.generate(prompt, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - t0

    try:
        run(8)  # warm-up
        full = [run(args.new_tokens) for _ in range(args.repeats)]
        one = [run(1) for _ in range(args.repeats)]
    finally:
        engine.close()
    ms = (median(full) - median(one)) / (args.new_tokens - 1) * 1000
    return {"tp_size": tp, "ms_per_token": ms, "tokens_per_s": 1000 / ms}


def _allreduce_rank(rank: int, port: int, out: Any) -> None:
    from eagleserve.distributed.parallel import (
        all_reduce,
        destroy_tensor_parallel,
        init_tensor_parallel,
    )

    torch.set_num_threads(1)
    init_tensor_parallel(rank, 2, port, torch.device("cpu"))
    x = torch.randn(1, 576)  # one token's hidden state (SmolLM2)
    for _ in range(50):
        all_reduce(x)
    t0 = time.perf_counter()
    for _ in range(500):
        all_reduce(x)
    if rank == 0:
        out.put((time.perf_counter() - t0) / 500 * 1e6)
    destroy_tensor_parallel()


def allreduce_us() -> float:
    """Microseconds of one gloo all-reduce of one token's hidden state between 2 ranks: what
    each of the 2 per layer costs a TP=2 decode step here."""
    import torch.multiprocessing as tmp

    from bench.nginx_proc import free_port

    ctx = tmp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    us = float(out.get(timeout=300))
    for p in procs:
        p.join()
    return us


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto", help="auto: packed int4 for the default model")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--replicas", default="1,2")
    p.add_argument("--tp", default="1,2")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    load_before = load_average()
    dp_rows: list[dict[str, Any]] = []
    if args.replicas:
        nginx_bin, why = ensure_nginx()
        if nginx_bin is None:
            print(f"bench/scale_cpu.py: skipping replicas: {why}", file=sys.stderr)
        else:
            dp_rows = [bench_replicas(int(n), nginx_bin, args) for n in args.replicas.split(",")]
    tp_rows = [per_token_ms(int(t), args) for t in args.tp.split(",")] if args.tp else []
    collective = allreduce_us() if args.tp else None
    info = {**machine_info(), "load_average_1min_before": load_before}
    if dp_rows:
        base = dp_rows[0]["tokens_per_s"]
        print_table(
            ["replicas", "clients", "requests", "tok/s", "x", "latency p50 s"],
            [
                [
                    r["replicas"],
                    args.clients,
                    r["requests"],
                    r["tokens_per_s"],
                    r["tokens_per_s"] / base,
                    r["latency_p50_s"],
                ]
                for r in dp_rows
            ],  # fmt: skip
            f"replicas behind nginx ({args.clients} clients, {args.max_tokens} tokens each)",
        )
    if tp_rows:
        print_table(
            ["tp-size", "ms/token", "tok/s"],
            [[r["tp_size"], r["ms_per_token"], r["tokens_per_s"]] for r in tp_rows],
            f"tensor parallelism, batch 1, {args.new_tokens} greedy tokens",
        )
        print(f"one gloo all-reduce of a [1, 576] fp32 hidden state, 2 ranks: {collective:.0f} us")
    path = write_json("scale_cpu.json", {"benchmark": "scale_cpu", "args": vars(args),
                                          "machine": info, "replicas": dp_rows,
                                          "tensor_parallel": tp_rows,
                                          "allreduce_us": collective})  # fmt: skip
    print(f"{info['description']}; load average {load_before} -> {load_average()}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

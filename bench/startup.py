"""How long `make serve` takes to answer: launch to "eagleserve ready" (/health answering), a
first start into an empty cache directory, then warm starts reusing it.

    python bench/startup.py [--config configs/smollm2-135m-eagle.yaml] [--warm 3]
        [--keep-kernels] [--out bench/results/startup.json]

The cache directory is a fresh temporary one (`EAGLESERVE_CACHE`), so the first start converts
the GGUF, packs the weights and times the adaptive cost table as a new user's would;
`--keep-kernels` copies the compiled CPU kernels in from the usual cache first (they build once
per machine at `make setup`, minutes of compiling that are not start-up). Each start answers one
greedy chat request before it is stopped; the answers must be equal.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import httpx  # noqa: E402

from bench.common import format_table, machine, write_json  # noqa: E402
from bench.server_proc import Server  # noqa: E402
from eagleserve.models.loader import cache_dir  # noqa: E402

CHAT = {"model": "default", "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": 8, "temperature": 0}  # fmt: skip


def one_start(config: str, cache: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    srv = Server(["--config", config], {"EAGLESERVE_CACHE": cache})
    ready = time.perf_counter() - t0
    try:
        resp = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=120)
        resp.raise_for_status()
        answer = resp.json()["choices"][0]["message"]["content"]
    finally:
        srv.stop()
    return {"ready_s": ready, "answer": answer}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="configs/smollm2-135m-eagle.yaml")
    ap.add_argument("--warm", type=int, default=3, help="warm starts after the first")
    ap.add_argument("--keep-kernels", action="store_true")
    ap.add_argument("--out", default="startup.json", help="file name under bench/results")
    a = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="eagleserve-startup-")
    kernels = os.path.join(cache_dir(), "kernels")
    if a.keep_kernels and os.path.isdir(kernels):
        shutil.copytree(kernels, os.path.join(cache, "kernels"))
    try:
        runs = [{"start": "first", **one_start(a.config, cache)}]
        runs += [{"start": f"warm {i + 1}", **one_start(a.config, cache)} for i in range(a.warm)]
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    assert len({r["answer"] for r in runs}) == 1, "a warm start answered differently"
    print(machine())
    print(format_table(["start", "ready s"], [[r["start"], round(r["ready_s"], 2)] for r in runs]))
    warm = sorted(r["ready_s"] for r in runs[1:])
    payload = {"machine": machine(), "config": a.config, "kept_kernels": a.keep_kernels,
               "runs": runs, "warm_median_s": warm[len(warm) // 2] if warm else None}  # fmt: skip
    print("wrote", write_json(a.out, payload))


if __name__ == "__main__":
    main()

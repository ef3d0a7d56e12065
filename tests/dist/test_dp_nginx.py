"""`eagleserve serve --dp-size 2` behind nginx (the shipped deploy/nginx.conf): bench/load.py
through nginx loses nothing, every greedy answer is exact, both replicas served requests, and
the API key passes through. nginx is Debian's package, installed only when absent (skipped,
saying why, when it cannot be)."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from bench.nginx_proc import Nginx, ensure_nginx
from bench.server_proc import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_KEY = "dp-test-key"
# The default model, packed: its CPU kernels compute a row alike in any batch, with or without
# a cached prefix, so each greedy answer must equal an offline run of it whichever replica and
# batch served it (an fp32 dense model makes no such promise: a near-tie in its logits can flip).
MODEL = "default"
FLAGS = ["--device", "cpu", "--max-total-tokens", "2048", "--max-running-requests", "16"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "EAGLESERVE_API_KEY": API_KEY}


@pytest.fixture(scope="module")
def nginx_binary() -> str:
    path, why = ensure_nginx()
    if path is None:
        pytest.skip(f"nginx is needed for this test: {why}")
    return path


def start_replicas(model: str, n: int) -> tuple[subprocess.Popen[str], list[str]]:
    """`eagleserve serve --dp-size n` and the replicas' URLs (their ready lines)."""
    log = tempfile.TemporaryFile("w+")
    cmd = [sys.executable, "-m", "eagleserve", "serve", "--model", model, "--port", "0",
           "--log-level", "warning", "--dp-size", str(n), *FLAGS]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=ENV)
    assert proc.stdout is not None
    urls: list[str] = []
    deadline = time.monotonic() + 240
    while len(urls) < n and time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 1.0)[0]:
            line = proc.stdout.readline()
            if line.startswith("eagleserve ready: "):
                urls.append(line.split()[2])
    if len(urls) < n:
        proc.kill()
        log.seek(0)
        raise AssertionError(f"replicas did not start: {log.read()[-3000:]}")
    return proc, urls


def test_load_through_nginx_over_two_replicas(nginx_binary: str, tmp_path: os.PathLike) -> None:
    supervisor, urls = start_replicas(MODEL, 2)
    nginx = None
    try:
        assert len(set(urls)) == 2
        nginx = Nginx(nginx_binary, [u.removeprefix("http://") for u in urls])
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
        denied = httpx.post(nginx.url + "/v1/completions", json=body, timeout=60)
        assert denied.status_code == 401, denied.text
        assert httpx.get(nginx.url + "/health", timeout=10).status_code == 200
        out = os.path.join(tmp_path, "load.json")
        cmd = [sys.executable, os.path.join(REPO, "bench", "load.py"), "--url", nginx.url,
               "--model", MODEL, "--clients", "16", "--duration", "20", "--max-tokens",
               "16", "--long-max-tokens", "32", "--long-repeats", "1,2", "--out", out,
               *FLAGS[2:]]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
        assert os.path.exists(out), proc.stdout[-3000:] + proc.stderr[-3000:]
        with open(out) as f:
            s = json.load(f)["summary"]
        detail = json.dumps(s, indent=1)[:3000]
        assert proc.returncode == 0 and s["ok"], detail
        assert s["lost"] == 0 and s["errors"] == 0, detail
        assert s["completed_greedy"] > 5 and s["greedy_exact"] == s["completed_greedy"], detail
        served = [read_metrics(u).get("eagleserve_requests_total", 0) for u in urls]
        assert all(n >= 3 for n in served), f"requests per replica: {served}"
    finally:
        if nginx is not None:
            nginx.stop()
        supervisor.send_signal(signal.SIGTERM)
        code = supervisor.wait(60)
    assert code == 0, f"--dp-size supervisor exited {code}"


def test_replicas_draw_from_their_own_random_seeds() -> None:
    """--dp-size with --random-seed: replica i seeds its unseeded requests with seed + i, so
    replicas do not give their n-th unseeded requests the same draws; without a seed, none."""
    from eagleserve.config import ServerArgs
    from eagleserve.server.dp import replica_args

    seed = random.randrange(2**31)
    base = ServerArgs(device="cpu", dp_size=3, port=8100, random_seed=seed)
    replicas = [replica_args(base, i) for i in range(3)]
    assert [r.random_seed for r in replicas] == [seed, seed + 1, seed + 2]
    assert [(r.dp_size, r.port) for r in replicas] == [(1, 8100), (1, 8101), (1, 8102)]
    unseeded = ServerArgs(device="cpu", dp_size=2)
    assert [replica_args(unseeded, i).random_seed for i in range(2)] == [None, None]

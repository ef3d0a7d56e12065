"""`/health_generate`: 200 only while the engine produces tokens. A stopped engine process
(SIGSTOP: alive, as a hung forward leaves it) keeps `/health` at 200 but fails this probe with
a 503 in its timeout, and passes it again once it runs. A real `eagleserve serve` on a tiny
target."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import save_tiny_model
from server_fixtures import wait_kv_free

from bench.server_proc import Server

TIMEOUT_S = 2.0


@pytest.fixture(scope="module", name="server")
def server_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = str(tmp_path_factory.mktemp("health") / "target")
    save_tiny_model(path, seed=5)
    env = {"OMP_NUM_THREADS": "1", "EAGLESERVE_HEALTH_GENERATE_TIMEOUT_S": str(TIMEOUT_S)}
    server = Server(["--model", path, "--device", "cpu", "--dtype", "float32"], env=env)
    yield server
    server.stop()


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc: each thread's children)."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in map(int, f.read().split()):
                out += [child, *descendants(child)]
    return out


def engine_processes(server: Server) -> list[int]:
    def cmdline(pid: int) -> str:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")

    engines = [p for p in descendants(server.proc.pid) if "resource_tracker" not in cmdline(p)]
    assert engines, "the server has no engine process"
    return engines


def test_a_stopped_engine_fails_the_probe_and_a_running_one_passes(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get("/health_generate").json() == {"status": "ok"}
        engines = engine_processes(server)
        for p in engines:
            os.kill(p, signal.SIGSTOP)
        try:
            assert http.get("/health").status_code == 200  # the process is alive
            t0 = time.monotonic()
            probe = http.get("/health_generate")
            waited = time.monotonic() - t0
            assert probe.status_code == 503, probe.text
            assert "no token" in probe.json()["error"]["message"]
            assert TIMEOUT_S <= waited < TIMEOUT_S + 10
        finally:
            for p in engines:
                os.kill(p, signal.SIGCONT)
        assert http.get("/health_generate").status_code == 200
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        out = http.post("/v1/completions", json=body)
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 4
        wait_kv_free(http, timeout=30)  # the probes' requests ended, their KV freed

"""Shared fixtures of the server tests: real `eagleserve serve` processes, tokenizer, Engine.

Not a conftest.py: pytest registers every conftest.py as the module `conftest`, and other test
files do `from conftest import ...` of tests/conftest.py. Test modules import the fixtures they
use from here (as `*_fixture`, named without the suffix); servers are cached per process, so
every module shares one of each.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

KV_TOKENS = 4096
API_KEY = "test-secret-key"
MODEL = "smol"  # --served-model-name of the main server fixture
READY_TIMEOUT_S = 300.0


class ServerProcess:
    def __init__(self, extra: list[str], env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "eagleserve", "serve", "--model", "default", "--device",
               "cpu", "--max-total-tokens", str(KV_TOKENS), "--port", "0", "--log-level",
               "warning", *extra]  # fmt: skip
        self.log = tempfile.NamedTemporaryFile("w+", prefix="eagleserve-test-", suffix=".log")
        env = {**os.environ, **(env or {})}
        out = subprocess.PIPE
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=self.log, text=True, env=env)
        self.url = self._wait_ready()

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + READY_TIMEOUT_S
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if ready:
                line = self.proc.stdout.readline()
                if line.startswith("eagleserve ready: "):
                    return line.split()[2]
            if self.proc.poll() is not None:
                break
        self.log.seek(0)
        tail = self.log.read()[-4000:]
        self.stop()
        raise RuntimeError(f"server did not start:\n{tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # Closing deletes it: a session-scoped server outlives the finalizers that would.
        self.log.close()


_CACHE: dict[str, Any] = {}


def _cached(key: str, make: Any) -> Any:
    if key not in _CACHE:
        _CACHE[key] = make()
    return _CACHE[key]


@pytest.fixture(scope="session", name="server")
def server_fixture() -> Iterator[ServerProcess]:
    srv = _cached("server", lambda: ServerProcess(["--served-model-name", MODEL,
                                                   "--enable-request-id-headers"]))  # fmt: skip
    yield srv
    srv.stop()
    # uvicorn re-raises SIGTERM after its graceful shutdown.
    assert srv.proc.returncode in (0, -signal.SIGTERM), "the server did not shut down cleanly"
    assert not os.path.exists(srv.log.name), "the server's log outlived it"


@pytest.fixture(scope="session", name="key_server")
def key_server_fixture() -> Iterator[ServerProcess]:
    srv = _cached(
        "key", lambda: ServerProcess(["--max-total-tokens", "512"], {"EAGLESERVE_API_KEY": API_KEY})
    )
    yield srv
    srv.stop()


# The shipped EAGLE3 head on a 3-step chain, logging at info with a short stats interval
# (scheduler/stats_log.py): the tests that need speculation on the default model share it.
SPEC_FLAGS = ["--log-level", "info", "--speculative-algorithm", "EAGLE3",
              "--speculative-draft-model-path", "builtin:smollm2-135m-eagle",
              "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
              "--speculative-num-draft-tokens", "4"]  # fmt: skip
STATS_INTERVAL_S = 0.5


@pytest.fixture(scope="session", name="spec_server")
def spec_server_fixture() -> Iterator[ServerProcess]:
    env = {"EAGLESERVE_LOG_STATS_INTERVAL": str(STATS_INTERVAL_S)}
    srv = _cached("spec", lambda: ServerProcess(SPEC_FLAGS, env))
    yield srv
    srv.stop()


@pytest.fixture(scope="session", name="base_url")
def base_url_fixture(server: ServerProcess) -> str:
    return server.url + "/v1"


@pytest.fixture(name="http")
def http_fixture(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="session", name="tokenizer")
def tokenizer_fixture() -> Any:
    from transformers import AutoTokenizer

    from eagleserve.models.loader import resolve_model_path

    return _cached("tok", lambda: AutoTokenizer.from_pretrained(resolve_model_path("default")))


@pytest.fixture(scope="session", name="engine")
def engine_fixture() -> Any:
    from eagleserve import Engine

    return _cached(
        "engine", lambda: Engine(model="default", device="cpu", max_total_tokens=KV_TOKENS)
    )


def metric(http: httpx.Client, name: str, **labels: str) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(http.get("/metrics").text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def wait_kv_free(http: httpx.Client, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            metric(http, "eagleserve_kv_used_tokens") == 0
            and metric(http, "eagleserve_num_requests_running")
            + metric(http, "eagleserve_num_requests_waiting")
            == 0
        ):
            return
        time.sleep(0.25)
    raise AssertionError(f"KV not freed: {metric(http, 'eagleserve_kv_used_tokens')} in use")

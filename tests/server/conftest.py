"""Shared fixtures: real `eagleserve serve` processes on free ports, the tokenizer, an Engine."""

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

KV_TOKENS = 4096
API_KEY = "test-secret-key"
READY_TIMEOUT_S = 300.0


class ServerProcess:
    def __init__(self, extra: list[str], env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "eagleserve", "serve", "--model", "default", "--device",
               "cpu", "--kv-cache-tokens", str(KV_TOKENS), "--port", "0", "--log-level",
               "warning", *extra]  # fmt: skip
        self.log = tempfile.NamedTemporaryFile("w+", prefix="eagleserve-test-", suffix=".log")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env={**os.environ, **(env or {})}
        )
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
        self.stop()
        self.log.seek(0)
        raise RuntimeError(f"server did not start:\n{self.log.read()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess(["--served-model-name", "smol"])
    yield srv
    srv.stop()
    assert srv.proc.returncode == 0, "the server did not shut down cleanly"


@pytest.fixture(scope="session")
def key_server() -> Iterator[ServerProcess]:
    srv = ServerProcess(["--kv-cache-tokens", "512"], env={"EAGLESERVE_API_KEY": API_KEY})
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def base_url(server: ServerProcess) -> str:
    return server.url + "/v1"


@pytest.fixture()
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from eagleserve.model.loader import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("default"))


@pytest.fixture(scope="session")
def engine() -> Any:
    from eagleserve import Engine

    return Engine(model="default", device="cpu", kv_cache_tokens=KV_TOKENS)

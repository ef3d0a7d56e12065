"""`eagleserve serve --tp-size 2` (gloo): it serves; a killed rank takes the engine down (503,
then a non-zero exit); --tp-size values that cannot work are one line and exit code 2."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

SERVE = [sys.executable, "-m", "eagleserve", "serve", "--device", "cpu", "--port", "0",
         "--dtype", "float32", "--max-total-tokens", "1024"]  # fmt: skip
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _wait_ready(proc: subprocess.Popen[str], log: tempfile._TemporaryFileWrapper) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 1.0)[0]:
            line = proc.stdout.readline()
            if line.startswith("eagleserve ready: "):
                return line.split()[2]
    log.seek(0)
    raise AssertionError(f"server did not start:\n{log.read()[-4000:]}")


def test_killed_rank_gives_503_and_nonzero_exit(tiny_model_dir: str) -> None:
    log = tempfile.NamedTemporaryFile("w+", prefix="eagleserve-tp-", suffix=".log")
    cmd = [*SERVE, "--model", tiny_model_dir, "--tp-size", "2", "--log-level", "info"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=ENV)
    try:
        url = _wait_ready(proc, log)
        body = {"model": tiny_model_dir, "prompt": [5, 6, 7, 8], "max_tokens": 8,
                "temperature": 0}  # fmt: skip
        ok = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] >= 1
        log.seek(0)
        pid = int(re.findall(r"tensor-parallel rank 1: pid (\d+)", log.read())[0])
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 after the rank died"
            time.sleep(0.2)
        dead = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert dead.status_code == 503, dead.text
        assert proc.wait(30) == 1
        log.seek(0)
        assert "tensor-parallel rank 1 (exit code -9) died" in log.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--tp-size", "0"], ["--tp-size 0", "at least 1"]),
        (["--tp-size", "3"], ["--tp-size 3 does not fit the model's 2 KV heads"]),
    ],
)
def test_bad_tp_size_is_one_line_exit_2(tiny_model_dir: str, flags: list[str],
                                        words: list[str]) -> None:  # fmt: skip
    proc = subprocess.run([*SERVE, "--model", tiny_model_dir, *flags], capture_output=True,
                          text=True, timeout=240, env=ENV)  # fmt: skip
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("eagleserve: error: ")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr[-3000:]
    for word in words:
        assert word in errors[0], errors[0]

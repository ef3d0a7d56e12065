"""The Docker image can run its GPU paths (issue #20 item 8): a C compiler in the image (Triton
and torch.compile build launchers at run time), the torch version CI tests, Triton installed;
and the image's own command starts a server that answers (this machine has no Docker daemon,
so the command runs here, from the repository, as the image runs it from its WORKDIR)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import select
import signal
import subprocess
import sys
import time

import httpx
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
COMPILERS = ("gcc", "clang", "build-essential")


def runs() -> list[str]:
    """The RUN instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    return [ln[4:] for ln in text.splitlines() if ln.startswith("RUN ")]


def exec_form(name: str) -> list[str]:
    match = re.search(rf"^{name}\s+(\[.*\])\s*$", DOCKERFILE, re.MULTILINE)
    assert match, f"Dockerfile has no exec-form {name}"
    return json.loads(match.group(1))


def test_image_has_a_c_compiler() -> None:
    base = re.search(r"^FROM\s+(\S+)", DOCKERFILE, re.MULTILINE).group(1)
    installed = any(
        re.search(r"\b(apt-get|apk|dnf|yum)\b.*\binstall\b", cmd)
        and any(re.search(rf"\s{c}(\s|$)", cmd) for c in COMPILERS)
        for cmd in runs()
    )
    assert installed or "devel" in base, f"no C compiler in {base} and none installed"


def test_torch_is_the_version_ci_tests() -> None:
    ci = re.search(r"torch==([\w.]+)", (ROOT / "Makefile").read_text()).group(1)
    pinned = re.search(r"^ARG TORCH_VERSION=([\w.]+)", DOCKERFILE, re.MULTILINE)
    assert pinned and pinned.group(1) == ci, f"the image's torch is not {ci}, which CI tests"
    assert any("torch==${TORCH_VERSION}" in cmd for cmd in runs())
    assert "FROM pytorch/" not in DOCKERFILE  # whose own torch would be another version


def test_triton_is_installed_with_eagleserve() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"triton\b.*linux", d) for d in deps), deps
    install = [cmd for cmd in runs() if re.search(r"pip install [^&]*\s\.(\s|$)", cmd)]
    assert install, "the image does not pip install eagleserve with its dependencies"
    assert not re.search(r"pip install --no-deps[^&]*\s\.(\s|$)", install[0])
    default_index = re.search(r"^ARG TORCH_INDEX_URL=(.*)$", DOCKERFILE, re.MULTILINE).group(1)
    assert "cpu" not in default_index, "a CPU-only torch build has no GPU paths"


def test_the_image_command_serves() -> None:
    """ENTRYPOINT + CMD, with the address moved to a free loopback port: it must load the
    shipped config (model and EAGLE head), answer /health and stop cleanly on SIGTERM."""
    argv = [*exec_form("ENTRYPOINT")[1:], *exec_form("CMD"), "--host", "127.0.0.1", "--port", "0"]
    cmd = [sys.executable, "-m", "eagleserve", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)  # fmt: skip
    try:
        url = None
        deadline = time.monotonic() + 300
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line = proc.stdout.readline()
                if line.startswith("eagleserve ready: "):
                    url = line.split()[2]
        assert url, proc.stderr.read() if proc.poll() is not None else "no ready line"
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        body = {"prompt": "Hi", "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

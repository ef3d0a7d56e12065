"""The Docker image can run its GPU paths (issue #20 item 8): a C compiler in the image (Triton
and torch.compile build launchers at run time), the torch version CI tests, Triton from the GPU
torch (never the PyPI `triton` over ROCm's); and the image's own install lines and command make
a server that answers (this machine has no Docker daemon: the install lines run here into a
fresh venv, CPU torch from the configured index, and the command starts from a copy of the
image's WORKDIR)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import select
import shutil
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


def test_triton_comes_with_a_gpu_torch_and_never_replaces_rocms() -> None:
    """`triton` is no core dependency (on ROCm it would overwrite torch's pytorch-triton-rocm;
    a CPU install needs none): it is the `[cuda]` extra, and the image checks that its GPU torch
    brought Triton."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(re.match(r"triton\b", d) for d in project["dependencies"])
    # xgrammar's metadata requires the PyPI triton on Linux: installed --no-deps, never a dep.
    assert not any(re.match(r"xgrammar\b", d) for d in project["dependencies"])
    assert any(re.search(r"pip install [^&]*--no-deps xgrammar==", cmd) for cmd in runs())
    assert any(re.match(r"triton\b.*linux", d) for d in project["optional-dependencies"]["cuda"])
    install = [cmd for cmd in runs() if re.search(r"pip install [^&]*\s\.(\s|$)", cmd)]
    assert install, "the image does not pip install eagleserve with its dependencies"
    assert not re.search(r"pip install --no-deps[^&]*\s\.(\s|$)", install[0])
    assert "find_spec('triton')" in install[0] and "torch.version" in install[0]
    default_index = re.search(r"^ARG TORCH_INDEX_URL=(.*)$", DOCKERFILE, re.MULTILINE).group(1)
    assert "cpu" not in default_index, "a CPU-only torch build has no GPU paths"
    assert "rocm" in (ROOT / "README.md").read_text().lower()


def docker_env(cache: pathlib.Path) -> dict[str, str]:
    """The image's ENV, its cache moved under `cache`."""
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    env = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            for key, value in re.findall(r"(\w+)=(\S+)", line):
                env[key] = str(cache) if key == "EAGLESERVE_CACHE" else value
    return env


def build_image_venv(tmp: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, dict[str, str]]:
    """The image's WORKDIR (its COPY sources) and a venv filled by the image's pip RUN lines,
    run as they are with the ARG defaults (apt-get lines aside: they install the compiler)."""
    work = tmp / "workdir"
    work.mkdir()
    for line in DOCKERFILE.splitlines():
        if line.startswith("COPY "):
            *sources, dest = line.split()[1:]
            for src in sources:
                target = work / (dest if dest not in ("./", ".") else src)
                if (ROOT / src).is_dir():
                    shutil.copytree(ROOT / src, target, ignore=shutil.ignore_patterns(
                        "__pycache__"))  # fmt: skip
                else:
                    shutil.copy(ROOT / src, target)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    args = dict(re.findall(r'^ARG (\w+)="?([^"\n]*)"?$', DOCKERFILE, re.MULTILINE))
    env = {**os.environ, **args, **docker_env(tmp / "cache"),
           "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}  # fmt: skip
    env.pop("PYTHONPATH", None)  # the venv's own eagleserve, not the checkout's
    for cmd in runs():
        if "pip install" in cmd:
            proc = subprocess.run(["bash", "-c", f"set -e; {cmd}"], cwd=work, env=env,
                                  capture_output=True, text=True, timeout=900)  # fmt: skip
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return work, venv, env


def test_a_venv_built_as_the_image_serves(tmp_path: pathlib.Path) -> None:
    """The Dockerfile's install lines, run here into a fresh venv, then ENTRYPOINT + CMD from
    it (the address moved to a free loopback port): it loads the shipped config (model and
    EAGLE head), answers /health and a completion, and stops cleanly on SIGTERM."""
    assert shutil.which("gcc") or shutil.which("cc"), "no C compiler (the image installs gcc)"
    work, venv, env = build_image_venv(tmp_path)
    entry = exec_form("ENTRYPOINT")
    exe = venv / "bin" / entry[0]
    assert exe.exists(), f"the install lines made no {entry[0]} command"
    argv = [str(exe), *entry[1:], *exec_form("CMD"), "--host", "127.0.0.1", "--port", "0"]
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(argv, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
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
        body = {"prompt": "Hi", "max_tokens": 2, "presence_penalty": 1.0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

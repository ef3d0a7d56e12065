"""Shared helpers of the reliability tests: a tiny target with a chat template and an EAGLE head,
real `eagleserve serve` processes on 127.0.0.1 (bench/server_proc.py's `Server`), /metrics readers.

Not a conftest.py (tests/conftest.py is imported as `conftest` by other tests). Servers are cached
per process so the modules share one of each kind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from conftest import save_tiny_model  # noqa: E402

from bench.server_proc import BUSY_GAUGES, Server, read_metrics, wait_idle  # noqa: E402

# Chat template of the tiny char-level tokenizer (one character per token).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
FAULT_TOKEN = 200  # prompts starting with this token id fail inside the engine (fault hook)
SPEC_FLAGS = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
              "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]  # fmt: skip
SMALL_KV = 768  # tokens: a few long requests together overflow it

_CACHE: dict[str, Any] = {}


def build_tiny_target(path: str) -> str:
    """The tests' tiny random Llama (vocab 256, context 512) plus a chat template."""
    save_tiny_model(path, seed=0)
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = CHAT_TEMPLATE
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return path


def build_tiny_head(target: str, out: str, seed: int = 0) -> str:
    """A random EAGLE-1 head for `target` (mostly rejected drafts: exercises the verify path)."""
    from eagleserve.config import ModelConfig
    from eagleserve.model_executor.model_runner import ModelRunner
    from eagleserve.spec.head_loader import init_eagle_head, save_eagle_head

    cfg = ModelConfig.from_dir(target)
    runner = ModelRunner(cfg, target, torch.device("cpu"), torch.float32, 64, 1, 512)
    head = init_eagle_head("EAGLE", runner.model, seed=seed)
    save_eagle_head(head, out)
    return out


@pytest.fixture(scope="session", name="tiny_dirs")
def tiny_dirs_fixture(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(tiny target dir, EAGLE head dir), built once per session."""
    if "dirs" not in _CACHE:
        root = tmp_path_factory.mktemp("reliability")
        target = build_tiny_target(str(root / "target"))
        _CACHE["dirs"] = (target, build_tiny_head(target, str(root / "head")))
    return _CACHE["dirs"]


def run_bench(script: str, args: list[str], out: str) -> tuple[int, dict[str, Any], str]:
    """Runs bench/`script` with `args` and `--out out` on one OpenMP thread; returns its exit
    code, the summary it wrote, and a failure message (the summary, a dead server's log)."""
    cmd = [sys.executable, os.path.join(REPO, "bench", script), *args, "--out", out]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert os.path.exists(out), proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        summary = json.load(f)["summary"]
    detail = summary.get("server_log_tail", "") + json.dumps(summary, indent=1)[:4000]
    return proc.returncode, summary, detail


def spec_flags(head: str) -> list[str]:
    return [*SPEC_FLAGS, "--speculative-draft-model-path", head]


def start_server(target: str, extra: list[str], env: dict[str, str] | None = None) -> Server:
    flags = ["--model", target, "--device", "cpu", "--dtype", "float32", *extra]
    return Server(flags, env={"OMP_NUM_THREADS": "1", **(env or {})})


@pytest.fixture(scope="session", name="spec_server")
def spec_server_fixture(tiny_dirs: tuple[str, str]) -> Iterator[Server]:
    """Tiny target + EAGLE, overlap on (the GPU default, forced here), a small KV pool,
    priority scheduling on (the schema fuzzer's random priorities then preempt)."""
    if "spec" not in _CACHE:
        target, head = tiny_dirs
        flags = ["--max-total-tokens", str(SMALL_KV), "--max-running-requests", "16",
                 "--no-disable-overlap-schedule", "--enable-priority-scheduling",
                 *spec_flags(head)]  # fmt: skip
        _CACHE["spec"] = start_server(target, flags)
    yield _CACHE["spec"]
    _CACHE["spec"].stop()
    assert not os.path.exists(_CACHE["spec"].log.name), "the server's log outlived it"


@pytest.fixture(scope="module", name="fault_server")
def fault_server_fixture(tiny_dirs: tuple[str, str]) -> Iterator[Server]:
    """Tiny target + EAGLE without overlap (the shipped config's mode), the fault hook armed.

    Not with overlap: the hook fails *every* batch holding the trigger request, and with overlap
    the batch launched before the failure is known still holds it (with its neighbours). The
    overlap case runs with a one-shot fault in test_shutdown.py."""
    target, head = tiny_dirs
    flags = ["--max-total-tokens", "1024", "--disable-overlap-schedule", *spec_flags(head)]
    srv = start_server(target, flags, {"EAGLESERVE_FAULT_INJECT_TOKEN": str(FAULT_TOKEN)})
    yield srv
    srv.stop()


def metric(url: str, name: str) -> float:
    return read_metrics(url).get(name, 0.0)


def wait_kv_free(url: str, timeout: float = 30.0) -> dict[str, float]:
    """Waits until no KV slot is used and nothing runs or waits; fails after `timeout`."""
    m = wait_idle(url, timeout)
    busy = sum(m.get(f"eagleserve_{k}", 0) for k in BUSY_GAUGES)
    assert busy == 0, f"KV not freed: {m.get('eagleserve_kv_used_tokens')} in use"
    return m


def completion(url: str, prompt: Any, max_tokens: int, **kw: Any) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


class GroupServer(Server):
    """`Server` as systemd or a terminal runs it: in a process group of its own (with its engine
    process), so a test can signal the whole group."""

    def __init__(self, flags: list[str], env: dict[str, str] | None = None) -> None:
        super().__init__(flags, {"OMP_NUM_THREADS": "1", **(env or {})}, new_session=True)


def sse_events(url: str, body: dict[str, Any], first: threading.Event | None = None) -> list[str]:
    """The `data:` payloads of a streamed completion, in order; sets `first` at the first one."""
    events: list[str] = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=120) as resp:  # fmt: skip
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if first is not None:
                    first.set()
    return events

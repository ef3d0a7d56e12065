"""The engine's torch profiler (scheduler/profiler.py): a trace of exactly the steps asked for,
each one `eagleserve.step` span, written where the request or the environment says; what it
cannot do is a reason, never an exception in the engine loop."""

from __future__ import annotations

import gzip
import json
import os
import random
from pathlib import Path

import pytest
import torch

from eagleserve.messages import ProfileReq
from eagleserve.scheduler.profiler import DIR_ENVS, EngineProfiler, trace_dir


def events(path: str) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def spans(path: str, name: str) -> int:
    return sum(1 for e in events(path) if e.get("name") == name and e.get("ph") == "X")


def work() -> float:
    a = torch.randn(32, 32)
    return float((a @ a).sum())


def test_a_trace_holds_each_step_between_start_and_stop(tmp_path: Path) -> None:
    prof = EngineProfiler()
    steps = random.randint(2, 5)
    prof.step(work)  # before start: not in the trace
    started = prof.start(ProfileReq(True, str(tmp_path / "traces")))
    assert started.ok and started.trace_path is not None and prof.active
    assert started.trace_path.startswith(str(tmp_path / "traces") + os.sep)
    for _ in range(steps):
        prof.step(work)
    stopped = prof.stop()
    assert stopped.ok and stopped.trace_path == started.trace_path and not prof.active
    assert spans(stopped.trace_path, "eagleserve.step") == steps
    assert any(e.get("name") == "aten::mm" for e in events(stopped.trace_path))


def test_num_steps_stops_by_itself(tmp_path: Path) -> None:
    prof = EngineProfiler()
    n = random.randint(1, 4)
    path = prof.start(ProfileReq(True, str(tmp_path), num_steps=n)).trace_path
    assert path is not None
    for i in range(n + 2):
        assert prof.active == (i < n)
        prof.step(work)
    assert not prof.active and os.path.isfile(path)
    assert spans(path, "eagleserve.step") == n
    assert not prof.stop().ok  # already stopped: nothing to stop


def test_what_cannot_be_done_is_a_reason(tmp_path: Path) -> None:
    prof = EngineProfiler()
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    bad = [
        ProfileReq(True, str(blocker / "sub")),  # a file in the way
        ProfileReq(True, str(tmp_path), activities=("TPU",)),
        ProfileReq(True, str(tmp_path), activities=()),
        ProfileReq(True, str(tmp_path), num_steps=0),
    ]
    if not torch.cuda.is_available():
        bad.append(ProfileReq(True, str(tmp_path), activities=("GPU",)))
    for req in bad:
        result = prof.start(req)
        assert not result.ok and result.message and not prof.active, req
    assert not prof.stop().ok
    assert prof.start(ProfileReq(True, str(tmp_path))).ok
    again = prof.start(ProfileReq(True, str(tmp_path)))
    assert not again.ok and "already" in again.message
    assert prof.stop().ok


def test_the_folder_comes_from_the_request_then_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for env in DIR_ENVS:
        monkeypatch.delenv(env, raising=False)
    assert trace_dir(None) == "/tmp"
    for env in reversed(DIR_ENVS):  # ours first, then SGLang's, then vLLM's
        monkeypatch.setenv(env, str(tmp_path / env))
        assert trace_dir(None) == str(tmp_path / env)
    assert trace_dir(str(tmp_path / "asked")) == str(tmp_path / "asked")

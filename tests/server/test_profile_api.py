"""SGLang's and vLLM's /start_profile and /stop_profile: the engine's torch profiler over the
requests served between them, its trace file where asked; misuse is a 400 that leaves the server
serving."""

from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path

import httpx
from server_fixtures import http_fixture, server_fixture  # noqa: F401 (fixtures)

ASK = {"prompt": "Count: 1, 2, 3,", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def step_spans(path: str) -> int:
    with gzip.open(path, "rt") as f:
        return sum(1 for e in json.load(f)["traceEvents"] if e.get("name") == "eagleserve.step")


def test_a_profile_traces_the_requests_between_start_and_stop(
    http: httpx.Client, tmp_path: Path
) -> None:
    start = http.post("/start_profile", json={"output_dir": str(tmp_path), "record_shapes": True})
    assert start.status_code == 200, start.text
    path = start.json()["trace_path"]
    assert path.startswith(str(tmp_path)) and not os.path.exists(path)
    again = http.post("/start_profile", json={"output_dir": str(tmp_path)})
    assert again.status_code == 400 and "already" in again.json()["error"]["message"]
    assert http.post("/v1/completions", json=ASK).status_code == 200
    stop = http.post("/stop_profile")
    assert stop.status_code == 200, stop.text
    assert stop.json()["trace_path"] == path
    assert step_spans(path) >= 6  # the prefill and the decodes of 6 tokens, at the least
    assert http.post("/stop_profile").status_code == 400  # nothing running
    assert http.post("/v1/completions", json=ASK).status_code == 200


def test_num_steps_writes_the_trace_without_a_stop(http: httpx.Client, tmp_path: Path) -> None:
    start = http.post("/start_profile", json={"output_dir": str(tmp_path), "num_steps": 3})
    assert start.status_code == 200, start.text
    assert http.post("/v1/completions", json=ASK).status_code == 200
    path = start.json()["trace_path"]
    deadline = time.monotonic() + 30
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert step_spans(path) == 3
    assert http.post("/stop_profile").status_code == 400


def test_misuse_is_a_400_naming_it(http: httpx.Client, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cases = [
        ({"output_dir": str(blocker / "sub")}, None),
        ({"start_step": 2}, "start_step"),
        ({"profile_by_stage": True}, "profile_by_stage"),
        ({"activities": ["TPU"]}, "activities.0"),
        ({"num_steps": 0}, "num_steps"),
    ]
    for body, param in cases:
        resp = http.post("/start_profile", json=body)
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["error"]["param"] == param, (body, resp.text)
    assert http.post("/stop_profile").status_code == 400  # none of them started it

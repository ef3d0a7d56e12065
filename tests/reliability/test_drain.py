"""Shutdown as users expect it (issue #20 item 4): SIGTERM / SIGINT to the whole process group
drains (the engine survives the group's signal); streams cut at the drain timeout get an error
event and `[DONE]`; exit 0 after a drain, non-zero when the engine died; no traceback."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from rel_fixtures import GroupServer, sse_events, tiny_dirs_fixture  # noqa: F401 (fixtures)

LONG = {"prompt": [5] * 8, "max_tokens": 500, "ignore_eos": True, "temperature": 0}


def stream_in_thread(url: str, out: dict[str, list[str]], name: str) -> threading.Event:
    first = threading.Event()

    def run() -> None:
        out[name] = sse_events(url, LONG, first)

    threading.Thread(target=run, daemon=True).start()
    return first


def assert_no_traceback(srv: GroupServer) -> None:
    log = srv.log_tail(100_000)
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_group_signal_drains_streams_to_done(tiny_dirs: tuple[str, str], sig: int) -> None:
    """The signal reaches the engine too (systemd's KillMode=control-group, Ctrl-C): it must
    not die; the running stream finishes with all its tokens and [DONE]; exit code 0."""
    srv = GroupServer(["--model", tiny_dirs[0], "--device", "cpu", "--dtype", "float32"])
    try:
        got: dict[str, list[str]] = {}
        assert stream_in_thread(srv.url, got, "s").wait(60)
        os.killpg(srv.proc.pid, sig)
        rc = srv.proc.wait(60)
        time.sleep(0.2)
    finally:
        srv.stop()
    events = got["s"]
    assert events[-1] == "[DONE]", events[-3:]
    assert not any('"error"' in e for e in events), [e for e in events if '"error"' in e]
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert rc == 0, srv.log_tail()
    assert_no_traceback(srv)


def test_drain_timeout_cuts_streams_with_error_event_and_done(tiny_dirs: tuple[str, str]) -> None:
    """16 long streams outlast a 0.1 s drain: the ones still running are cut with an error event
    and [DONE] (before: neither, and an ASGI traceback); the process exits 0. (The drain is
    short so that no machine finishes 16 x 500 tokens within it: at 1 s a fast idle CPU did.)"""
    srv = GroupServer(
        ["--model", tiny_dirs[0], "--device", "cpu", "--dtype", "float32",
         "--max-total-tokens", "8192"],
        {"EAGLESERVE_DRAIN_TIMEOUT_S": "0.1"},
    )  # fmt: skip
    try:
        got: dict[str, list[str]] = {}
        started = [stream_in_thread(srv.url, got, f"s{i}") for i in range(16)]
        assert all(ev.wait(60) for ev in started)
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(30)
        deadline = time.monotonic() + 10
        while len(got) < 16 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        srv.stop()
    assert sorted(got) == sorted(f"s{i}" for i in range(16)), "a stream was left hanging"
    cut = [e for e in got.values() if any('"error"' in x for x in e)]
    assert cut, "no stream outlasted the drain: the test proves nothing"
    for events in got.values():
        assert events[-1] == "[DONE]", events[-3:]
    for events in cut:
        err = json.loads(events[-2])["error"]
        assert "drain timeout" in err["message"] and err["type"] == "service_unavailable"
    assert rc == 0, srv.log_tail()
    assert_no_traceback(srv)


def test_engine_death_during_drain_exits_nonzero(tiny_dirs: tuple[str, str]) -> None:
    srv = GroupServer(["--model", tiny_dirs[0], "--device", "cpu", "--dtype", "float32"])
    try:
        got: dict[str, list[str]] = {}
        assert stream_in_thread(srv.url, got, "s").wait(60)
        with open(f"/proc/{srv.proc.pid}/task/{srv.proc.pid}/children") as f:
            children = [int(c) for c in f.read().split()]
        srv.proc.send_signal(signal.SIGTERM)
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        rc = srv.proc.wait(30)
    finally:
        srv.stop()
    assert rc == 1, srv.log_tail()
    events = got["s"]
    assert events[-1] == "[DONE]" and "engine process is not running" in events[-2], events[-3:]


def test_second_signal_cuts_at_once(tiny_dirs: tuple[str, str]) -> None:
    """SIGINT to the server alone, then again (an impatient Ctrl-C): the second one cuts the
    running streams at once (error event + [DONE]) instead of waiting out the 60 s drain."""
    srv = GroupServer(
        ["--model", tiny_dirs[0], "--device", "cpu", "--dtype", "float32",
         "--max-total-tokens", "8192"],
        {"EAGLESERVE_DRAIN_TIMEOUT_S": "60"},
    )  # fmt: skip
    try:
        got: dict[str, list[str]] = {}
        started = [stream_in_thread(srv.url, got, f"s{i}") for i in range(16)]
        assert all(ev.wait(60) for ev in started)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        srv.proc.send_signal(signal.SIGINT)
        rc = srv.proc.wait(30)
        took = time.monotonic() - t0
        deadline = time.monotonic() + 10
        while len(got) < 16 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        srv.stop()
    assert rc == 0 and took < 15, (rc, took, srv.log_tail())
    assert len(got) == 16 and all(events[-1] == "[DONE]" for events in got.values())
    assert any("drain timeout" in events[-2] for events in got.values())
    assert_no_traceback(srv)

"""The server process the load test and the reliability tests drive: `eagleserve serve` on
127.0.0.1 (flags from bench/load.py's arguments), its /metrics samples, waiting until it is idle.
"""

from __future__ import annotations

import argparse
import os
import select
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

from eagleserve.benchmark.stats import spec_counters
from eagleserve.benchmark.stats import spec_figures as served_spec_figures

HOST = "127.0.0.1"  # all traffic stays on the loopback interface


def server_flags(args: argparse.Namespace) -> list[str]:
    """`eagleserve serve` flags for bench/load.py's parsed arguments (model, KV pool, EAGLE,
    a config file)."""
    flags = [
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--max-total-tokens",
        str(args.max_total_tokens),
        "--max-running-requests",
        str(args.max_running_requests),
    ]
    if args.spec:
        flags += [
            "--speculative-algorithm",
            args.algorithm,
            "--speculative-draft-model-path",
            args.draft,
            "--speculative-num-steps",
            "3",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "4",
        ]
    if args.config:  # the flags above and below override it
        flags += ["--config", args.config]
    if args.disable_overlap_schedule is not None:  # else the device's default
        no = "" if args.disable_overlap_schedule else "no-"
        flags.append(f"--{no}disable-overlap-schedule")
    return flags + shlex.split(args.serve_flags)


class Server:
    """`eagleserve serve` on 127.0.0.1 and a free port; `stop()` sends SIGTERM."""

    def __init__(
        self,
        flags: list[str],
        env: dict[str, str] | None = None,
        new_session: bool = False,
        cwd: str | None = None,
    ) -> None:
        """`cwd`: run there, so that `python -m eagleserve` serves that checkout's package."""
        cmd = [
            sys.executable,
            "-m",
            "eagleserve",
            "serve",
            "--host",
            HOST,
            "--port",
            "0",
            "--log-level",
            "warning",
            *flags,
        ]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="eagleserve-load-", suffix=".log")
        self.final_log = ""
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=new_session,
            env={**os.environ, **(env or {})},
            cwd=cwd,
        )
        self.url = self._wait_ready(300.0)

    def _wait_ready(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if select.select([self.proc.stdout], [], [], 1.0)[0]:
                line = self.proc.stdout.readline()
                if line.startswith("eagleserve ready: "):
                    return line.split()[2]
        self.stop()
        raise RuntimeError(f"server did not start:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        if self.log.closed:
            return self.final_log[-n:]
        self.log.seek(0)
        return self.log.read()[-n:]

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            # Kept in memory and the file deleted now: a session-scoped server outlives the
            # temporary file's finalizer, which would leave the log in /tmp.
            self.log.seek(0)
            self.final_log = self.log.read()
            self.log.close()
        return self.proc.returncode


# What a server still holds: all zero once every request is finished and its KV freed.
BUSY_GAUGES = ("kv_used_tokens", "num_requests_running", "num_requests_waiting")


def read_metrics(url: str) -> dict[str, float]:
    """Unlabelled eagleserve_* samples of /metrics (labelled ones summed by name)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def spec_figures(url: str) -> dict[str, Any] | None:
    """The server's speculation since it started (None without any verify), from its /metrics
    (eagleserve/benchmark/stats.py `spec_figures`): tau (tokens committed per verify), the
    share of draft tokens accepted, and by draft depth the share of the iterations drafting that
    deep (adaptive; else of all verifies) whose draft there was accepted."""
    text = httpx.get(url + "/metrics", timeout=30).text
    fig = served_spec_figures({}, spec_counters(text))
    if fig is None:
        return None
    by_depth = fig["spec_acceptance_by_depth"]
    iterations = fig.get("spec_iterations_by_num_drafts", {})
    return {
        "tau": round(fig["spec_accept_length"], 3),
        "draft_acceptance": round(fig["spec_draft_acceptance_rate"], 3),
        "acceptance_by_depth": {d: round(a, 3) for d, a in enumerate(by_depth) if a is not None},
        "iterations_by_num_drafts": {int(k): n for k, n in iterations.items()},
    }


def wait_idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    """Polls /metrics until nothing runs, waits or holds KV (or the timeout); returns the last."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(url)
        busy = sum(m.get(f"eagleserve_{k}", 0) for k in BUSY_GAUGES)
        if busy == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.25)

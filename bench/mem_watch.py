"""Resident memory of a server's process tree, sampled while a benchmark loads it (Linux /proc).

A server that runs for days must not grow: `MemoryWatch` samples each process's anonymous
resident memory (RssAnon: the heap, torch's tensors on a CPU, Python's objects; not the model's
mapped file pages, which the kernel may drop and reread) every `period` seconds, and
`growth` fits a line to the samples after a warm-up share of the run (allocators, caches and
the prefix cache fill first), per process, in MiB per minute.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any


def _status_kib(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:  # the process is gone
        return None
    return None


def process_tree(root: int) -> list[int]:
    """`root` and its descendants, parents first."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def process_label(pid: int, root: int) -> str:
    """'server' for the root; a child by its name (multiprocessing children are `python`, so the
    command line's last word tells them apart) and pid."""
    if pid == root:
        return "server"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().rstrip(b"\0").split(b"\0")
        name = os.path.basename(words[0].decode()) if words else "?"
        tail = words[-1].decode()[-40:] if len(words) > 1 else ""
    except OSError:
        name, tail = "?", ""
    return f"{name} {pid} ({tail})" if tail else f"{name} {pid}"


def least_squares_slope(xs: list[float], ys: list[float]) -> float:
    """The slope of the least-squares line through (xs, ys); 0 for fewer than two distinct xs."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def each_minute(series: list[tuple[float, float]]) -> list[float]:
    """The first sample at or after each whole minute of (seconds, MiB) samples (the run's shape
    for the JSON: a spike, a plateau or a slope)."""
    out: list[float] = []
    for t, mib in series:
        if t >= 60 * len(out):
            out.append(round(mib, 1))
    return out


class MemoryWatch:
    """Samples RssAnon of `root`'s process tree in a daemon thread until `stop()`."""

    def __init__(self, root: int, period: float = 2.0) -> None:
        self.root, self.period = root, period
        self.samples: dict[str, list[tuple[float, float]]] = {}  # label -> (seconds, MiB)
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mem-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic() - self._t0
            for pid in process_tree(self.root):
                kib = _status_kib(pid, "RssAnon")
                if kib is not None:
                    label = process_label(pid, self.root)
                    self.samples.setdefault(label, []).append((t, kib / 1024))
            self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def growth(self, warmup_share: float = 0.25) -> dict[str, dict[str, Any]]:
        """Per process: MiB at the end of the warm-up share of the run, at its end and at each
        minute, the peak, and the least-squares slope in MiB per minute over the samples after
        warm-up."""
        out: dict[str, dict[str, Any]] = {}
        for label, series in self.samples.items():
            if len(series) < 2:
                continue
            t_end = series[-1][0]
            warm = [(t, m) for t, m in series if t >= warmup_share * t_end] or series[-2:]
            slope = least_squares_slope([t for t, _ in warm], [m for _, m in warm])
            out[label] = {
                "mib_after_warmup": round(warm[0][1], 1),
                "mib_end": round(series[-1][1], 1),
                "mib_peak": round(max(m for _, m in series), 1),
                "mib_per_min": round(60 * slope, 2),
                "mib_each_minute": each_minute(series),
                "samples": len(series),
                "minutes_measured": round((t_end - warm[0][0]) / 60, 2),
            }
        return out

"""Small helpers shared by the benchmark scripts: machine description, tables, JSON results."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def num_cpus() -> int:
    """CPUs this process may run on (what `nproc` prints)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def machine() -> str:
    """One line naming the machine: CPU model, usable cores, torch version and threads."""
    return (
        f"{cpu_model()}, {num_cpus()} cores (nproc), torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads"
    )


def machine_info() -> dict[str, Any]:
    return {
        "description": machine(),
        "cpu": cpu_model(),
        "nproc": num_cpus(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "load_average_1min": load_average(),
    }


def time_runs(fn: Callable[[], Any], repeats: int) -> tuple[list[float], Any]:
    """Wall seconds of `repeats` calls of `fn` (the last result is returned too)."""
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return times, result


def interleaved_rounds(
    rounds: int, outer: Sequence[str], inner: Sequence[str], run: Callable[[str, str], Any]
) -> dict[tuple[str, str], list[Any]]:
    """run(o, i) for every pair of outer x inner, `rounds` times, both orders reversed every
    other round (a shared machine's drift falls on every pair alike): each pair's results in
    round order."""
    runs: dict[tuple[str, str], list[Any]] = {}
    for rnd in range(rounds):
        step = 1 if rnd % 2 == 0 else -1
        for o in list(outer)[::step]:
            for i in list(inner)[::step]:
                runs.setdefault((o, i), []).append(run(o, i))
    return runs


def rotated(names: Sequence[str], r: int) -> list[str]:
    """Round r's order of `names`: rotated r places, so that over len(names) rounds every
    setting runs in every place once (a setting's place in a round moves its speed: after
    which other setting it runs, and where rounds or waves turn, twice in a row), each keeping
    its neighbours but at the wrap."""
    k = r % len(names)
    return list(names[k:]) + list(names[:k])


def against_baseline(
    runs: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """A setting's rounds (dicts with tok_s and tokens, tau where it speculated) against the
    baseline's from the same run: median tok/s, its ratio, and the requests whose tokens equal
    the baseline's first round, over every round."""
    tok_s = statistics.median(r["tok_s"] for r in runs)
    same = [a == b for r in runs for a, b in zip(r["tokens"], base[0]["tokens"], strict=True)]
    return dict(tok_s=tok_s, speedup=tok_s / statistics.median(r["tok_s"] for r in base),
                tok_s_rounds=[r["tok_s"] for r in runs], tau=runs[0].get("tau"),
                equal=sum(same), compared=len(same))  # fmt: skip


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.2f}"
        return str(v)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = [
        " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)),
        "-+-".join("-" * w for w in widths),
    ]
    lines += [" | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> None:
    if title:
        print(title)
    print(format_table(headers, rows))


def write_json(name: str, payload: dict[str, Any]) -> str:
    """Writes `payload` to bench/results/<name> (pretty-printed); returns the path."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, name)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=False)
        f.write("\n")
    return path

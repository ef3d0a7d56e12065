"""Every benchmark script imports: a published figure must be re-runnable from its script, and
an import that broke when a helper moved (bench/accept_gap.py's `chat_ids`) is found here, not
when a session needs the figure."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Scripts for a tool the CPU suite does not install (built by `make bench-llamacpp`).
OPTIONAL = {"llama_cpp"}

# One process for all of them: some set OpenMP's environment at import, for the engine they
# start; that must not reach this test process.
PROBE = """
import importlib, json, sys
failed = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module("bench." + name)
    except ModuleNotFoundError as e:
        failed[name] = ["missing", e.name]
    except Exception as e:
        failed[name] = ["error", repr(e)]
print(json.dumps(failed))
"""


def test_every_bench_script_imports() -> None:
    names = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "bench", "*.py")))
    assert "accept_gap" in names and "adaptive_replay" in names
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *names], cwd=ROOT, capture_output=True, text=True,
        timeout=300, env={**os.environ, "PYTHONPATH": ROOT},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    failed = json.loads(out.stdout.strip().splitlines()[-1])
    broken = {n: f for n, f in failed.items() if not (f[0] == "missing" and f[1] in OPTIONAL)}
    assert not broken, broken

"""Every benchmark script imports: a published figure must be re-runnable from its script, and
an import that broke when a helper moved (bench/accept_gap.py's `chat_ids`) is found here, not
when a session needs the figure."""

from __future__ import annotations

import glob
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

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


# A root that holds a fixed heap, and its child whose heap grows by `step` MiB every 0.1 s.
GROWER = """
import subprocess, sys, time
role, held, step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
heap = [bytearray(held * 2**20)]
if role == "root":
    subprocess.Popen([sys.executable, "-c", sys.argv[4], "grow", "1", str(step)])
while True:
    if role == "grow":
        heap.append(bytearray(step * 2**20))
    for chunk in heap[-1:]:
        chunk[::4096] = b"x" * len(chunk[::4096])  # touched: resident
    time.sleep(0.1)
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_memory_watch_finds_the_process_that_grows() -> None:
    """bench/load.py's leak check: the growing process is found under the root (its child), and
    its slope is its growth rate; the root, whose heap stays, reads flat."""
    sys.path.insert(0, ROOT)
    from bench.mem_watch import MemoryWatch, process_tree

    rng = random.Random()
    held, step = rng.randint(20, 40), rng.randint(2, 4)
    root = subprocess.Popen([sys.executable, "-c", GROWER, "root", str(held), str(step), GROWER])
    try:
        time.sleep(0.5)
        watch = MemoryWatch(root.pid, period=0.1)
        time.sleep(2.5)
        watch.stop()
    finally:
        for pid in process_tree(root.pid)[::-1]:
            os.kill(pid, signal.SIGKILL)
        root.wait()
    growth = watch.growth(warmup_share=0.2)
    assert growth["server"]["mib_per_min"] == pytest.approx(0, abs=3)
    assert growth["server"]["mib_end"] >= held
    (child,) = [m for label, m in growth.items() if label != "server"]
    # At most 10 steps a second (fewer where the machine is busy).
    assert 0.5 * 600 * step < child["mib_per_min"] < 1.1 * 600 * step, child


def test_load_counts_a_conversation_that_outgrows_the_context_apart_from_errors() -> None:
    """bench/load.py: a 400 for the context, to any turn of a conversation (the first too: its
    system prompt and template are not in the mix's sizing), ends the conversation and is no
    server error; the same 400 to a single request is one."""
    import httpx

    sys.path.insert(0, ROOT)
    from bench.load import finish_plain
    from bench.load_mix import Job

    rng = random.Random()
    prompt, n = rng.randint(400, 500), rng.randint(64, 96)
    body = {"error": {"message": f"the prompt has {prompt} and max_tokens is {n}",
                      "code": "context_length_exceeded"}}  # fmt: skip
    resp = httpx.Response(400, json=body)
    system = [{"role": "system", "content": "Be brief."}]
    first_turn = Job(kind="chat", stream=False, greedy=True, prompt="hi", max_tokens=n)
    first_turn.history = system
    later_turn = Job(kind="chat", stream=False, greedy=True, prompt="and?", max_tokens=n)
    later_turn.history = [*system, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "hello"}]  # fmt: skip
    single = Job(kind="chat", stream=False, greedy=True, prompt="hi", max_tokens=n)
    assert finish_plain(first_turn, resp).status == "context_full"
    assert finish_plain(later_turn, resp).status == "context_full"
    assert finish_plain(single, resp).status == "error"

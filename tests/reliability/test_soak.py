"""bench/soak.py: closed-loop clients through one engine with speculation and a pool that
forces retraction; every greedy and seeded answer equals its run alone, nothing leaks."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

from rel_fixtures import REPO, tiny_dirs_fixture  # noqa: F401 (fixture)


def test_soak_with_spec_and_a_small_pool(tiny_dirs: tuple[str, str], tmp_path: os.PathLike) -> None:
    target, head = tiny_dirs
    out = os.path.join(tmp_path, "soak.json")
    cmd = [sys.executable, os.path.join(REPO, "bench", "soak.py"), "--steps", "500",
           "--clients", "5", "--mix-seed", str(random.randrange(1 << 20)), "--model", target,
           "--dtype", "float32", "--device", "cpu", "--max-total-tokens", "300",
           "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", head,
           "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
           "--speculative-num-draft-tokens", "4", "--out", out]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert os.path.exists(out), proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        s = json.load(f)["summary"]
    detail = json.dumps(s, indent=1)[:4000]
    assert proc.returncode == 0 and s["ok"], detail
    assert s["inexact"] == 0 and s["kv_used_tokens_end"] == 0, detail
    assert s["checked_greedy"] > 10 and s["checked_seeded"] > 0, detail
    assert s["hung_up"] > 0 and s["retracted"] > 0, detail  # aborts and retraction exercised

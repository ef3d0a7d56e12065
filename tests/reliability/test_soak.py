"""bench/soak.py: closed-loop clients through one engine with speculation and a pool that
forces retraction; every greedy and seeded answer equals its run alone, nothing leaks."""

from __future__ import annotations

import os
import random

import pytest
from rel_fixtures import run_bench, tiny_dirs_fixture  # noqa: F401 (fixture)

# Single requests; chat conversations re-sending their history (prefix cache hits) in chunks of
# 16 tokens, so that part-way prefills meet a full pool too. The multi-turn mix's 8 clients and
# one hang-up in 5 make a retraction and a hang-up near certain in every draw (mix seeds 1-10:
# 4-8 retractions, 2-23 hang-ups; with 6 clients and one in 10, some seeds had none).
MIXES = {
    "requests": ["--steps", "500", "--clients", "5", "--max-total-tokens", "300"],
    "multi-turn": ["--multi-turn", "--turns", "3", "--chunked-prefill-size", "16", "--steps",
                   "800", "--clients", "8", "--disconnect-share", "0.2",
                   "--max-total-tokens", "256"],
}  # fmt: skip


@pytest.mark.parametrize("mix", MIXES)
def test_soak_with_spec_and_a_small_pool(
    tiny_dirs: tuple[str, str], tmp_path: os.PathLike, mix: str
) -> None:
    target, head = tiny_dirs
    args = [*MIXES[mix], "--mix-seed", str(random.randrange(1 << 20)), "--model", target,
            "--dtype", "float32", "--device", "cpu", "--speculative-algorithm", "EAGLE",
            "--speculative-draft-model-path", head, "--speculative-num-steps", "3",
            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
            "--structured-share", "0.2"]  # fmt: skip
    rc, s, detail = run_bench("soak.py", args, os.path.join(tmp_path, "soak.json"))
    assert rc == 0 and s["ok"], detail
    assert s["inexact"] == 0 and s["kv_used_tokens_end"] == 0, detail
    assert s["checked_greedy"] > 10 and s["checked_seeded"] > 0, detail
    assert s["checked_structured"] > 0, detail  # JSON, schemas, regexes, tools: grammar masks
    assert s["hung_up"] > 0 and s["retracted"] > 0, detail  # aborts and retraction exercised

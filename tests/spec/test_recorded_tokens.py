"""Greedy token ids of the default deployment, recorded before the forward-contract refactor.

The served SmolLM2 (packed int4, as `make serve` runs it) with the shipped EAGLE3 head: target-only
and speculative (chain and tree), overlap scheduler off and on. A change to how a batch reaches the
model must not change a single token; tests/data/smollm2_greedy_ids.json holds the ids the tree
produced when it was recorded (regenerate with `python tests/spec/test_recorded_tokens.py`, only
when a change is *meant* to alter numerics, and say why in the commit).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from eagleserve import Engine, SamplingParams

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "smollm2_greedy_ids.json")
PROMPTS = [
    "Write a haiku about autumn.",
    "def is_prime(n):",
    "Explain in two sentences why the sea is salty.",
    "List the planets of the solar system.",
]
MAX_NEW = [40, 32, 24, 40]
HEAD = dict(
    speculative_algorithm="EAGLE3", speculative_draft_model_path="builtin:smollm2-135m-eagle"
)
CONFIGS: dict[str, dict[str, Any]] = {
    "target": {},
    "target_overlap": dict(disable_overlap_schedule=False),
    "chain3": dict(
        HEAD, speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4
    ),
    "chain3_overlap": dict(
        HEAD,
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
        disable_overlap_schedule=False,
    ),
    "tree": dict(
        HEAD, speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6
    ),
    # Adaptive speculation (added after the recording; the ids must not change either).
    "adaptive_chain3": dict(
        HEAD,
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
        speculative_adaptive=True,
        speculative_adaptive_probe_interval=4,
    ),
    "adaptive_tree_overlap": dict(
        HEAD,
        speculative_num_steps=3,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=6,
        speculative_adaptive=True,
        speculative_adaptive_probe_interval=4,
        disable_overlap_schedule=False,
    ),
}


def generate(model: str, config: dict[str, Any]) -> list[list[int]]:
    eng = Engine(model=model, device="cpu", max_total_tokens=2048, max_running_requests=4, **config)
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_NEW]
    out = eng.generate(PROMPTS, params)
    return [o["token_ids"] for o in out]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_ids_equal_the_recorded_ones(smollm2_dir: str, name: str) -> None:
    with open(DATA) as f:
        recorded = json.load(f)
    assert generate(smollm2_dir, CONFIGS[name]) == recorded["ids"]


if __name__ == "__main__":
    from eagleserve.models.loader import resolve_model_path

    model = resolve_model_path("default")
    runs = {name: generate(model, cfg) for name, cfg in CONFIGS.items()}
    first = runs["target"]
    for name, ids in runs.items():
        print(name, "equal to target-only" if ids == first else "DIFFERS from target-only")
    with open(DATA, "w") as f:
        json.dump({"prompts": PROMPTS, "max_new_tokens": MAX_NEW, "ids": first}, f)

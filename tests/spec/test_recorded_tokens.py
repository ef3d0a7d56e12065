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
import torch
from conftest import SERVED_MIN_PATH_PROB
from lossless_fixtures import script_choices

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


def cut_engine(model: str, name: str) -> Engine:
    """CONFIGS[name] with --speculative-min-path-prob at the server's default."""
    assert SERVED_MIN_PATH_PROB > 0  # the served default (the suite's own is 0: conftest.py)
    return Engine(model=model, device="cpu", max_total_tokens=2048, max_running_requests=4,
                  **CONFIGS[name], speculative_min_path_prob=SERVED_MIN_PATH_PROB)  # fmt: skip


@pytest.mark.parametrize("name", ["chain3", "chain3_overlap", "adaptive_chain3"])
def test_chains_cut_short_by_their_path_probability_commit_the_recorded_ids(
    smollm2_dir: str, name: str
) -> None:
    """--speculative-min-path-prob at the server's default: the shipped head is sure of some
    drafts and unsure of others, so a 3-chain stops short on some iterations and not on others
    (both are counted), and every committed id is still the recorded one. The adaptive
    controller prices each iteration as the depth it drafted, not the one it planned."""
    with open(DATA) as f:
        recorded = json.load(f)
    adaptive = name.startswith("adaptive")
    eng = cut_engine(smollm2_dir, name)
    if adaptive:  # plans of every depth (the timed controller may plan 3 throughout)
        script_choices(eng, [3, 2, 3, 1, 2])
    worker = eng.scheduler.worker
    drafted: list[int] = []  # per drafting iteration: its drafts, and its requests
    rows: list[int] = []
    draft = worker.drafter.draft

    planned: list[int] = []

    def counted(batch, info, num_steps, *args, **kwargs):  # noqa: ANN001, ANN202
        tree = draft(batch, info, num_steps, *args, **kwargs)
        drafted.append(tree.draft_tokens.shape[1] - 1)  # the bonus token, then the drafts
        rows.append(batch.batch_size)
        planned.append(num_steps)
        return tree

    worker.drafter.draft = counted
    observed: list[int] = []
    chains: list[tuple[int, int, bool, list[int]]] = []
    if adaptive:
        observe, observe_chain = worker.controller.observe, worker.controller.observe_chain

        def recorded_k(bs, k, seconds, resumed=False):  # noqa: ANN001, ANN202
            if k:
                observed.append(k)
            observe(bs, k, seconds, resumed)

        def recorded_chain(bs, k, goes_on, accepted):  # noqa: ANN001, ANN202
            chains.append((bs, k, goes_on, list(accepted)))
            observe_chain(bs, k, goes_on, accepted)

        worker.controller.observe = recorded_k
        worker.controller.observe_chain = recorded_chain
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_NEW]
    out = eng.generate(PROMPTS, params)
    assert [o["token_ids"] for o in out] == recorded["ids"]
    per_k = eng.stats().spec_iterations_per_num_drafts
    assert sum(per_k[1:3]) > 0 and per_k[3] > 0, per_k  # cut short, and whole
    # The stats count each request's iterations by the drafts it verified (with overlap a
    # finished request's last launched iteration runs, uncounted).
    by_k = [sum(b for k, b in zip(drafted, rows) if k == d) for d in (1, 2, 3)]
    if name.endswith("overlap"):
        assert all(a >= b for a, b in zip(by_k, per_k[1:], strict=True)), (by_k, per_k)
    else:
        assert by_k == per_k[1:]
    if adaptive:
        assert observed == drafted
        # Every chain also teaches the controller how far chains get and what they yield there
        # (spec/chain_cut.py): a chain cut short was one whose path was no longer likely, and
        # its requests' accepted drafts are what the stats count.
        assert [(bs, k) for bs, k, _, _ in chains] == list(zip(rows, drafted, strict=True))
        assert all(not on for (_, k, on, _), p in zip(chains, planned) if k < p)
        assert any(on for (_, k, on, _), p in zip(chains, planned) if k == p < 3)
        assert all(len(acc) == bs and all(0 <= a <= k for a in acc) for bs, k, _, acc in chains)
        committed = sum(a + 1 for *_, acc in chains for a in acc)
        assert committed == eng.stats().spec_accepted_tokens_total
        assert any(r < 1.0 for cut in worker.controller.cuts.values() for r in cut.reach)


def test_a_chain_cut_short_draws_the_target_only_seeded_tokens(smollm2_dir: str) -> None:
    """Sampled with a seed, a cut chain commits the tokens target-only draws (fresh seeds)."""
    seeds = torch.randint(0, 2**31, (len(PROMPTS),)).tolist()
    params = [SamplingParams(max_new_tokens=n, temperature=0.8, top_p=0.95, seed=seed,
                             ignore_eos=True) for n, seed in zip(MAX_NEW, seeds)]  # fmt: skip
    eng = cut_engine(smollm2_dir, "chain3")
    got = [o["token_ids"] for o in eng.generate(PROMPTS, params)]
    target = Engine(model=smollm2_dir, device="cpu", max_total_tokens=2048, max_running_requests=4)
    assert got == [o["token_ids"] for o in target.generate(PROMPTS, params)]
    assert sum(eng.stats().spec_iterations_per_num_drafts[1:3]) > 0  # some chains were cut


if __name__ == "__main__":
    from eagleserve.models.loader import resolve_model_path

    model = resolve_model_path("default")
    runs = {name: generate(model, cfg) for name, cfg in CONFIGS.items()}
    first = runs["target"]
    for name, ids in runs.items():
        print(name, "equal to target-only" if ids == first else "DIFFERS from target-only")
    with open(DATA, "w") as f:
        json.dump({"prompts": PROMPTS, "max_new_tokens": MAX_NEW, "ids": first}, f)

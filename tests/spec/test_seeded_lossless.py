"""Seeded sampled output is the target's own, token for token: with speculation (chain, tree,
adaptive chain lengths, overlap or not) a seeded request emits exactly what target-only
decoding emits with the same seed, as greedy output does (sampling/seeded_noise.py). The
target, heads and prompts are test_eagle_lossless.py's (lossless_fixtures.py)."""

from __future__ import annotations

import copy
import random

import pytest
from lossless_fixtures import heads, prompts, run_staggered, script_choices, target_dir

from eagleserve import Engine, SamplingParams

__all__ = ["heads", "target_dir"]  # module-scoped fixtures of lossless_fixtures


def sampled_params(rng: random.Random) -> list[SamplingParams]:
    """Fresh seeds near the top of their range too, mixed filters, one greedy row."""
    out = []
    for i, n in enumerate([30, 7, 24, 12, 18, 3, 30, 15]):
        p = SamplingParams(
            max_new_tokens=n,
            temperature=0.0 if i == 3 else rng.uniform(0.6, 1.3),
            top_p=1.0 if i % 2 else rng.uniform(0.7, 0.95),
            top_k=-1 if i % 3 else rng.randint(3, 20),
            seed=rng.randrange(2**63) if i % 4 else rng.randrange(2**20),
            ignore_eos=i in (0, 6),
        )
        out.append(p)
    return out


def engine(
    target_dir: str, head: str | None, overlap: bool, tree: bool, adaptive: bool, kv: int = 2048
) -> Engine:
    spec: dict[str, object] = {}
    if head is not None:
        spec = dict(
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=head,
            speculative_num_steps=3,
            speculative_eagle_topk=2 if tree else 1,
            speculative_num_draft_tokens=6 if tree else 4,
            speculative_adaptive=adaptive,
        )
    return Engine(
        model=target_dir,
        device="cpu",
        max_total_tokens=kv,
        max_running_requests=8,
        disable_overlap_schedule=not overlap,
        **spec,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def case(target_dir: str) -> tuple[list[list[int]], list[SamplingParams], list[list[int]]]:
    """Prompts, params with fresh seeds, and the target-only tokens they give."""
    rng = random.Random()
    ps, sp = prompts(rng.randrange(1000)), sampled_params(rng)
    return ps, sp, run_staggered(engine(target_dir, None, False, False, False), ps, sp)


@pytest.mark.parametrize(
    ("overlap", "tree", "adaptive"),
    [(False, False, False), (True, False, False), (False, True, False), (True, False, True)],
    ids=["chain", "chain-overlap", "tree", "adaptive-overlap"],
)
def test_seeded_speculation_emits_the_target_only_tokens(
    target_dir: str, heads: dict[str, str], case, overlap: bool, tree: bool, adaptive: bool
) -> None:
    ps, sp, expected = case
    eng = engine(target_dir, heads["EAGLE"], overlap, tree, adaptive)
    if adaptive:  # every chain length, stretches without drafting, catch-ups
        script_choices(eng, [random.choice([0, 1, 2, 3]) for _ in range(17)])
    assert run_staggered(eng, ps, sp) == expected
    stats = eng.scheduler.spec_stats
    assert stats.accepted_tokens > 0  # drafts were accepted, not only rejected


def test_seeded_tokens_do_not_depend_on_the_batch(target_dir: str, heads, case) -> None:
    """A request alone gives the tokens it gives among the others."""
    ps, sp, expected = case
    eng = engine(target_dir, heads["EAGLE"], False, False, False)
    alone = [eng.generate([p], [s])[0]["token_ids"] for p, s in zip(ps[:3], sp[:3])]
    assert alone == expected[:3]


@pytest.mark.parametrize("speculate", [False, True], ids=["target-only", "chain"])
def test_a_retracted_seeded_request_keeps_its_tokens(
    target_dir: str, heads: dict[str, str], case, speculate: bool
) -> None:
    """Out of KV slots, requests are retracted and recomputed: their seeded tokens stay those
    of a run that had room. Every request runs to its max_new_tokens, so the 8 need about
    2.5 times the 100 slots (an early EOS could leave room and nothing to retract; with 130
    slots about 1 draw in 25 of the staggered requests, chained, never ran out)."""
    ps, sp, _ = case
    sp = [copy.copy(p) for p in sp]
    for p in sp:
        p.ignore_eos = True
    expected = run_staggered(engine(target_dir, None, False, False, False), ps, sp)
    eng = engine(target_dir, heads["EAGLE"] if speculate else None, False, False, False, kv=100)
    assert run_staggered(eng, ps, sp) == expected
    assert eng.stats().num_retracted_total > 0

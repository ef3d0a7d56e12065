"""Speculative greedy output equals target-only greedy output, token for token.

The target is a tiny random Llama whose attention and MLP outputs are scaled down, so its next
token depends mostly (not only) on the current one; an EAGLE-1 head whose fc passes the token
embedding through then predicts it well, which exercises long accepted runs, partial acceptance
and rejection. EAGLE-3 heads are random (mostly rejections) and use a reduced draft vocabulary.
"""

from __future__ import annotations

import pytest
from lossless_fixtures import heads, params, prompts, reference, run_staggered, target_dir

from eagleserve import Engine

__all__ = ["heads", "reference", "target_dir"]  # module-scoped fixtures of lossless_fixtures


def test_overlap_target_only_matches(target_dir: str, reference: list[list[int]]) -> None:
    eng = Engine(model=target_dir, device="cpu", max_total_tokens=2048, max_running_requests=8,
                 disable_overlap_schedule=False)  # fmt: skip
    assert eng.scheduler.enable_overlap
    assert run_staggered(eng, prompts(0), params()) == reference


CASES = [
    # (head, num_steps, topk, num_draft_tokens)
    ("EAGLE", 1, 1, 2),
    ("EAGLE", 2, 1, 3),
    ("EAGLE", 3, 1, 4),
    ("EAGLE", 4, 1, 5),
    ("EAGLE", 5, 1, 6),
    ("EAGLE", 2, 2, 3),
    ("EAGLE", 3, 2, 6),
    ("EAGLE", 4, 3, 8),
    ("EAGLE", 5, 4, 12),
    ("EAGLE", 3, 4, 16),
    ("EAGLE", 2, 3, 4),
    ("EAGLE-random", 3, 1, 4),
    ("EAGLE-random", 3, 2, 5),
    ("EAGLE3", 1, 1, 2),
    ("EAGLE3", 4, 1, 5),
    ("EAGLE3", 3, 2, 6),
    ("EAGLE3", 2, 4, 8),
    ("EAGLE3-2layers", 3, 1, 4),
    ("EAGLE3-2layers", 3, 2, 6),
]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize(("head", "steps", "topk", "ndt"), CASES)
def test_greedy_lossless(
    target_dir: str,
    heads: dict[str, str],
    reference: list[list[int]],
    head: str,
    steps: int,
    topk: int,
    ndt: int,
    overlap: bool,
) -> None:
    algo = "EAGLE3" if head.startswith("EAGLE3") else "EAGLE"
    eng = Engine(
        model=target_dir,
        device="cpu",
        max_total_tokens=2048,
        max_running_requests=8,
        disable_overlap_schedule=not overlap,
        speculative_algorithm=algo,
        speculative_draft_model_path=heads[head],
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=ndt,
    )
    got = run_staggered(eng, prompts(0), params())
    for i, (g, r) in enumerate(zip(got, reference)):
        first = next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
        assert g == r, f"request {i}: first mismatch at token {first}"
    stats = eng.stats()
    assert stats.spec_verify_calls_total > 0
    if head == "EAGLE":
        # The crafted head must actually get drafts accepted, or this test proves little.
        assert stats.spec_accepted_tokens_total / stats.spec_verify_calls_total > 1.5


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize(("spec", "topk", "ndt"), [(None, 1, 1), ("EAGLE", 1, 4), ("EAGLE", 2, 6)])
def test_small_kv_pool_waits_and_retracts(
    target_dir: str,
    heads: dict[str, str],
    reference: list[list[int]],
    overlap: bool,
    spec: str | None,
    topk: int,
    ndt: int,
) -> None:
    """A pool far below the total demand: requests wait or get retracted, tokens stay exact."""
    kwargs = {}
    if spec:
        kwargs = dict(
            speculative_algorithm=spec,
            speculative_draft_model_path=heads["EAGLE"],
            speculative_num_steps=3,
            speculative_eagle_topk=topk,
            speculative_num_draft_tokens=ndt,
        )
    eng = Engine(
        model=target_dir,
        device="cpu",
        max_total_tokens=130,
        max_running_requests=8,
        disable_overlap_schedule=not overlap,
        **kwargs,
    )
    got = run_staggered(eng, prompts(0), params())
    assert got == reference
    assert eng.stats().num_retracted_total > 0, "the pool was meant to force retraction"

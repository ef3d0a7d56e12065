"""Adaptive speculation (spec/adaptive.py) keeps greedy output the target's own: every chain
length the controller picks, stretches without drafting (the head's inputs held, then caught
up), retraction, the overlap scheduler's waits, and the head KV left behind. The target, heads
and reference are test_eagle_lossless.py's (lossless_fixtures.py)."""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any

import pytest
import torch
from lossless_fixtures import (
    heads,
    params,
    prompts,
    reference,
    run_staggered,
    script_choices,
    target_dir,
)

from eagleserve import Engine, SamplingParams
from eagleserve.core import ScheduleBatch
from eagleserve.messages import GenerateReqInput

__all__ = ["heads", "reference", "target_dir"]  # module-scoped fixtures of lossless_fixtures


def adaptive_engine(
    target_dir: str, head_dir: str, overlap: bool, tree: bool = False, **kw: object
) -> Engine:
    return Engine(
        model=target_dir,
        device="cpu",
        max_total_tokens=kw.pop("max_total_tokens", 2048),  # type: ignore[arg-type]
        max_running_requests=8,
        disable_overlap_schedule=not overlap,
        speculative_algorithm=kw.pop("speculative_algorithm", "EAGLE"),
        speculative_draft_model_path=head_dir,
        speculative_num_steps=3,
        speculative_eagle_topk=2 if tree else 1,
        speculative_num_draft_tokens=6 if tree else 4,
        speculative_adaptive=True,
        speculative_adaptive_probe_interval=kw.pop("speculative_adaptive_probe_interval", 8),
        **kw,
    )


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize(
    ("head", "tree"), [("EAGLE", False), ("EAGLE-random", False), ("EAGLE", True)]
)
def test_adaptive_greedy_lossless(
    target_dir: str,
    heads: dict[str, str],
    reference: list[list[int]],
    head: str,
    tree: bool,
    overlap: bool,
) -> None:
    # A 4-pair ring of held head inputs: the stretch of six k = 0 iterations flushes it.
    scripted = adaptive_engine(
        target_dir, heads[head], overlap, tree, speculative_adaptive_probe_interval=4
    )
    cycle = (
        [0, 0, 3, 0, 3, 3, 0, 0, 0, 0, 0, 0, 3]
        if tree
        else [0, 0, 3, 1, 0, 0, 0, 0, 0, 0, 2, 3, 0, 1]
    )
    script_choices(scripted, cycle)
    drafter = scripted.scheduler.worker.drafter
    flushes = []
    flush = drafter.flush
    drafter.flush = lambda batch, rows: (flushes.append(rows), flush(batch, rows))[1]
    assert run_staggered(scripted, prompts(0), params()) == reference
    hist = scripted.stats().spec_iterations_per_num_drafts
    assert all(hist[k] > 0 for k in set(cycle)), hist  # every k, 0 included, really ran
    assert flushes  # ...and full rings were flushed
    real = adaptive_engine(target_dir, heads[head], overlap, tree)
    assert run_staggered(real, prompts(0), params()) == reference


def test_overlap_waits_only_after_a_verify(
    target_dir: str, heads: dict[str, str], reference: list[list[int]]
) -> None:
    """With overlap, a launch waits for the forward before it to publish its lengths only when
    that forward verified drafts: after a decode without drafts the host knows them."""
    eng = adaptive_engine(target_dir, heads["EAGLE"], True)
    script_choices(eng, [0, 0, 0, 2])
    fmap, forwarder = eng.scheduler.future_map, eng.scheduler.forwarder
    assert fmap is not None and forwarder is not None
    waits: list[int] = []
    drafts: list[int | None] = []
    wait, launch = fmap.wait_published, forwarder.launch

    def counted_wait(*args: Any, **kwargs: Any) -> None:
        waits.append(1)
        wait(*args, **kwargs)

    def recorded_launch(batch: ScheduleBatch) -> Any:
        drafts.append(batch.num_drafts)  # set by plan_launch before the launch
        return launch(batch)

    fmap.wait_published = counted_wait  # type: ignore[method-assign]
    forwarder.launch = recorded_launch  # type: ignore[method-assign]
    assert run_staggered(eng, prompts(0), params()) == reference
    verifies = sum(1 for k in drafts if k)
    assert drafts.count(0) > 2 * verifies > 0, drafts
    assert 0 < len(waits) <= verifies, (len(waits), drafts)


def test_adaptive_retraction_keeps_tokens(
    target_dir: str, heads: dict[str, str], reference: list[list[int]]
) -> None:
    eng = adaptive_engine(target_dir, heads["EAGLE"], True, max_total_tokens=130)
    script_choices(eng, [0, 0, 0, 2, 0, 3])
    assert run_staggered(eng, prompts(0), params()) == reference
    assert eng.stats().num_retracted_total > 0


def test_adaptive_controller_follows_acceptance(target_dir: str, heads: dict[str, str]) -> None:
    """On an injected cost model: a random head (acceptance near 0) against drafts that cost
    a third of a decode each gets k = 0; the crafted head (acceptance near 1) against nearly
    free drafts gets the longest chain."""
    chosen = {}
    for head, per_draft in (("EAGLE-random", 0.35), ("EAGLE", 0.02)):
        eng = adaptive_engine(target_dir, heads[head], False)
        costs = eng.scheduler.worker.controller.costs
        for key in costs.seconds:
            costs.seconds[key] = 1.0 + per_draft * key[1]
        costs.observe = lambda *a, **kw: None  # type: ignore[method-assign]
        eng.generate(prompts(1), SamplingParams(max_new_tokens=40, temperature=0.0))
        chosen[head] = eng.stats().spec_iterations_per_num_drafts
    rand, good = chosen["EAGLE-random"], chosen["EAGLE"]
    assert rand[0] > 3 * sum(rand[1:]), rand
    assert good[3] > 3 * sum(good[:3]), good


def test_acceptance_starts_from_the_heads_training_log(
    target_dir: str, heads: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A head trained by `eagleserve train-draft` carries its held-out accuracy by depth: the
    engine's acceptance starts there, not at a made-up prior, and a new request's estimate
    starts from it."""
    head = str(tmp_path_factory.mktemp("logged_head") / "head")
    shutil.copytree(heads["EAGLE-random"], head)
    rng = random.Random()
    accs = [round(rng.uniform(0.05, 0.6), 4) for _ in range(2)]  # fewer depths than steps
    log = {"val_accuracy_by_depth": {f"acc{d}": a for d, a in enumerate(accs)}}
    with open(os.path.join(head, "training_log.json"), "w") as f:
        json.dump(log, f)
    eng = adaptive_engine(target_dir, head, False)
    assert eng.stats().spec_acceptance_ema == pytest.approx([*accs, accs[-1]])
    plain = adaptive_engine(target_dir, heads["EAGLE-random"], False)
    assert plain.stats().spec_acceptance_ema == [0.5] * 3


def head_kv(engine: Engine, req_pool_idx: int, length: int) -> torch.Tensor:
    """Every layer's head K and V at the request's first `length` positions."""
    pool = engine.scheduler.worker.drafter.kv_pool
    slots = engine.scheduler.req_to_token_pool.req_to_token[req_pool_idx, :length]
    return torch.stack([b[slots] for b in (*pool.k_buffer, *pool.v_buffer)])


@pytest.mark.parametrize("head", ["EAGLE-random", "EAGLE3-2layers"])
@pytest.mark.parametrize(
    "without", [0, 5, 11], ids=["draft-after-prefill", "catch-up", "flushed-rings"]
)
def test_head_kv_after_a_stretch_without_drafting(
    target_dir: str, heads: dict[str, str], without: int, head: str
) -> None:
    """After k = 0 iterations and the catch-up, the head's KV equals that of a run that ran the
    head after every token (here: a fixed 1-chain), position by position; also where the
    stretch outlasts the ring of held inputs (4 here), which is flushed twice on the way, and
    where the first decode drafts (the prompt's last row, held by the prefill, caught up). A
    head of two layers too: there each held row's layer-1 K/V read layer 0's attention over
    the rows before it."""
    prompt = prompts(3)[3]
    algorithm = "EAGLE3" if head.startswith("EAGLE3") else "EAGLE"
    runs = {}
    for name in ("lagged", "always"):
        eng = (
            adaptive_engine(target_dir, heads[head], False, speculative_algorithm=algorithm,
                            speculative_adaptive_probe_interval=4 if without > 8 else 8)
            if name == "lagged"
            else Engine(model=target_dir, device="cpu", max_total_tokens=2048,
                        max_running_requests=8, speculative_algorithm=algorithm,
                        speculative_draft_model_path=heads[head],
                        speculative_num_steps=1, speculative_eagle_topk=1,
                        speculative_num_draft_tokens=2)
        )  # fmt: skip
        if name == "lagged":
            script_choices(eng, [0] * without + [1])
        sched = eng.scheduler
        sched.add_request(
            GenerateReqInput("r", prompt, SamplingParams(max_new_tokens=30, temperature=0.0))
        )
        for _ in range(without + 2):  # prefill, the stretch, and the decode that catches up
            sched.step()
        req = sched.running_batch.reqs[0]
        runs[name] = (eng, req.req_pool_idx, req.kv_committed_len)
    n = min(length for _, _, length in runs.values())
    assert n > len(prompt) + without
    lagged, always = (head_kv(e, idx, n) for e, idx, _ in runs.values())
    torch.testing.assert_close(lagged, always, atol=1e-5, rtol=1e-5)
    for eng, _, _ in runs.values():
        for rid in ("r",):
            eng.scheduler.abort_request(rid)
        while eng.scheduler.has_work():
            eng.scheduler.step()

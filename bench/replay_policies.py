"""The policies bench/adaptive_replay.py replays on measured acceptance traces and step costs:
fixed chains, the head's-confidence gates, and spec/adaptive.py's controller fed as the worker
and the scheduler feed it. Pure functions of the traces: no engine, no timing."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from eagleserve.spec.adaptive import (
    AdaptiveController,
    choose_num_drafts,
    depth_choices,
    record_verify,
    request_acceptance,
    update_acceptance,
)
from eagleserve.spec.cost_table import CostTable

DEPTH = 3
# `gated F/C` policies: the first draft's least probability, the path's to draft on from it.
GATES = ((0.25, 0.5), (0.35, 0.5), (0.35, 0.65))


def gated_depth(probs: list[float], first: float, path: float) -> int:
    """The drafts a confidence gate makes from the head's probabilities of a chain's drafts
    (`probs`, depth 1 first): none where the first is below `first`, else one more draft for
    as long as the product of those made so far is at least `path`."""
    if probs[0] < first:
        return 0
    k, made = 1, probs[0]
    for p in probs[1:]:
        if made < path:
            break
        k, made = k + 1, made * p
    return k


def replay(
    traces: list[list[int]],
    step_ms: dict[int, float],
    resume_ms: float,
    fixed: int | None = None,
    prices: CostTable | None = None,
    prior: list[float] | None = None,
    learns: bool = True,
    gate: tuple[float, float, list[list[list[float]]], float] | None = None,
    head_probs: tuple[list[list[list[float]]], float] | None = None,
    cut: tuple[float, list[list[list[float]]]] | None = None,
    cut_priced: bool = True,
) -> dict[str, Any]:
    """Batch 1, the traces' requests in turn; a fixed depth, the depth `gate` (its two
    thresholds, each trace's per-position draft probabilities, a head step's ms) allows, or the
    controller priced by `prices` and (`learns`: a CPU worker's) refining them online from
    serving's costs. `head_probs` (each trace's per-position draft probabilities, a head
    step's ms): the controller's choice with the first draft's probability as its depth-1
    acceptance, the head extended at k = 0 too. `cut` (a --speculative-min-path-prob and each
    trace's per-position draft probabilities): a fixed or chosen chain stops where the drafts'
    path probability falls below it (spec/draft_tree.py), priced and judged at the depth
    drafted, as a CPU serves since chains are cut; the controller prices a planned depth by
    how far its chains go and how often what they drafted is accepted (spec/chain_cut.py;
    `cut_priced`, as served since then) or as a whole chain."""
    engine_rate = list(prior or [])
    judged = [0] * DEPTH
    ctl = None
    if fixed is None and gate is None:
        assert prices is not None
        ctl = AdaptiveController(prices, depth_choices(DEPTH, True), probe_interval=64)
    ms = tokens = verifies = accepted_total = 0.0
    per_k = [0] * (DEPTH + 1)
    for n, trace in enumerate(traces):
        hits, trials = [0.0] * DEPTH, [0.0] * DEPTH
        q, held = 0, 1  # the prefill holds the prompt's last row
        while q < len(trace):
            if gate is not None:
                k = gated_depth(gate[2][n][q], gate[0], gate[1])
            elif head_probs is not None and ctl is not None:
                alphas = request_acceptance(hits, trials, engine_rate)
                alphas[0] = head_probs[0][n][q][0]
                k = choose_num_drafts([alphas], ctl.costs, ctl.choices)
            elif ctl is None:
                k = fixed or 0
            else:
                alphas = request_acceptance(hits, trials, engine_rate)
                k = ctl.choose([alphas], held > 0)
            if cut is not None and k > 1:  # the first draft is always made
                k = gated_depth(cut[1][n][q][:k], 0.0, cut[0])
            cost = step_ms[k] + (resume_ms if k and held else 0.0)
            if gate is not None and not k:  # the head still extends: priced as a draft step
                cost += gate[3]
            if head_probs is not None and not k:
                cost += head_probs[1]
            if ctl is not None and learns:
                ctl.costs.observe(1, k, cost / 1e3, resumed=bool(k and held))
            per_k[k] += 1
            ms += cost
            a = min(trace[q], k)
            if cut is not None and k and ctl is not None and cut_priced:
                path = math.prod(cut[1][n][q][:k])
                ctl.observe_chain(1, k, k < DEPTH and path >= cut[0], [a])
            if k and ctl is not None:
                record_verify(hits, trials, k, a)
                update_acceptance(engine_rate, judged, k, a)
            if k:
                verifies += 1
                accepted_total += a + 1
                held = 0
            elif gate is None and head_probs is None:  # else the head extended at k = 0 too
                held += 1
            q += a + 1
            tokens += a + 1
    iterations = sum(per_k)
    return {
        "x_target": tokens / ms * step_ms[0],
        "drafting_share": 1 - per_k[0] / iterations,
        "tau": accepted_total / verifies if verifies else None,
        "iterations_per_k": per_k,
    }


def after_shift(
    before: list[list[int]],
    traces: list[list[int]],
    step_ms: dict[int, float],
    resume_ms: float,
    policy: Callable[[], dict[str, Any]],
) -> float:
    """The speed of `traces` (x target-only) replayed by a controller that first replayed
    `before`, each replay with a fresh `policy()` (its cost table learns as it replays): the
    replays are deterministic, so this part's cost is the difference of the two."""
    whole = replay(before + traces, step_ms, resume_ms, **policy())
    first = replay(before, step_ms, resume_ms, **policy())
    n_all, n_first = (sum(len(t) for t in ts) for ts in (before + traces, before))
    decodes = n_all / whole["x_target"] - n_first / first["x_target"]  # what the part costs
    return (n_all - n_first) / decodes


def table_of(ms: dict[int, float], catch_up_ms: float) -> CostTable:
    table = CostTable((1,))
    table.seconds = {(1, k): v / 1e3 for k, v in ms.items()}
    table.catch_up = {1: catch_up_ms / 1e3}
    return table

"""The adaptive controller replayed on measured acceptance and costs, free of timing noise.

    python bench/adaptive_replay.py [--draft HEAD] [--sets mtbench,humaneval] [--prompts 8]
        [--new-tokens 48] [--device cpu] [--model default] [--deterministic]
        [--out adaptive_replay.json]

1. Costs: one adaptive engine (the packed-int4 SmolLM2 as `make serve` runs it, overlap off)
   generates `--cost-prompts` MT-bench prompts at each fixed depth k = 0..3 (the controller
   scripted); each depth's median step is what an iteration costs in serving. The first
   drafting step after 12 plain decodes, against the steps after it, is what resuming costs.
   Beside them, the start-up table the controller prices them with, timed in the same process.
2. Acceptance: at every position of each prompt's greedy answer, how many drafts of a 3-chain
   the target accepts there: a request for the prompt and the answer so far, stepped by hand
   through its prefill and its first drafting iteration (its drafts are what any iteration
   drafting from that position drafts: greedy, and the head's KV is the same however it got
   there, tests/spec/test_adaptive_lossless.py).
   With it, the head's own probability of each of those drafts (its softmax top-1 at depths
   1..3), known before the verify.
3. Replay, batch 1, the requests one after another: each iteration's depth from a fixed chain,
   from the head's confidence (`gated F/C`: no draft where the first draft's probability is
   below F, else drafting on while the drafts' product of probabilities, EAGLE-2's measure of
   a draft path, is at least C: every draft made is verified, so no draft step is wasted; at
   k = 0 the head still extends over the committed token, priced as one draft step, measured
   in serving, so that the next position has its probability), or from the controller
   (spec/adaptive.py's estimates, choice and probes, fed as the worker and the scheduler feed
   them; `adaptive, head's probability`: its choice with the first draft's probability as
   the depth-1 acceptance, the head kept current at k = 0 as the gate keeps it, no probes),
   what it commits from the position's acceptance, and what it costs from serving's steps.
   The controller prices depths by the start-up table (what it does in serving; on a
   CPU refined online by what iterations cost, as the worker does) or, to separate a pricing
   error from an acceptance one, by serving's steps.

On a GPU in half precision, `--deterministic` (`--enable-deterministic-inference`): the drafts
are judged against the target-only answer, which a verify must reproduce token for token.

Prints, per prompt set, each policy's speed against target-only's (serving's step costs), the
share of iterations that drafted and tau; writes bench/results/adaptive_replay.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from bench.adaptive import BUILTIN_HEAD, chat_ids, prompt_set  # noqa: E402
from bench.common import machine, print_table, write_json  # noqa: E402
from eagleserve import Engine, SamplingParams  # noqa: E402
from eagleserve.messages import GenerateReqInput  # noqa: E402
from eagleserve.scheduler.scheduler import Scheduler  # noqa: E402
from eagleserve.spec import cost_model, draft_worker  # noqa: E402
from eagleserve.spec.adaptive import (  # noqa: E402
    AdaptiveController,
    CostTable,
    choose_num_drafts,
    depth_choices,
    record_verify,
    request_acceptance,
    update_acceptance,
)

DEPTH = 3
RESUME_AFTER = 12  # plain decodes before the scripted resume
# `gated F/C` policies: the first draft's least probability, the path's to draft on from it.
GATES = ((0.25, 0.5), (0.35, 0.5), (0.35, 0.65))


def greedy(new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)


def run_one(sched: Scheduler, ids: list[int], new_tokens: int) -> list[float]:
    """Generates one request alone; the seconds of each of its steps after the prefill's."""
    sched.add_request(GenerateReqInput("r", ids, greedy(new_tokens)))
    steps: list[float] = []
    while sched.has_work():
        t0 = time.perf_counter()
        sched.step()
        steps.append(time.perf_counter() - t0)
    return steps[1:]


def serving_costs(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Median decode step (ms) at each fixed depth, the resume's excess, the start-up table."""
    sched = engine.scheduler
    ctl = sched.worker.controller
    assert ctl is not None
    script: list[int] = []
    picks = [0]  # choices made since the count was reset

    def scripted(alphas: object, catching_up: bool = False) -> int:
        picks[0] += 1
        return script[(picks[0] - 1) % len(script)]

    ctl.choose = scripted  # type: ignore[method-assign]
    drafter = sched.worker.drafter
    plain_step, head_steps = drafter._step, []

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = plain_step(*args, **kwargs)
        head_steps.append(time.perf_counter() - t0)
        return out

    drafter._step = timed_step  # type: ignore[method-assign]
    step_ms: dict[int, float] = {}
    for k in range(DEPTH + 1):
        script[:] = [k]
        steps = [s for ids in prompts for s in run_one(sched, ids, new_tokens)[2:]]
        step_ms[k] = 1e3 * statistics.median(steps)
    drafter._step = plain_step  # type: ignore[method-assign]
    script[:] = [0] * RESUME_AFTER + [1] * 6
    first: list[float] = []
    steady: list[float] = []
    for ids in prompts:
        picks[0] = 0
        sched.add_request(GenerateReqInput("r", ids, greedy(4 * len(script))))
        while sched.has_work():
            before, t0 = picks[0], time.perf_counter()
            sched.step()
            if picks[0] > before:  # a decode step: its depth is pick number `before`
                phase = before % len(script)
                if phase == RESUME_AFTER:
                    first.append(time.perf_counter() - t0)
                elif phase > RESUME_AFTER + 1:
                    steady.append(time.perf_counter() - t0)
    resume_ms = 1e3 * (statistics.median(first) - statistics.median(steady))
    worker = sched.worker
    table = cost_model.measure_costs(worker.runner, worker.drafter, (1,), ctl.choices)
    return {
        "step_ms": step_ms,
        "resume_ms": max(resume_ms, 0.0),
        # one draft step of the head (a forward of one row and its top-1): what a gated k = 0
        # adds to a plain decode to keep the next position's probability
        # (none where the draft loop replays a device graph: no step runs in Python there)
        "head_step_ms": 1e3 * statistics.median(head_steps) if head_steps else None,
        "table_ms": {k: 1e3 * table.seconds[(1, k)] for k in ctl.choices},
        "table_catch_up_ms": 1e3 * table.catch_up[1],
    }


def acceptance_trace(
    engine: Engine, ids: list[int], answer: list[int]
) -> tuple[list[int], list[list[float] | None]]:
    """Per position q of `answer`: the drafts of a 3-chain accepted after answer[:q + 1], and
    the head's probability of each of those 3 drafts."""
    sched = engine.scheduler
    ctl = sched.worker.controller
    assert ctl is not None
    ctl.choose = lambda alphas, catching_up=False: DEPTH  # type: ignore[method-assign]
    seeds: list[float] = []  # each head forward's top-1 probability (batch 1), in order
    plain = draft_worker.seed_from_logits

    def recorded(*args: Any, **kwargs: Any) -> Any:
        seed = plain(*args, **kwargs)
        seeds.append(float(seed.topk_p.reshape(-1)[0]))
        return seed

    draft_worker.seed_from_logits = recorded
    out, confidence = [], []
    try:
        for q in range(len(answer) - DEPTH - 1):
            sched.add_request(GenerateReqInput("t", ids + answer[:q], greedy(DEPTH + 4)))
            seeds.clear()
            req = None
            while req is None or not req.output_ids:  # the prefill (chunks, if any)
                sched.step()
                batch = sched.running_batch
                req = batch.reqs[0] if batch is not None and batch.reqs else None
            sched.step()  # its first drafting iteration
            got = req.output_ids
            assert got == answer[q : q + len(got)], "a draft changed the greedy answer"
            out.append(len(got) - 2)  # less the prefill's token and the bonus token
            # the prefill's seed (depth 1), the draft's 2 steps, then the extend after the verify;
            # none where device graphs ran them (no seed passes through Python there)
            confidence.append(seeds[-DEPTH - 1 : -1] if len(seeds) > DEPTH else None)
            sched.abort_request("t")
            while sched.has_work():
                sched.step()
    finally:
        draft_worker.seed_from_logits = plain
    return out, confidence


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
) -> dict[str, Any]:
    """Batch 1, the traces' requests in turn; a fixed depth, the depth `gate` (its two
    thresholds, each trace's per-position draft probabilities, a head step's ms) allows, or the
    controller priced by `prices` and (`learns`: a CPU worker's) refining them online from
    serving's costs. `head_probs` (each trace's per-position draft probabilities, a head
    step's ms): the controller's choice with the first draft's probability as its depth-1
    acceptance, the head extended at k = 0 too."""
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


def table_of(ms: dict[int, float], catch_up_ms: float) -> CostTable:
    table = CostTable((1,))
    table.seconds = {(1, k): v / 1e3 for k, v in ms.items()}
    table.catch_up = {1: catch_up_ms / 1e3}
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--draft", default=BUILTIN_HEAD, help="the EAGLE3 head (default: shipped)")
    ap.add_argument("--sets", default="mtbench,humaneval")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per set")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--cost-prompts", type=int, default=6)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="default")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--out", default="adaptive_replay.json")
    args = ap.parse_args()
    kw: dict[str, Any] = dict(model=args.model, device=args.device, max_total_tokens=16384,
                              max_running_requests=1, disable_overlap_schedule=True,
                              disable_radix_cache=True,
                              enable_deterministic_inference=args.deterministic)  # fmt: skip
    spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=args.draft,
                speculative_eagle_topk=1, speculative_num_steps=DEPTH,
                speculative_num_draft_tokens=DEPTH + 1, speculative_adaptive=True)  # fmt: skip
    target, engine = Engine(**kw), Engine(**kw, **spec)
    tok = target.tokenizer
    engine.generate(["Hello"], greedy(8))
    cost_prompts = [chat_ids(tok, p) for p in prompt_set("mtbench", args.cost_prompts)]
    costs = serving_costs(engine, cost_prompts, args.new_tokens)
    step_ms, resume_ms = costs["step_ms"], costs["resume_ms"]
    prior = engine.scheduler.worker.drafter.acceptance_prior
    rows, table, traces_by_set, confidence_by_set = [], [], {}, {}
    for set_name in args.sets.split(","):
        traces, confidence = [], []
        for p in prompt_set(set_name, args.prompts):
            ids = chat_ids(tok, p)
            answer = target.generate([ids], greedy(args.new_tokens))[0]["token_ids"]
            trace, probs = acceptance_trace(engine, ids, answer)
            traces.append(trace)
            confidence.append(probs)
        traces_by_set[set_name], confidence_by_set[set_name] = traces, confidence
        first = sum(a > 0 for t in traces for a in t) / sum(len(t) for t in traces)
        policies: dict[str, dict[str, Any]] = {
            f"chain {k}": dict(fixed=k) for k in range(1, DEPTH + 1)
        }
        step = costs["head_step_ms"]
        known = step is not None and all(p is not None for t in confidence for p in t)
        if known:
            policies |= {f"gated {f}/{c}": dict(gate=(f, c, confidence, step)) for f, c in GATES}
        learns = args.device == "cpu"
        policies["adaptive, start-up table"] = dict(
            prices=table_of(costs["table_ms"], costs["table_catch_up_ms"]), prior=prior,
            learns=learns,
        )  # fmt: skip
        policies["adaptive, serving's costs"] = dict(
            prices=table_of(step_ms, resume_ms), prior=prior, learns=learns
        )
        if known:
            kept = {k: v + (step if k == 0 else 0.0) for k, v in step_ms.items()}
            policies["adaptive, head's probability"] = dict(
                prices=table_of(kept, 0.0), prior=prior, learns=False,
                head_probs=(confidence, step),
            )  # fmt: skip
        else:
            print(f"{set_name}: the head's probabilities ran in device graphs, not recorded: "
                  "no gated policies")  # fmt: skip
        for name, policy in policies.items():
            r = replay(traces, step_ms, resume_ms, **policy)
            rows.append({"set": set_name, "policy": name, "first_draft_acceptance": first, **r})
            tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
            table.append([set_name, name, f"{r['x_target']:.3f}", f"{r['drafting_share']:.2f}",
                          tau, " ".join(map(str, r["iterations_per_k"]))])  # fmt: skip
    print(f"serving's step ms by k: {step_ms}, resume +{resume_ms:.2f} ms; "
          f"start-up table ms: {costs['table_ms']}")  # fmt: skip
    print_table(["set", "policy", "x target-only", "drafting", "tau", "iters per k"], table)
    dev = torch.device(args.device)
    name = "cpu" if dev.type == "cpu" else torch.get_device_module(dev).get_device_name(dev)
    path = write_json(args.out, {"machine": machine(), "device": name, "draft": args.draft,
                                 "new_tokens": args.new_tokens, "costs": costs, "prior": prior,
                                 "traces": traces_by_set, "draft_probs": confidence_by_set,
                                 "rows": rows})  # fmt: skip
    print(path)


if __name__ == "__main__":
    main()

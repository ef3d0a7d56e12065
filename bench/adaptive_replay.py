"""The adaptive controller replayed on measured acceptance and costs, free of timing noise.

    python bench/adaptive_replay.py [--draft HEAD] [--sets mtbench,humaneval] [--prompts 8]
        [--new-tokens 48] [--device cpu] [--model default] [--deterministic]
        [--traces RESULTS.json] [--out adaptive_replay.json]

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

4. Traffic that changes: the controller (start-up table) replayed on every other set's
   requests SHIFT_ROUNDS times, then on this set's, its state carried over; the row is this
   set's part ("adaptive, after 3 x humaneval"). Its acceptance estimates are what it learnt
   on the other text, which is what a server sees when its traffic moves from chat to code.

Prints, per prompt set, each policy's speed against target-only's (serving's step costs), the
share of iterations that drafted and tau; writes bench/results/adaptive_replay.json.
`--traces` replays the traces and costs of an earlier run's JSON (no engine: seconds), e.g.
to weigh a change of the controller on the same measurements.
"""

from __future__ import annotations

import argparse
import json
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
from bench.replay_policies import DEPTH, GATES, after_shift, replay, table_of  # noqa: E402
from eagleserve import Engine, SamplingParams  # noqa: E402
from eagleserve.config import DEFAULT_MIN_PATH_PROB  # noqa: E402
from eagleserve.messages import GenerateReqInput  # noqa: E402
from eagleserve.scheduler.scheduler import Scheduler  # noqa: E402
from eagleserve.spec import cost_model, draft_worker  # noqa: E402

RESUME_AFTER = 12  # plain decodes before the scripted resume
SHIFT_ROUNDS = 3  # passes over the other sets' requests before a set's own (step 4)


def greedy(new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)


def run_one(sched: Scheduler, ids: list[int], new_tokens: int) -> list[float]:
    """Generates one request alone; the seconds of each of its steps after the prefill's."""
    sched.add_request(GenerateReqInput("r", ids, greedy(new_tokens), stream=True))  # as served
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
        sched.add_request(GenerateReqInput("r", ids, greedy(4 * len(script)), stream=True))
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


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Serving's costs, the start-up table, and each set's acceptance traces (steps 1 and 2)."""
    kw: dict[str, Any] = dict(model=args.model, device=args.device, max_total_tokens=16384,
                              max_running_requests=1, disable_overlap_schedule=True,
                              disable_radix_cache=True,
                              enable_deterministic_inference=args.deterministic)  # fmt: skip
    # Whole chains (--speculative-min-path-prob 0): each depth traced and timed as drafted.
    spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=args.draft,
                speculative_eagle_topk=1, speculative_num_steps=DEPTH,
                speculative_num_draft_tokens=DEPTH + 1, speculative_adaptive=True,
                speculative_min_path_prob=0.0)  # fmt: skip
    target, engine = Engine(**kw), Engine(**kw, **spec)
    tok = target.tokenizer
    engine.generate(["Hello"], greedy(8))
    cost_prompts = [chat_ids(tok, p) for p in prompt_set("mtbench", args.cost_prompts)]
    costs = serving_costs(engine, cost_prompts, args.new_tokens)
    traces_by_set, confidence_by_set = {}, {}
    for set_name in args.sets.split(","):
        traces, confidence = [], []
        for p in prompt_set(set_name, args.prompts):
            ids = chat_ids(tok, p)
            answer = target.generate([ids], greedy(args.new_tokens))[0]["token_ids"]
            trace, probs = acceptance_trace(engine, ids, answer)
            traces.append(trace)
            confidence.append(probs)
        traces_by_set[set_name], confidence_by_set[set_name] = traces, confidence
    dev = torch.device(args.device)
    name = "cpu" if dev.type == "cpu" else torch.get_device_module(dev).get_device_name(dev)
    return {"machine": machine(), "device": name, "draft": args.draft,
            "new_tokens": args.new_tokens, "costs": costs,
            "prior": engine.scheduler.worker.drafter.acceptance_prior,
            "traces": traces_by_set, "draft_probs": confidence_by_set}  # fmt: skip


def load_measured(path: str) -> dict[str, Any]:
    """An earlier run's measurements (`--traces`), the cost tables' keys ints again."""
    with open(path) as f:
        data = json.load(f)
    costs = data["costs"]
    for key in ("step_ms", "table_ms"):
        costs[key] = {int(k): v for k, v in costs[key].items()}
    data.pop("rows", None)
    return data


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
    ap.add_argument("--traces", default=None, help="replay an earlier run's JSON (no engine)")
    ap.add_argument("--out", default="adaptive_replay.json")
    args = ap.parse_args()
    data = load_measured(args.traces) if args.traces else measure(args)
    costs, prior = data["costs"], data["prior"]
    step_ms, resume_ms = costs["step_ms"], costs["resume_ms"]
    traces_by_set, confidence_by_set = data["traces"], data["draft_probs"]
    learns = data["device"] == "cpu"

    def startup_table() -> dict[str, Any]:
        return dict(prices=table_of(costs["table_ms"], costs["table_catch_up_ms"]), prior=prior,
                    learns=learns)  # fmt: skip

    rows, table = [], []
    for set_name, traces in traces_by_set.items():
        confidence = confidence_by_set[set_name]
        first = sum(a > 0 for t in traces for a in t) / sum(len(t) for t in traces)
        policies: dict[str, dict[str, Any]] = {
            f"chain {k}": dict(fixed=k) for k in range(1, DEPTH + 1)
        }
        step = costs["head_step_ms"]
        known = step is not None and all(p is not None for t in confidence for p in t)
        if known:
            policies |= {f"gated {f}/{c}": dict(gate=(f, c, confidence, step)) for f, c in GATES}
        policies["adaptive, start-up table"] = startup_table()
        if known:  # as a CPU serves since chains are cut (--speculative-min-path-prob)
            cut = (DEFAULT_MIN_PATH_PROB, confidence)
            policies[f"chain {DEPTH}, cut at {cut[0]}"] = dict(fixed=DEPTH, cut=cut)
            policies[f"adaptive, start-up table, cut at {cut[0]}"] = dict(startup_table(), cut=cut)
            policies[f"adaptive, start-up table, cut at {cut[0]}, priced whole"] = dict(
                startup_table(), cut=cut, cut_priced=False
            )
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
        for other, before in traces_by_set.items():
            if other == set_name:
                continue
            name = f"adaptive, after {SHIFT_ROUNDS} x {other}"
            x = after_shift(before * SHIFT_ROUNDS, traces, step_ms, resume_ms, startup_table)
            rows.append({"set": set_name, "policy": name, "first_draft_acceptance": first,
                         "x_target": x})  # fmt: skip
            table.append([set_name, name, f"{x:.3f}", "-", "-", "-"])
    print(f"serving's step ms by k: {step_ms}, resume +{resume_ms:.2f} ms; "
          f"start-up table ms: {costs['table_ms']}")  # fmt: skip
    print_table(["set", "policy", "x target-only", "drafting", "tau", "iters per k"], table)
    replayed = args.traces and os.path.basename(args.traces)
    path = write_json(args.out, {**data, "replayed_from": replayed, "rows": rows})
    print(path)


if __name__ == "__main__":
    main()

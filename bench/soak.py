"""Soak: bench/load.py's request mix through one in-process engine; every greedy or seeded answer
is recomputed alone and must match.

    python bench/soak.py [--clients 4] [--steps 3000] [--mix-seed 0] [--multi-turn] [serve
        flags: --model DIR --max-total-tokens 300 --speculative-algorithm EAGLE ...]

C closed-loop clients each send their next request as soon as their last one ends, as chat
clients do, so new requests keep taking finished ones' places in the running batch; a client
that hangs up aborts its request after its first 1-3 outputs; with --multi-turn each client
holds a chat conversation of --turns turns, each request re-sending the whole of it; requests
that cannot fit are rejected and not counted. No HTTP: the scheduler steps as fast as it can,
and a failure names the request and the first token that differs. After the steps, every
completed greedy or seeded request runs again alone on the same engine, and the KV pool must be
empty. Writes bench/results/soak.json (--out); exits non-zero on any inexact answer or KV left in
use (an engine error ends it with its traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine_info  # noqa: E402
from bench.load_mix import (  # noqa: E402
    Job,
    engine_view,
    make_job,
    messages_of,
    next_turn,
    request_params,
)
from bench.load_outcomes import exact  # noqa: E402
from eagleserve import Engine, SamplingParams  # noqa: E402
from eagleserve.cli import add_serve_flags, build_server_args  # noqa: E402
from eagleserve.messages import GenerateReqInput  # noqa: E402


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Engine]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--steps", type=int, default=3000, help="scheduler steps with clients sending")
    p.add_argument("--mix-seed", type=int, default=0, help="the request mix's random seed")
    p.add_argument(
        "--multi-turn",
        action="store_true",
        help="chat conversations: each request sends the whole conversation so far",
    )
    p.add_argument("--turns", type=int, default=4, help="--multi-turn: turns per conversation")
    p.add_argument("--max-tokens", type=int, default=32, help="most new tokens, short requests")
    p.add_argument("--long-max-tokens", type=int, default=96, help="most new tokens, long ones")
    p.add_argument("--long-share", type=float, default=0.25)
    p.add_argument("--long-repeats", type=lambda v: tuple(int(x) for x in v.split(",")),
                   default=(1, 2), help="LO,HI: a long prompt's sentence repeats")  # fmt: skip
    p.add_argument("--disconnect-share", type=float, default=0.1)
    p.add_argument("--penalty-share", type=float, default=0.3)
    p.add_argument("--stop-share", type=float, default=0.15)
    p.add_argument("--structured-share", type=float, default=0.1)
    p.add_argument("--logprobs-share", type=float, default=0.1)
    # n choices and prompt lists are the server's: one engine request per choice.
    p.set_defaults(n_share=0.0, multi_prompt_share=0.0)
    p.add_argument("--echo-share", type=float, default=0.1)
    p.add_argument("--out", default=os.path.join("bench", "results", "soak.json"))
    add_serve_flags(p)
    ns = p.parse_args(argv)
    server_args = build_server_args(ns)
    if isinstance(server_args, str):
        p.error(server_args)
    kw = {f.name: getattr(server_args, f.name) for f in dataclasses.fields(server_args)}
    return ns, Engine(**kw)


def soak(ns: argparse.Namespace, engine: Engine) -> dict[str, Any]:
    sched, tok = engine.scheduler, engine.tokenizer
    rng = random.Random(ns.mix_seed)
    jobs: dict[str, tuple[Job, list[int], SamplingParams]] = {}
    tokens: dict[str, list[int]] = {}
    ends: dict[str, str] = {}  # rid -> finish reason ("hung up" for a client's abort)
    outputs: dict[str, int] = {}
    live: dict[str, int] = {}  # rid -> client
    # Per client: the conversation its next request continues (--multi-turn; empty: a new one).
    histories: list[list[dict[str, str]]] = [[] for _ in range(ns.clients)]

    def send(client: int) -> None:
        ctx = sched.max_context_len
        history = histories[client]
        job = next_turn(rng, ns, ctx, history) if ns.multi_turn else make_job(rng, ns, ctx)
        _, ids, grammar = engine_view(job, tok)
        rid = f"s{len(jobs)}"
        jobs[rid] = (job, ids, request_params(job, 0, grammar))
        tokens[rid], outputs[rid] = [], 0
        sched.add_request(GenerateReqInput(rid, jobs[rid][1], jobs[rid][2], job.stream))
        live[rid] = client

    def end(rid: str, reason: str) -> None:
        ends.setdefault(rid, reason)
        client, job = live.pop(rid), jobs[rid][0]
        turns = sum(m["role"] == "user" for m in job.history) + 1
        histories[client] = []
        if ns.multi_turn and reason in ("length", "stop") and turns < ns.turns:
            answer = tok.decode(tokens[rid], skip_special_tokens=True)
            histories[client] = [*messages_of(job), {"role": "assistant", "content": answer}]

    def collect() -> None:
        for out in sched.step():
            tokens[out.rid] += out.new_token_ids
            outputs[out.rid] += bool(out.new_token_ids)
            hang_up = jobs[out.rid][0].disconnect_after
            if out.rid not in live:  # the client hung up: what is left is not read
                continue
            if out.finished:
                end(out.rid, out.finish_reason or "")
            elif hang_up is not None and outputs[out.rid] >= hang_up:
                sched.abort_request(out.rid)
                end(out.rid, "hung up")

    for _ in range(ns.steps):
        for client in sorted(set(range(ns.clients)) - set(live.values())):
            send(client)
        collect()
    while sched.has_work():
        collect()
    kv_used = engine.stats().kv_used_tokens
    done = [r for r in jobs if ends.get(r) in ("length", "stop") and exact(jobs[r][0])]
    mismatches = []
    for rid in done:
        job, ids, params = jobs[rid]
        alone = engine.generate([ids], [params])[0]["token_ids"]
        if alone != tokens[rid]:
            first = next((i for i, (a, b) in enumerate(zip(alone, tokens[rid])) if a != b), None)
            mismatches.append({"rid": rid, "greedy": job.greedy, "fields": job.fields,
                               "constraint": job.constraint,
                               "first_difference": first, "got": tokens[rid],
                               "want": alone})  # fmt: skip
    reasons = list(ends.values())
    return {
        "requests": len(jobs),
        "completed": sum(r in ("length", "stop") for r in reasons),
        "hung_up": reasons.count("hung up"),
        "rejected": reasons.count("error"),
        "checked_greedy": sum(jobs[r][0].greedy for r in done),
        "checked_seeded": sum(not jobs[r][0].greedy for r in done),
        "checked_structured": sum(bool(jobs[r][0].constraint) for r in done),
        "inexact": len(mismatches),
        "retracted": sched.num_retracted,
        "kv_used_tokens_end": kv_used,
        "ok": not mismatches and kv_used == 0,
        "mismatches": mismatches[:10],
    }


def main(argv: list[str] | None = None) -> int:
    ns, engine = parse_args(argv)
    summary = soak(ns, engine)
    for k, v in summary.items():
        if k != "mismatches":
            print(f"{k:>20}: {v}")
    for m in summary["mismatches"][:3]:
        print("  mismatch:", json.dumps(m)[:400])
    payload = {"benchmark": "soak", "args": {k: v for k, v in vars(ns).items()},
               "engine": dataclasses.asdict(engine.args), "machine": machine_info(),
               "summary": summary}  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump(payload, f, indent=2, default=str)
        f.write("\n")
    print(f"wrote {ns.out}")
    engine.close()
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

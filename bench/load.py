"""Load test: N concurrent clients drive a real server; greedy and seeded answers checked offline.

    python bench/load.py [--clients 64] [--duration 60] [--spec] [--multi-turn] [--url URL]

Starts `eagleserve serve` on 127.0.0.1 with a small KV pool (unless --url), then runs clients
for `--duration` seconds: completions and chat, streamed and not, greedy and sampled (top_p,
top_k, min_p), short and long prompts, some with penalties, min_tokens, logit_bias, stop strings
or stop token ids, some of n choices, some with an output constraint (JSON, a JSON schema, a
regex, chat tools), some with logprobs, some completions with a list of prompts or with echo +
logprobs (max_tokens 0 among them: prompt scoring); some clients hang up mid-stream, some send
requests that can never fit (400), and long `ignore_eos` requests together overflow the KV pool
(waiting / retraction). After the load, every completed greedy or seeded response is recomputed
with the offline `Engine` (same model, flags and fields; choice j's seed the request's + j) and
must match exactly (text, finish reason; the logprobs asked for, an echo's prompt entries
included, to 1e-4), and the server's KV pool must be empty. Writes bench/results/load*.json and
exits non-zero on any lost request, inexact answer or KV left in use.

--multi-turn: every client holds chat conversations (one of two system prompts, up to
--turns turns, each request sending the whole conversation so far), as chat clients do; the
server's prefix cache then serves most of each prompt. A turn that does not complete ends the
conversation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine_info  # noqa: E402
from bench.load_mix import Job, make_job, messages_of, next_turn, request_body  # noqa: E402
from bench.load_outcomes import Outcome, shown_answer, summarize, verify_exact  # noqa: E402
from bench.mem_watch import MemoryWatch  # noqa: E402
from bench.server_proc import HOST, Server, server_flags, spec_figures, wait_idle  # noqa: E402

DEFAULT_DRAFT = "builtin:smollm2-135m-eagle"


def chunk_text(kind: str, choice: dict[str, Any]) -> str:
    if kind == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def cached_tokens(usage: dict[str, Any]) -> int | None:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


async def run_job(http: httpx.AsyncClient, job: Job, model: str, timeout: float) -> Outcome:
    path, body = request_body(job, model)
    t0 = time.monotonic()
    try:
        if not job.stream:
            resp = await http.post(path, json=body, timeout=timeout)
            return finish_plain(job, resp)
        async with http.stream("POST", path, json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return finish_plain(job, resp)
            return await read_stream(job, resp, t0)
    except (httpx.HTTPError, OSError) as exc:
        return Outcome(job, "lost", detail=f"{type(exc).__name__}: {exc}")


def finish_plain(job: Job, resp: httpx.Response) -> Outcome:
    if resp.status_code == 400 and job.never_fits:
        return Outcome(job, "rejected")
    # A conversation's turn, its first included: the mix sizes a prompt, not the system prompt
    # and chat template around it, so a long first turn may not fit a small context either.
    if resp.status_code == 400 and job.history and "context_length" in resp.text:
        return Outcome(job, "context_full")
    if resp.status_code != 200:
        return Outcome(job, "error", detail=f"HTTP {resp.status_code}: {resp.text[:300]}")
    data = resp.json()
    answers = [
        (shown_answer(job, c["message"]["content"], c["message"].get("tool_calls") or [])
         if job.kind == "chat" else c["text"], c["finish_reason"])
        for c in sorted(data["choices"], key=lambda c: c["index"])
    ]  # fmt: skip
    usage = data.get("usage") or {}
    (text, finish), *more = answers
    out = Outcome(job, "completed", text, finish, usage.get("completion_tokens", 0))
    out.more_choices = more
    out.cached_tokens = cached_tokens(usage)
    if job.logprobs is not None:
        first = next(c for c in data["choices"] if c["index"] == 0)
        add_logprobs(job, out, first.get("logprobs"))
    return out


def add_logprobs(job: Job, out: Outcome, lp: dict[str, Any] | None) -> None:
    """Appends a choice's logprobs entries (a response's, or a stream chunk's) to `out`: each
    entry's logprob and its alternatives' (most likely first)."""
    if not lp:
        return
    if job.kind == "chat":
        for entry in lp.get("content") or []:
            out.token_logprobs.append(entry["logprob"])
            out.top_values.append([t["logprob"] for t in entry["top_logprobs"]])
        return
    out.token_logprobs += lp["token_logprobs"]
    out.top_values += [sorted(d.values(), reverse=True) if d else [] for d in lp["top_logprobs"]]


async def read_stream(job: Job, resp: httpx.Response, t0: float) -> Outcome:
    out = Outcome(job, "lost", detail="stream ended without [DONE]")
    parts: list[str] = []
    more: dict[int, tuple[str, str | None]] = {}  # choices 1..n-1: text and finish so far
    calls: dict[int, list[dict[str, Any]]] = {}  # tools: each choice's calls (its last delta)
    chunks = 0
    first = last = None
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[6:]
        if payload == "[DONE]":
            out.status, out.detail = "completed", ""
            break
        data = json.loads(payload)
        if "error" in data:
            out.status, out.detail = "error", f"stream error: {data['error']}"
            break
        if data.get("usage"):
            out.completion_tokens = data["usage"]["completion_tokens"]
            out.cached_tokens = cached_tokens(data["usage"])
        for choice in data.get("choices", []):
            text = chunk_text(job.kind, choice)
            delta_calls = (choice.get("delta") or {}).get("tool_calls")
            if delta_calls:
                calls.setdefault(choice.get("index", 0), []).extend(delta_calls)
            if choice.get("index", 0):  # another choice of n: its text and its end
                was, end = more.get(choice["index"], ("", None))
                more[choice["index"]] = (was + text, choice.get("finish_reason") or end)
                continue
            out.finish_reason = choice.get("finish_reason") or out.finish_reason
            if job.logprobs is not None:
                add_logprobs(job, out, choice.get("logprobs"))
            if text:
                now = time.monotonic()
                if first is None:
                    first = now
                    out.ttft = now - t0
                else:
                    out.chunk_gaps.append(now - last)
                last = now
                parts.append(text)
                chunks += 1
        if job.disconnect_after is not None and chunks >= job.disconnect_after:
            out.status, out.detail = "aborted", ""
            break  # leaving the `async with` closes the connection mid-stream
    out.text = "".join(parts)
    out.more_choices = [more.get(j, ("", None)) for j in range(1, job.num_choices)]
    if job.tools:
        out.text = shown_answer(job, out.text, calls.get(0, []))
        out.more_choices = [(shown_answer(job, t, calls.get(j, [])), f)
                            for j, (t, f) in enumerate(out.more_choices, 1)]  # fmt: skip
    if first is not None and last is not None and out.completion_tokens > 1:
        out.tpot = (last - first) / (out.completion_tokens - 1)
    if out.status == "completed" and any(finish is None for _, _, finish in out.answers()):
        out.status, out.detail = "lost", "stream finished without a finish_reason"
    return out


async def client_loop(
    cid: int, http: httpx.AsyncClient, args: argparse.Namespace, ctx: int, deadline: float
) -> list[Outcome]:
    rng = random.Random(args.seed * 100_003 + cid)
    outcomes = []
    history: list[dict[str, str]] = []
    while time.monotonic() < deadline:
        job = next_turn(rng, args, ctx, history) if args.multi_turn else make_job(rng, args, ctx)
        out = await run_job(http, job, args.model_name, args.request_timeout)
        outcomes.append(out)
        history = []
        turns = sum(m["role"] == "user" for m in job.history) + 1
        if args.multi_turn and out.status == "completed" and turns < args.turns:
            history = [*messages_of(job), {"role": "assistant", "content": out.text}]
    return outcomes


async def drive(args: argparse.Namespace, url: str) -> tuple[list[Outcome], float, int]:
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(
        base_url=url, limits=limits, timeout=args.request_timeout, headers=headers
    ) as http:
        models = (await http.get("/v1/models")).json()["data"][0]
        args.model_name = models["id"]
        ctx = models["max_model_len"]
        start = time.monotonic()
        deadline = start + args.duration
        per_client = await asyncio.gather(
            *(client_loop(i, http, args, ctx, deadline) for i in range(args.clients))
        )
        elapsed = time.monotonic() - start
    return [o for outs in per_client for o in outs], elapsed, ctx


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--url",
        help="drive this server instead of starting one (127.0.0.1 only; e.g. nginx in front "
        "of --dp-size replicas: deploy/nginx.conf)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("EAGLESERVE_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $EAGLESERVE_API_KEY)",
    )
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--spec", action="store_true", help="speculative decoding on (EAGLE)")
    p.add_argument("--config", help="serve with this config file (e.g. configs/smollm2-135m-eagle."
                   "yaml, the shipped adaptive EAGLE3); the flags here override it")  # fmt: skip
    p.add_argument("--multi-turn", action="store_true", help="chat conversations (see above)")
    p.add_argument("--turns", type=int, default=4, help="--multi-turn: turns per conversation")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="EAGLE head for --spec")
    p.add_argument("--algorithm", default="EAGLE3", help="the head's kind: EAGLE or EAGLE3")
    p.add_argument("--model", default="default")
    p.add_argument("--max-total-tokens", type=int, default=4096)
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--disable-overlap-schedule", action=argparse.BooleanOptionalAction,
                   help="the server's and the offline check's (default: the device's)")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=32, help="most new tokens, short requests")
    p.add_argument("--long-max-tokens", type=int, default=96, help="most new tokens, long ones")
    p.add_argument("--long-share", type=float, default=0.25)
    p.add_argument(
        "--long-repeats",
        type=lambda v: tuple(int(x) for x in v.split(",")),
        default=(6, 14),
        help="LO,HI: a long prompt repeats a ~30-token sentence LO..HI times",
    )
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu", help="the server's and the offline check's")
    p.add_argument("--serve-flags", default="",
                   help="more `eagleserve serve` flags, e.g. --serve-flags='--enable-pdl' "
                   "(the offline check gets them too)")  # fmt: skip
    p.add_argument("--disconnect-share", type=float, default=0.1)
    p.add_argument("--penalty-share", type=float, default=0.3,
                   help="requests with penalties / min_tokens / logit_bias")  # fmt: skip
    p.add_argument("--stop-share", type=float, default=0.15, help="requests with stop strings")
    p.add_argument("--n-share", type=float, default=0.1, help="requests of 2-3 choices (n)")
    p.add_argument("--multi-prompt-share", type=float, default=0.1,
                   help="completions with a list of 2-3 prompts")  # fmt: skip
    p.add_argument("--logprobs-share", type=float, default=0.1,
                   help="requests with logprobs (0-3 top alternatives)")  # fmt: skip
    p.add_argument("--structured-share", type=float, default=0.1,
                   help="requests with response_format, a regex or (chat) tools")  # fmt: skip
    p.add_argument("--echo-share", type=float, default=0.1,
                   help="completions with echo + logprobs (max_tokens 0 among them)")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-verify", action="store_true", help="skip the offline exactness check")
    p.add_argument("--out", help="JSON path (default: bench/results/load[_spec].json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url and httpx.URL(args.url).host not in (HOST, "localhost"):
        print("bench/load.py: --url must be on 127.0.0.1", file=sys.stderr)
        return 2
    server = None if args.url else Server(server_flags(args))
    url = args.url or server.url  # type: ignore[union-attr]
    watch = MemoryWatch(server.proc.pid) if server is not None and os.path.isdir("/proc") else None
    try:
        outcomes, elapsed, ctx = asyncio.run(drive(args, url))
        try:
            final = wait_idle(url)
            spec = spec_figures(url)
        except httpx.TransportError:  # the server is gone: the summary says how it ended
            final, spec = {}, None
    finally:
        if watch is not None:
            watch.stop()
        rc = server.stop() if server is not None else None
    summary = summarize(outcomes, elapsed)
    kv_used = final.get("eagleserve_kv_used_tokens", -1)
    summary.update(
        kv_used_tokens_end=kv_used,
        kv_total_tokens=final.get("eagleserve_kv_total_tokens"),
        retracted_total=final.get("eagleserve_num_retracted_total"),
        prefix_cache_hit_rate=final.get("eagleserve_prefix_cache_hit_rate"),
        server_exit_code=rc,
        max_context_len=ctx,
        elapsed_s=round(elapsed, 2),
        speculation=spec,
        memory=watch.growth() if watch is not None else None,
    )
    mismatches = [] if args.no_verify else verify_exact(args, outcomes)
    inexact_greedy = sum(m["greedy"] for m in mismatches)
    summary["greedy_exact"] = summary["completed_greedy"] - inexact_greedy
    summary["seeded_exact"] = summary["completed_seeded"] - (len(mismatches) - inexact_greedy)
    summary["mismatches"] = mismatches[:10]
    ok = summary["lost"] == 0 and summary["errors"] == 0 and not mismatches and kv_used == 0
    summary["ok"] = ok
    if server is not None and rc not in (0, -signal.SIGTERM):  # it died: say why
        summary["server_log_tail"] = server.log_tail(6000)
    payload = {
        "benchmark": "load",
        "args": {k: v for k, v in vars(args).items()},
        "machine": machine_info(),
        "summary": summary,
    }
    tag = ("_spec" if args.spec or args.config else "") + ("_multi_turn" if args.multi_turn else "")
    name = args.out or os.path.join("bench", "results", f"load{tag}.json")
    os.makedirs(os.path.dirname(os.path.abspath(name)), exist_ok=True)
    with open(name, "w") as f:
        json.dump(payload, f, indent=2, default=lambda o: asdict(o))
        f.write("\n")
    keys = [
        "sent",
        "completed",
        "greedy_exact",
        "completed_greedy",
        "seeded_exact",
        "completed_seeded",
        "completed_with_penalties",
        "completed_with_stop",
        "completed_n_choices",
        "completed_multi_prompt",
        "completed_structured",
        "answers_with_tool_calls",
        "completed_logprobs",
        "completed_echo_logprobs",
        "aborted_by_client",
        "rejected_400_expected",
        "conversations_at_context_limit",
        "errors",
        "lost",
        "tokens_per_s",
        "speculation",
        "ttft_ms",
        "itl_ms",
        "chunk_gap_ms",
        "retracted_total",
        "prefix_cache_hit_rate",
        "kv_used_tokens_end",
        "ok",
    ]
    for k in keys:
        print(f"{k:>22}: {summary[k]}")
    for label, m in (summary["memory"] or {}).items():
        print(
            f"  memory {label[:48]}: {m['mib_after_warmup']} -> {m['mib_end']} MiB anonymous, "
            f"{m['mib_per_min']:+} MiB/min after warm-up"
        )
    for d in summary["error_details"][:5]:
        print("  error:", d)
    for m in mismatches[:3]:
        print("  mismatch:", json.dumps(m)[:400])
    print(f"wrote {name}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""What the requests of a bench/load.py run came to: one `Outcome` per request, the offline check
of every completed greedy or seeded answer (`verify_exact`) and the summary of the run
(`summarize`)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any

from bench.load_mix import Job, engine_view, request_params, sampling_fields


@dataclass
class Outcome:
    job: Job
    # completed | aborted | rejected (expected 400) | context_full (a conversation's turn does
    # not fit the context: a 400 that ends the conversation) | error | lost
    status: str
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    ttft: float | None = None
    tpot: float | None = None  # mean time per output token after the first (streams)
    chunk_gaps: list[float] = field(default_factory=list)
    detail: str = ""
    # Logprobs entries of choice 0 (an echo's prompt first): the chosen token's logprob, and its
    # alternatives' (most likely first; a completion's may be fewer: those are by token text).
    token_logprobs: list[float | None] = field(default_factory=list)
    top_values: list[list[float]] = field(default_factory=list)
    cached_tokens: int | None = None  # prompt tokens the server's prefix cache served (usage)
    # Choices 1.. of a request of n > 1 or of several prompts: (text, finish_reason); `text` is
    # choice 0's. With tools a choice's text is its `shown_answer`.
    more_choices: list[tuple[str, str | None]] = field(default_factory=list)

    def answers(self) -> list[tuple[int, str, str | None]]:
        """(choice index, text, finish_reason) of every choice (index = prompt * n + j)."""
        more = [(j, text, finish) for j, (text, finish) in enumerate(self.more_choices, 1)]
        return [(0, self.text, self.finish_reason), *more]


def shown_answer(job: Job, content: str | None, calls: list[dict[str, Any]]) -> str:
    """A choice's answer as compared: its text, or with tools its text and its calls' names and
    arguments (their ids are random)."""
    if not job.tools:
        return content or ""
    named = [[c["function"]["name"], c["function"]["arguments"]] for c in calls]
    return json.dumps({"content": content or "", "calls": named})


# ---- offline check -------------------------------------------------------------------------

# What fixes an answer: kind, prompt ids, max_tokens, ignore_eos, the fields (the choice's
# seed among them), echo, the output constraint, the logprobs asked for.
AnswerKey = tuple[str, tuple[int, ...], int, bool, str, bool, str, int | None]


def offline_answer(job: Job, text: str, finish: str | None) -> tuple[str, str | None]:
    """The answer and finish reason the server shows for the engine's `text` (with tools: the
    calls parsed out of it, by the server's own rule)."""
    if not job.tools:
        return text, finish
    from eagleserve.server.tool_calls import tool_answer

    content, calls, finish = tool_answer(text, finish)
    return shown_answer(job, content, calls), finish


def exact(job: Job) -> bool:
    """Whether the answer is fixed by the request: greedy, or sampled with a seed (its draws
    are keyed by the seed and the position, whatever else the batch holds)."""
    return job.greedy or job.seed is not None


def server_engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ServerArgs fields of the server bench/load.py starts (its flags, its --config), for
    an offline `Engine` that computes what the server should."""
    import dataclasses

    from bench.server_proc import server_flags
    from eagleserve.cli import add_serve_flags, build_server_args

    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    server_args = build_server_args(parser.parse_args(server_flags(args)))
    assert not isinstance(server_args, str), server_args
    return {f.name: getattr(server_args, f.name) for f in dataclasses.fields(server_args)}


def verify_exact(args: argparse.Namespace, outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """Recomputes every completed greedy or seeded response offline; returns the mismatches."""
    from eagleserve import Engine

    todo = [o for o in outcomes if o.status == "completed" and exact(o.job)]
    if not todo:
        return []
    engine = Engine(**server_engine_args(args))
    tok = engine.tokenizer
    # Every choice's answer, grouped by what fixes it (a choice's seed is the request's + j).
    keys: dict[AnswerKey, list[tuple[Outcome, int]]] = {}
    grammars, texts = {}, {}
    for o in todo:
        j = o.job
        views = [engine_view(j, tok, p) for p in range(len(j.prompts))]
        for index, *_ in o.answers():
            text, ids, grammar = views[index // j.n]
            fields = json.dumps({**j.fields, **sampling_fields(j, index % j.n)}, sort_keys=True)
            constraint = json.dumps(j.constraint, sort_keys=True)
            key = (j.kind, tuple(ids), j.max_tokens, j.ignore_eos, fields, j.echo_logprobs,
                   constraint, j.logprobs)  # fmt: skip
            keys.setdefault(key, []).append((o, index))
            grammars[key], texts[key] = grammar, text
    prompts, params = [], []
    for key, outs in keys.items():
        prompts.append(list(key[1]))
        # The key holds all that the job and choice set.
        first, index = outs[0]
        params.append(request_params(first.job, index % first.job.n, grammars[key]))
    want = []
    for i in range(0, len(prompts), args.max_running_requests):
        want += engine.generate(
            prompts[i : i + args.max_running_requests], params[i : i + args.max_running_requests]
        )
    engine.close()  # with --tp-size its other ranks leave with it
    bad = []
    for (key, outs), w, ids in zip(keys.items(), want, prompts, strict=True):
        if key[5]:  # echo: the prompt as sent, then the completion; the prompt's logprobs first
            w = {**w, "text": texts[key] + w["text"]}
        want_text, want_finish = offline_answer(outs[0][0].job, w["text"], w["finish_reason"])
        for o, choice in outs:
            _, text, finish = o.answers()[choice]
            scores_ok = choice > 0 or logprobs_match(o, w, len(ids) if key[5] else 0)
            if text != want_text or finish != want_finish or not scores_ok:
                bad.append(
                    {
                        "kind": key[0],
                        "stream": o.job.stream,
                        "prompt": texts[key][-80:],
                        "max_tokens": key[2],
                        "choice": f"{choice} of {o.job.num_choices} (n {o.job.n})",
                        "got": text,
                        "want": want_text,
                        "got_finish": finish,
                        "want_finish": want_finish,
                        "greedy": o.job.greedy,
                        "fields": json.loads(key[4]),
                        "echo": key[5],
                        "constraint": o.job.constraint,
                        "cached_tokens": o.cached_tokens,
                    }
                )
    return bad


def logprobs_match(o: Outcome, want: dict[str, Any], n_prompt: int) -> bool:
    """The server's logprobs entries of choice 0 equal the offline engine's, to 1e-4 (the two
    computed them in different batches): an echo's `n_prompt` prompt entries first (None for
    the first token), then one per generated token with its alternatives, as many as asked
    (a completion's by token text: fewer where two alternatives read the same)."""
    if o.job.logprobs is None:
        return True
    close = lambda a, b: abs(a - b) <= 1e-4  # noqa: E731
    got, tops = o.token_logprobs, o.top_values
    if len(got) != n_prompt + len(want["token_ids"]) or len(tops) != len(got):
        return False
    if n_prompt:
        ref = want["prompt_logprobs"]
        if got[0] is not None or ref[0] is not None:
            return False
        if not all(close(a, b) for a, b in zip(got[1:n_prompt], ref[1:], strict=True)):
            return False
    wanted = zip(got[n_prompt:], tops[n_prompt:], want["logprobs"], want["top_logprobs"])
    for value, alts, ref, ref_alts in wanted:
        if value is None or not close(value, ref):
            return False
        ref_values = [v for _, v in ref_alts]
        if o.job.kind == "chat" and len(alts) != len(ref_values):
            return False
        if len(alts) > len(ref_values) or (ref_values and not alts):
            return False
        # Each of the server's values is one of the engine's (both most likely first).
        rest = list(ref_values)
        for v in alts:
            hit = next((i for i, r in enumerate(rest) if close(v, r)), None)
            if hit is None:
                return False
            rest.pop(hit)
    return True


# ---- report -----------------------------------------------------------------------------------

STOP_FIELDS = {"stop", "stop_token_ids"}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 1)


def summarize(outcomes: list[Outcome], elapsed: float) -> dict[str, Any]:
    by = {
        s: [o for o in outcomes if o.status == s]
        for s in ("completed", "aborted", "rejected", "context_full", "error", "lost")
    }
    done = by["completed"]
    tokens = sum(o.completion_tokens for o in done)
    gaps = [g for o in done for g in o.chunk_gaps]
    return {
        "sent": len(outcomes),
        "completed": len(done),
        # Answers: one per choice (n of them per prompt).
        "completed_greedy": sum(o.job.num_choices for o in done if o.job.greedy),
        "completed_seeded": sum(
            o.job.num_choices for o in done if exact(o.job) and not o.job.greedy
        ),
        "completed_with_penalties": sum(bool(o.job.fields.keys() - STOP_FIELDS) for o in done),
        "completed_with_stop": sum(bool(o.job.fields.keys() & STOP_FIELDS) for o in done),
        "completed_echo_logprobs": sum(o.job.echo_logprobs for o in done),
        "completed_n_choices": sum(o.job.n > 1 for o in done),
        "completed_multi_prompt": sum(bool(o.job.more_prompts) for o in done),
        "completed_structured": sum(bool(o.job.constraint) for o in done),
        "answers_with_tool_calls": sum(f == "tool_calls" for o in done for *_, f in o.answers()),
        "completed_logprobs": sum(o.job.logprobs is not None for o in done),
        "aborted_by_client": len(by["aborted"]),
        "rejected_400_expected": len(by["rejected"]),
        "conversations_at_context_limit": len(by["context_full"]),
        "errors": len(by["error"]),
        "lost": len(by["lost"]),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / elapsed, 2) if elapsed else None,
        "requests_per_s": round(len(done) / elapsed, 3) if elapsed else None,
        "ttft_ms": {
            "p50": ms(pct([o.ttft for o in done if o.ttft is not None], 50)),
            "p99": ms(pct([o.ttft for o in done if o.ttft is not None], 99)),
        },
        "itl_ms": {
            "p50": ms(pct([o.tpot for o in done if o.tpot is not None], 50)),
            "p99": ms(pct([o.tpot for o in done if o.tpot is not None], 99)),
        },
        "chunk_gap_ms": {"p50": ms(pct(gaps, 50)), "p99": ms(pct(gaps, 99))},
        "error_details": [o.detail for o in by["error"] + by["lost"]][:20],
    }

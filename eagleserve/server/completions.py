"""The /v1/completions handler (plain JSON and server-sent events)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from eagleserve.messages import TokenOutput
from eagleserve.server.answers import CompletionChoice, CompletionResponse
from eagleserve.server.choices import ChoiceState, PromptScoring, usage_of
from eagleserve.server.protocol import CompletionRequest, now
from eagleserve.server.respond import Endpoint, respond, sse
from eagleserve.server.serving import ApiError, Serving, Tracker, call_id
from eagleserve.server.structured import output_constraint


def prompt_list(prompt: Any) -> list[Any]:
    """A completion's `prompt` field as a list of prompts, each a text or a list of ids."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def completion_prompts(serving: Serving, body: CompletionRequest) -> list[list[int]] | ApiError:
    """Each prompt's ids: text encoded with the tokenizer's special tokens unless told not to,
    token ids as sent; cut to the last `truncate_prompt_tokens`."""
    prompt = prompt_list(body.prompt)
    if not prompt:
        return ApiError(400, "the prompt is empty", "prompt")
    out: list[list[int]] = []
    for p in prompt:
        ids = serving.encode(p, body.add_special_tokens) if isinstance(p, str) else list(p)
        if isinstance(ids, ApiError):
            return ids
        ids = serving.truncated(ids, body)
        err = serving.check_prompt(ids, "prompt")
        if err is not None:
            return err
        out.append(ids)
    return out


def echo_texts(tok: Any, sent: list[Any], prompts: list[list[int]]) -> list[str]:
    """What echo shows of each prompt: a text as sent (as vLLM and SGLang echo it, a BOS the
    tokenizer added not in it), token ids decoded."""
    return [p if isinstance(p, str) else tok.decode(ids) for p, ids in zip(sent, prompts)]


def added_in_front(tok: Any, sent: list[Any], prompts: list[list[int]]) -> list[int]:
    """How many of each prompt's ids the tokenizer added in front of a text (not in its echo)."""
    return [len(ids) - len(tok.encode(p, add_special_tokens=False)) if isinstance(p, str) else 0
            for p, ids in zip(sent, prompts)]  # fmt: skip


async def create_completion(
    serving: Serving, body: CompletionRequest, request: Request
) -> Response:
    # Tokenizing (and echo's decoding) run in a thread: a multi-MB prompt takes seconds, and on
    # the event loop it would stall /health and every stream (the tokenizer releases the GIL).
    prompts = await asyncio.to_thread(completion_prompts, serving, body)
    if isinstance(prompts, ApiError):
        return prompts.response()
    grammar = await asyncio.to_thread(output_constraint, body)  # xgrammar parses: off the loop
    if isinstance(grammar, ApiError):
        return grammar.response()
    want_lp = body.logprobs is not None
    # echo + logprobs: the prompt tokens' logprobs too (OpenAI's legacy scoring API); vLLM's
    # prompt_logprobs: the same scores in vLLM's form.
    scored = body.echo and want_lp
    echo_top = body.logprobs or 0
    asked = [k for k in (echo_top if scored else None, body.prompt_logprobs) if k is not None]
    params = []
    for ids in prompts:
        p = serving.sampling_params(body, body.max_tokens, len(ids), body.logprobs,
                                    max(asked) if asked else None, grammar)  # fmt: skip
        if isinstance(p, ApiError):
            return p.response()
        params.append(p)
    tok = serving.tokenizer
    echoes = ["" for _ in prompts]
    hidden = [0 for _ in prompts]
    if body.echo and tok is not None:
        # A prompt cut short echoes as the model read it.
        cut = body.truncate_prompt_tokens is not None
        sent = prompts if cut else prompt_list(body.prompt)
        echoes = await asyncio.to_thread(echo_texts, tok, sent, prompts)
        if scored and body.add_special_tokens:
            hidden = await asyncio.to_thread(added_in_front, tok, sent, prompts)
    reqs = serving.make_reqs(prompts, params, body.n, body.stream, priority=body.priority)

    def make_choice(i: int, pi: int) -> ChoiceState:
        prompt = PromptScoring(prompts[pi], scored, echo_top, hidden[pi]) if asked else None
        return ChoiceState(i, pi, tok, params[pi], text_offset=len(echoes[pi]), prompt=prompt,
                           ids_as_tokens=bool(body.return_tokens_as_token_ids))  # fmt: skip

    tracker = Tracker(serving, "completions", reqs, make_choice, body.n)
    rid, model, created = call_id(request, "cmpl"), serving.model_name, now()  # one per call
    echo_pending = {c.index for c in tracker.ordered if scored}
    ids_asked = bool(body.return_token_ids)
    prompt_ids_pending = {c.index for c in tracker.ordered if ids_asked}

    def token_ids(c: ChoiceState, whole: bool = False) -> dict[str, list[int] | None]:
        """return_token_ids' fields of a choice: its prompt's ids (in a stream, with its first
        chunk) and its token ids (in a stream, the chunk's new ones)."""
        if not ids_asked:
            return {}
        first = whole or c.index in prompt_ids_pending
        prompt_ids_pending.discard(c.index)
        ids = c.token_ids if whole else c.unsent_token_ids()
        return {"prompt_token_ids": prompts[c.prompt_index] if first else None, "token_ids": ids}

    def response(choices: list[CompletionChoice], usage: Any = None) -> CompletionResponse:
        return CompletionResponse(id=rid, created=created, model=model, choices=choices,
                                  usage=usage)  # fmt: skip

    def event(choices: list[CompletionChoice]) -> str:
        """A stream chunk (with vLLM's continuous_usage_stats, the usage so far)."""
        return sse(response(choices, usage_of(tracker.ordered) if body.continuous_usage else None))

    def prelude() -> list[str]:
        # With prompt logprobs the echo waits for them: it goes with the choice's first event.
        return [
            event([CompletionChoice(index=c.index, text=echoes[c.prompt_index], **token_ids(c))])
            for c in tracker.ordered
            if echoes[c.prompt_index] and not scored
        ]

    def delta(c: ChoiceState, text: str, out: TokenOutput) -> str | None:
        if c.index in echo_pending and (out.prompt_logprobs is not None or c.finished):
            echo_pending.discard(c.index)
            text = echoes[c.prompt_index] + text
        elif not (text or c.finished or ((want_lp or ids_asked) and out.new_token_ids)):
            return None
        lp = c.completion_logprobs(only_new=True) if want_lp else None
        fr = c.finish_reason if c.finished else None
        return event([CompletionChoice(index=c.index, text=text, logprobs=lp, finish_reason=fr,
                                       **token_ids(c))])  # fmt: skip

    def whole() -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=c.index,
                text=echoes[c.prompt_index] + c.text,
                logprobs=c.completion_logprobs() if want_lp else None,
                finish_reason=c.finish_reason,
                prompt_logprobs=c.vllm_prompt_logprobs(body.prompt_logprobs or 0)
                if body.prompt_logprobs is not None
                else None,
                **token_ids(c, whole=True),
            )
            for c in tracker.ordered
        ]
        return response(choices, usage_of(tracker.ordered))

    endpoint = Endpoint(prelude, delta, lambda usage: sse(response([], usage)), whole)
    beams = serving.beam_search(reqs, body, body.logprobs)
    return await respond(serving, request, reqs, tracker, body, endpoint, beams)

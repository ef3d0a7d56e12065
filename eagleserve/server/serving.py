"""Turning API requests into engine requests, checking them, and running them."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from eagleserve.config import ServerArgs
from eagleserve.messages import GenerateReqInput, TokenOutput
from eagleserve.sampling_params import (
    SEED_BOUND,
    GrammarSpec,
    RequestError,
    SamplingParams,
    check_budget,
    check_prompt,
)
from eagleserve.server.beam_search import BeamSearchStream, BeamSettings
from eagleserve.server.choices import ChoiceState
from eagleserve.server.engine_client import CHOICE_SEP, EngineClient, RequestStream
from eagleserve.server.metrics import Metrics
from eagleserve.server.protocol import MAX_N, _SamplingFields, error_body, new_id
from eagleserve.server.request_log import finished_line, received_line
from eagleserve.server.request_log import logger as request_log
from eagleserve.server.tool_formats import TOOL_FORMATS, ToolFormat

T = TypeVar("T")


@dataclass
class ApiError:
    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def response_body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.response_body(), status_code=self.status)


def api_error(err: RequestError | None) -> ApiError | None:
    """A failed core check as the 400 the API answers."""
    return None if err is None else ApiError(400, err.message, err.param, err.code)


def call_id(request: Request, prefix: str) -> str:
    """An API call's id: `prefix-` and its X-Request-Id (server/middleware.py), as vLLM names
    it, else a new one."""
    request_id = getattr(request.state, "request_id", None)
    return f"{prefix}-{request_id}" if request_id else new_id(prefix)


async def wait_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (call after the body was read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Serving:
    """What the endpoints share: the engine client, the tokenizer, limits and metrics."""

    def __init__(self, args: ServerArgs, client: EngineClient, metrics: Metrics) -> None:
        self.args = args
        self.client = client
        self.metrics = metrics
        self.model_name = args.served_model_name or args.model

    @property
    def tokenizer(self) -> Any:
        return self.client.tokenizer

    @property
    def tool_format(self) -> ToolFormat:
        return TOOL_FORMATS[self.args.tool_call_parser.lower()]

    def check_model(self, name: str | None) -> ApiError | None:
        if name is None or name in (self.model_name, self.args.model):
            return None
        msg = f"The model `{name}` does not exist; this server serves `{self.model_name}`."
        return ApiError(404, msg, "model", "model_not_found")

    def check_priority(self, priority: int | None) -> ApiError | None:
        if priority and not self.args.enable_priority_scheduling:
            msg = ("priority must be 0: this server serves requests first come, first served "
                   "(start it with --enable-priority-scheduling)")  # fmt: skip
            return ApiError(400, msg, "priority")
        return None

    def encode(self, text: str, add_special_tokens: bool) -> list[int] | ApiError:
        if self.tokenizer is None:
            return ApiError(400, "this model has no tokenizer: send token ids", "prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def beam_search(
        self, reqs: list[GenerateReqInput], body: _SamplingFields, logprobs: int | None
    ) -> BeamSearchStream | None:
        """vLLM's beam search over `reqs` (n choices a prompt: its beams) when `body` asks for
        it, with `logprobs` alternatives a token in the answer; else None."""
        if not body.use_beam_search:
            return None
        eos = None if body.ignore_eos else getattr(self.tokenizer, "eos_token_id", None)
        settings = BeamSettings(body.n, eos, body.length_penalty, logprobs)
        return BeamSearchStream(self.client, reqs, settings)

    def truncated(self, ids: list[int], body: _SamplingFields) -> list[int]:
        """vLLM's truncate_prompt_tokens: only the prompt's last k ids (left truncation)."""
        k = body.truncate_prompt_tokens
        return ids if k is None else ids[-k:]

    def check_prompt(self, ids: list[int], param: str) -> ApiError | None:
        vocab = self.client.ready.vocab_size if self.client.ready else 0
        return api_error(check_prompt(ids, self.client.max_context_len, vocab, param))

    def sampling_params(
        self,
        body: _SamplingFields,
        max_tokens: int | None,
        prompt_len: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        grammar: GrammarSpec | None = None,
    ) -> SamplingParams | ApiError:
        if not 1 <= body.n <= MAX_N:
            return ApiError(400, f"n must be between 1 and {MAX_N}", "n")
        if (bad := self.check_priority(body.priority)) is not None:
            return bad
        ctx, unset = self.client.max_context_len, self.client.sampling_defaults
        new = max_tokens
        if new is None:  # the rest of the context, or less where the model's defaults say so
            new = min(ctx - prompt_len, unset.max_new_tokens or ctx)
        over = api_error(check_budget(prompt_len, new, ctx))
        if over is not None:
            return over
        params = SamplingParams(
            max_new_tokens=new,
            temperature=unset.temperature if body.temperature is None else body.temperature,
            top_p=unset.top_p if body.top_p is None else body.top_p,
            top_k=unset.top_k if body.top_k is None else (-1 if body.top_k == 0 else body.top_k),
            min_p=unset.min_p if body.min_p is None else body.min_p,
            seed=body.seed,
            stop=body.stop_list,
            include_stop_str_in_output=body.include_stop_str_in_output or body.no_stop_trim,
            skip_special_tokens=body.skip_special_tokens,
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=(
                unset.repetition_penalty
                if body.repetition_penalty is None
                else body.repetition_penalty
            ),
            min_tokens=body.min_tokens or 0,
            # Keys are token ids (validation.py checked their form).
            logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()},
            grammar=grammar,
            allowed_token_ids=body.allowed_token_ids,
            bad_words=list(body.bad_words or []),
            cache_salt=body.cache_salt,
        )
        vocab = self.client.ready.vocab_size if self.client.ready else 0
        return api_error(params.validate(vocab)) or params

    def make_reqs(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        n: int,
        stream: bool,
        rids: list[str] | None = None,
        priority: int = 0,
    ) -> list[GenerateReqInput]:
        """n requests per prompt (choice index = prompt * n + j); seeds j apart, mod 2^63.
        Request ids: `rids`' (one per prompt; choice j of n > 1 is `rid#j`), else fresh ones.
        `priority`: every request's (priority scheduling)."""
        reqs = []
        for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
            for j in range(n):
                seed = None if p.seed is None else (p.seed + j) % SEED_BOUND
                sp = SamplingParams(**{**p.__dict__, "seed": seed, "stop": list(p.stop)})
                rid = f"req-{uuid.uuid4().hex}" if rids is None else rids[i]
                rid = rid if rids is None or n == 1 else f"{rid}{CHOICE_SEP}{j}"
                reqs.append(GenerateReqInput(rid, list(ids), sp, stream, priority))
        return reqs


# What a call's outputs come from: the engine's requests, or vLLM's beam search over them.
OutputStream = RequestStream | BeamSearchStream


class Tracker:
    """Feeds outputs to their choices and records latency / token metrics of one API call."""

    def __init__(
        self,
        serving: Serving,
        endpoint: str,
        reqs: list[GenerateReqInput],
        make_choice: Callable[[int, int], ChoiceState],
        n: int,
    ) -> None:
        self.serving = serving
        self.endpoint = endpoint
        self.choices = {r.rid: make_choice(i, i // n) for i, r in enumerate(reqs)}
        self.start = self.last = time.monotonic()
        self.first_token = False
        self.error: ApiError | None = None
        self.log_level = serving.args.log_requests_level if serving.args.log_requests else None
        if self.log_level is not None:
            for r in reqs:
                request_log.info(received_line(self.log_level, endpoint, r, serving.tokenizer))

    def feed(self, out: TokenOutput) -> tuple[ChoiceState, str]:
        m = self.serving.metrics
        choice = self.choices[out.rid]
        if out.error is not None:
            self.error = ApiError(out.error_code or 500, out.error)
        now = time.monotonic()
        n_new = len(out.new_token_ids)
        if n_new:
            if not self.first_token:
                m.ttft.observe(now - self.start)
                self.first_token = True
            else:
                for _ in range(n_new):
                    m.itl.observe((now - self.last) / n_new)
            self.last = now
            m.generation_tokens.inc(n_new)
        if choice.prompt_tokens == 0 and out.prompt_tokens:
            m.prompt_tokens.inc(out.prompt_tokens)
        if out.queue_time_s is not None and out.prefill_time_s is not None:
            m.queue_time.observe(out.queue_time_s)
            m.prefill_time.observe(out.prefill_time_s)
        delta = choice.feed(out)
        if out.finished and out.finish_reason == "abort":  # the shutdown's cut, or /abort_request
            m.request_aborted(self.endpoint, "shutdown" if out.error else "abort_request")
        elif out.finished:
            reason = choice.finish_reason or "unknown"
            m.request_finished(
                self.endpoint, reason, choice.prompt_tokens, choice.completion_tokens
            )
        if out.finished and self.log_level is not None:
            counts = (choice.prompt_tokens, choice.completion_tokens, choice.cached_tokens)
            request_log.info(finished_line(self.log_level, out.rid, choice.finish_reason, counts,
                                           now - self.start, choice.text))  # fmt: skip
        return choice, delta

    def close(self, stream: OutputStream) -> None:
        """Ends the API call however it ended (idempotent): choices that had not finished were
        aborted, because the client went away or a sibling choice failed; the engine is told
        to drop them."""
        if stream.closed:
            return
        reason = "client_disconnected" if self.error is None else "error"
        for c in self.choices.values():
            if not c.finished:
                self.serving.metrics.request_aborted(self.endpoint, reason)
        stream.close()

    def done(self) -> None:
        self.serving.metrics.e2e.observe(time.monotonic() - self.start)

    @property
    def ordered(self) -> list[ChoiceState]:
        return sorted(self.choices.values(), key=lambda c: c.index)


async def collect(stream: OutputStream, tracker: Tracker) -> None:
    async for out in stream:
        tracker.feed(out)
        if tracker.error is not None:
            return


async def unless_client_leaves(request: Request, aw: Awaitable[T]) -> asyncio.Future[T] | None:
    """Awaits `aw` unless the client closes the connection first (then `aw` is cancelled):
    its finished task, or None if the client left first."""
    work = asyncio.ensure_future(aw)
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            task.cancel()  # a finished task stays as it finished
        await asyncio.gather(work, gone, return_exceptions=True)
    return work if work.done() and not work.cancelled() else None


async def run_to_end(request: Request, stream: OutputStream, tracker: Tracker) -> bool:
    """Runs every request to the end; aborts them if the client leaves first. True if done."""
    try:
        done = await unless_client_leaves(request, collect(stream, tracker))
    finally:
        tracker.close(stream)
    tracker.done()
    return done is not None

"""The /v1/completions and /v1/chat/completions handlers (plain JSON and server-sent events)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from eagleserve.messages import GenerateReqInput, TokenOutput
from eagleserve.sampling_params import GrammarSpec
from eagleserve.server.choices import ChoiceState, usage_of
from eagleserve.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    new_id,
    now,
)
from eagleserve.server.serving import ApiError, Serving, Tracker, run_to_end
from eagleserve.server.structured import checked, output_constraint
from eagleserve.server.tool_calls import (
    ToolSetup,
    render_calls,
    tool_answer,
    tool_grammar,
    tool_prompt,
    tool_setup,
)

CLIENT_CLOSED = 499


class AbortingStreamingResponse(StreamingResponse):
    """Runs `on_close` however the response ends (finished, client gone, cancelled)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(obj: Any) -> str:
    data = obj.model_dump() if hasattr(obj, "model_dump") else obj
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


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
    # echo + logprobs: the prompt tokens' logprobs too (OpenAI's legacy scoring API).
    scored = body.echo and want_lp
    params = []
    for ids in prompts:
        p = serving.sampling_params(body, body.max_tokens, len(ids), body.logprobs,
                                    body.logprobs if scored else None, grammar)  # fmt: skip
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
    reqs = serving.make_reqs(prompts, params, body.n, body.stream)

    def make_choice(i: int, pi: int) -> ChoiceState:
        return ChoiceState(i, pi, tok, params[pi], text_offset=len(echoes[pi]),
                           prompt_ids=prompts[pi] if scored else None,
                           prompt_hidden=hidden[pi])  # fmt: skip

    tracker = Tracker(serving, "completions", reqs, make_choice, body.n)
    rid, model, created = new_id("cmpl"), serving.model_name, now()  # one `created` per call
    echo_pending = {c.index for c in tracker.ordered if scored}

    def response(choices: list[CompletionChoice], usage: Any = None) -> CompletionResponse:
        return CompletionResponse(id=rid, created=created, model=model, choices=choices,
                                  usage=usage)  # fmt: skip

    def prelude() -> list[str]:
        # With prompt logprobs the echo waits for them: it goes with the choice's first event.
        return [
            sse(response([CompletionChoice(index=c.index, text=echoes[c.prompt_index])]))
            for c in tracker.ordered
            if echoes[c.prompt_index] and not scored
        ]

    def delta(c: ChoiceState, text: str, out: TokenOutput) -> str | None:
        if c.index in echo_pending and (out.prompt_logprobs is not None or c.finished):
            echo_pending.discard(c.index)
            text = echoes[c.prompt_index] + text
        elif not (text or c.finished or (want_lp and out.new_token_ids)):
            return None
        lp = c.completion_logprobs(only_new=True) if want_lp else None
        fr = c.finish_reason if c.finished else None
        return sse(response([CompletionChoice(index=c.index, text=text, logprobs=lp,
                                              finish_reason=fr)]))  # fmt: skip

    def whole() -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=c.index,
                text=echoes[c.prompt_index] + c.text,
                logprobs=c.completion_logprobs() if want_lp else None,
                finish_reason=c.finish_reason,
            )
            for c in tracker.ordered
        ]
        return response(choices, usage_of(tracker.ordered))

    endpoint = Endpoint(prelude, delta, lambda usage: sse(response([], usage)), whole)
    return await respond(serving, request, reqs, tracker, body, endpoint)


def chat_messages(body: ChatCompletionRequest, tools: ToolSetup | None) -> list[dict[str, str]]:
    """The conversation as the template takes it: earlier tool calls written out in the
    tool-call format, and the tools described in the system message."""
    msgs = []
    for m in body.messages:
        text = m.text()
        if m.tool_calls:
            text = (text + "\n" if text else "") + render_calls(m.tool_calls)
        msgs.append({"role": m.role, "content": text})
    if tools is not None:
        if msgs[0]["role"] in ("system", "developer"):
            msgs[0]["content"] += "\n\n" + tool_prompt(tools)
        else:
            msgs.insert(0, {"role": "system", "content": tool_prompt(tools)})
    return msgs


# Arguments of apply_chat_template that chat_template_kwargs must not set (the request's own
# fields, or ones that would change what the call returns).
RESERVED_TEMPLATE_ARGS = frozenset({"conversation", "messages", "tools", "tokenize",
                                    "add_generation_prompt", "continue_final_message",
                                    "return_dict", "return_tensors", "chat_template"})  # fmt: skip


def chat_text(tok: Any, body: ChatCompletionRequest, tools: ToolSetup | None) -> str | ApiError:
    """The conversation rendered by the model's chat template, as the request asks (the
    assistant turn's header, or its last message left open; the template's own variables)."""
    if not body.messages:
        return ApiError(400, "messages must not be empty", "messages")
    if tok is None or not getattr(tok, "chat_template", None):
        return ApiError(400, "this model has no chat template: use /v1/completions", "messages")
    if body.continue_final_message and body.add_generation_prompt:
        msg = "continue_final_message needs add_generation_prompt false"
        return ApiError(400, msg, "continue_final_message")
    if body.continue_final_message and body.messages[-1].role != "assistant":
        msg = "continue_final_message continues the last message, which must be the assistant's"
        return ApiError(400, msg, "continue_final_message")
    extra = body.chat_template_kwargs or {}
    reserved = sorted(RESERVED_TEMPLATE_ARGS.intersection(extra))
    if reserved:
        return ApiError(400, f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs")
    msgs = chat_messages(body, tools)
    try:
        return str(tok.apply_chat_template(msgs, add_generation_prompt=body.add_generation_prompt,
                                           continue_final_message=body.continue_final_message,
                                           tokenize=False, **extra))  # fmt: skip
    except Exception as exc:  # a template may reject a conversation (e.g. role order)
        return ApiError(400, f"the chat template rejected the messages: {exc}", "messages")


def chat_prompt(
    serving: Serving, body: ChatCompletionRequest, tools: ToolSetup | None = None
) -> list[int] | ApiError:
    text = chat_text(serving.tokenizer, body, tools)
    if isinstance(text, ApiError):
        return text
    ids = serving.encode(text, body.add_special_tokens)
    if isinstance(ids, ApiError):
        return ids
    ids = serving.truncated(ids, body)
    err = serving.check_prompt(ids, "messages")
    return err if err is not None else ids


def chat_constraint(
    body: ChatCompletionRequest, tools: ToolSetup | None
) -> GrammarSpec | ApiError | None:
    grammar = output_constraint(body)
    if tools is None or isinstance(grammar, ApiError):
        return grammar
    if grammar is not None:
        return ApiError(400, "tools cannot be combined with another output constraint", "tools")
    return checked(tool_grammar(tools), "tools")


async def create_chat(serving: Serving, body: ChatCompletionRequest, request: Request) -> Response:
    tools = tool_setup(body)
    if isinstance(tools, ApiError):
        return tools.response()
    ids = await asyncio.to_thread(chat_prompt, serving, body, tools)  # off the loop: as above
    if isinstance(ids, ApiError):
        return ids.response()
    grammar = await asyncio.to_thread(chat_constraint, body, tools)
    if isinstance(grammar, ApiError):
        return grammar.response()
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens
    top = body.top_logprobs or 0
    params = serving.sampling_params(body, max_tokens, len(ids), top if body.logprobs else None,
                                     grammar=grammar)  # fmt: skip
    if isinstance(params, ApiError):
        return params.response()
    reqs = serving.make_reqs([ids], [params], body.n, body.stream)
    tok = serving.tokenizer

    def make_choice(i: int, pi: int) -> ChoiceState:
        return ChoiceState(i, pi, tok, params)

    tracker = Tracker(serving, "chat", reqs, make_choice, body.n)
    rid, model = new_id("chatcmpl"), serving.model_name
    created = now()

    def chunk(choices: list[ChatStreamChoice], usage: Any = None) -> str:
        return sse(
            ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=usage)
        )

    def prelude() -> list[str]:
        role = ChatDelta(role="assistant", content="")
        return [chunk([ChatStreamChoice(index=c.index, delta=role)]) for c in tracker.ordered]

    def answer(c: ChoiceState) -> tuple[str | None, list[dict[str, Any]], str | None]:
        """(content, tool calls, finish reason) of a finished choice."""
        if tools is None:
            return c.text, [], c.finish_reason
        return tool_answer(c.text, c.finish_reason)

    def delta(c: ChoiceState, text: str, out: TokenOutput) -> str | None:
        calls: list[dict[str, Any]] = []
        reason = c.finish_reason
        if tools is not None:  # with tools the text is parsed whole: one delta at the end
            if not c.finished:
                return None
            text, calls, reason = answer(c)  # type: ignore[assignment]
        lp = c.chat_logprobs(only_new=True) if body.logprobs else None
        if not (text or c.finished or (lp is not None and lp.content)):
            return None
        d = ChatDelta(
            content=text or None,
            tool_calls=[{"index": k, **call} for k, call in enumerate(calls)] or None,
        )
        return chunk([ChatStreamChoice(index=c.index, delta=d, logprobs=lp,
                                       finish_reason=reason)])  # fmt: skip

    def whole() -> ChatCompletionResponse:
        choices = []
        for c in tracker.ordered:
            content, calls, reason = answer(c)
            message = ChatResponseMessage(content=content, tool_calls=calls or None)
            lp = c.chat_logprobs() if body.logprobs else None
            choices.append(ChatChoice(index=c.index, message=message, logprobs=lp,
                                      finish_reason=reason))  # fmt: skip
        return ChatCompletionResponse(
            id=rid, created=created, model=model, choices=choices, usage=usage_of(tracker.ordered)
        )

    endpoint = Endpoint(prelude, delta, lambda usage: chunk([], usage), whole)
    return await respond(serving, request, reqs, tracker, body, endpoint)


@dataclass
class Endpoint:
    """What differs between the two OpenAI handlers; `respond` is the path they share."""

    prelude: Callable[[], list[str]]  # SSE events before any token (echo, the role)
    delta: Callable[[ChoiceState, str, TokenOutput], str | None]  # new text -> an SSE event
    usage_event: Callable[[Any], str]  # the usage chunk of `stream_options.include_usage`
    whole: Callable[[], Any]  # the non-streamed response body (a pydantic model)


async def respond(
    serving: Serving,
    request: Request,
    reqs: list[GenerateReqInput],
    tracker: Tracker,
    body: CompletionRequest | ChatCompletionRequest,
    endpoint: Endpoint,
) -> Response:
    """Runs the requests; answers one JSON body, or a stream of chunks ending in [DONE] (an
    engine fault or a cut at shutdown ends it with an error event first)."""
    stream = serving.client.generate(reqs)
    if not body.stream:
        if not await run_to_end(request, stream, tracker):
            return Response(status_code=CLIENT_CLOSED)
        if tracker.error is not None:
            return tracker.error.response()
        return JSONResponse(endpoint.whole().model_dump())

    async def events() -> AsyncIterator[str]:
        for event in endpoint.prelude():
            yield event
        async for out in stream:
            c, text = tracker.feed(out)
            if tracker.error is not None:  # engine fault, engine gone, or cut at the drain
                yield sse(tracker.error.response_body())
                yield "data: [DONE]\n\n"
                return
            event = endpoint.delta(c, text, out)
            if event is not None:
                yield event
        tracker.done()
        if body.include_usage:
            yield endpoint.usage_event(usage_of(tracker.ordered))
        yield "data: [DONE]\n\n"

    return AbortingStreamingResponse(events(), lambda: tracker.close(stream))

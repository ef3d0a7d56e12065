"""The /v1/chat/completions handler (plain JSON and server-sent events): the conversation
through the model's chat template, tools and their calls."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from eagleserve.messages import GenerateReqInput, TokenOutput
from eagleserve.sampling_params import GrammarSpec, ThinkingGate
from eagleserve.server.answers import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    ChatStreamChoice,
)
from eagleserve.server.choices import ChoiceState, PromptScoring, usage_of
from eagleserve.server.protocol import ChatCompletionRequest, now
from eagleserve.server.reasoning import (
    ReasoningFormat,
    ReasoningStream,
    reasoning_format,
    single_token,
    split_reasoning,
)
from eagleserve.server.respond import Endpoint, respond, sse
from eagleserve.server.serving import ApiError, Serving, Tracker, call_id
from eagleserve.server.structured import checked, constraint_fields, output_constraint
from eagleserve.server.tool_calls import (
    ToolSetup,
    opener_is_special,
    template_messages,
    template_takes_tools,
    template_tools,
    tool_answer,
    tool_grammar,
    tool_setup,
)
from eagleserve.server.tool_formats import HERMES, ToolFormat

# Arguments of apply_chat_template that chat_template_kwargs must not set (the request's own
# fields, or ones that would change what the call returns).
RESERVED_TEMPLATE_ARGS = frozenset({"conversation", "messages", "tools", "tokenize",
                                    "add_generation_prompt", "continue_final_message",
                                    "return_dict", "return_tensors", "chat_template"})  # fmt: skip


def chat_text(
    tok: Any, body: ChatCompletionRequest, tools: ToolSetup | None, fmt: ToolFormat = HERMES
) -> str | ApiError:
    """The conversation rendered by the model's chat template, as the request asks (the
    assistant turn's header, or its last message left open; the template's own variables),
    with its tools and earlier calls (server/tool_calls.py; `fmt` the calls' format)."""
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
    if body.reasoning_effort is not None:  # as vLLM: the template's own variable
        extra = {"reasoning_effort": body.reasoning_effort, **extra}
    templated = template_takes_tools(tok)
    msgs = template_messages(body, tools, fmt, templated)
    if templated and tools is not None:
        extra = {**extra, "tools": template_tools(tools)}
    try:
        return str(tok.apply_chat_template(msgs, add_generation_prompt=body.add_generation_prompt,
                                           continue_final_message=body.continue_final_message,
                                           tokenize=False, **extra))  # fmt: skip
    except Exception as exc:  # a template may reject a conversation (e.g. role order)
        return ApiError(400, f"the chat template rejected the messages: {exc}", "messages")


def chat_prompt(
    serving: Serving, body: ChatCompletionRequest, tools: ToolSetup | None = None
) -> list[int] | ApiError:
    text = chat_text(serving.tokenizer, body, tools, serving.tool_format)
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


@dataclass(frozen=True)
class ChatAnswer:
    """A finished choice as the chat formats give it."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str | None
    reasoning: str | None = None  # the thinking, with --reasoning-parser


@dataclass
class ChatCall:
    """A chat request ready to run: its engine requests (n per conversation), the tracker of
    their choices, its tool calling (None: free text) and the reasoning format its answers are
    split by (None: not split)."""

    body: ChatCompletionRequest
    tools: ToolSetup | None
    reqs: list[GenerateReqInput]
    tracker: Tracker
    reasoning: ReasoningFormat | None = None

    @property
    def streams_text(self) -> bool:
        """Whether the answer's text can go out as it comes (else it is parsed whole)."""
        return self.tools is None

    def answer(self, c: ChoiceState) -> ChatAnswer:
        """A finished choice's thinking (sent only where asked), content and tool calls."""
        thinking, text = None, c.text
        if self.reasoning is not None:
            thinking, text = split_reasoning(self.reasoning, c.text)
            thinking = thinking if self.body.include_reasoning else None
        if self.tools is None:
            return ChatAnswer(text, [], c.finish_reason, thinking)
        content, calls, reason = tool_answer(text or "", c.finish_reason, self.tools.fmt)
        return ChatAnswer(content, calls, reason, thinking)


def reasoning_split(serving: Serving, body: ChatCompletionRequest) -> ReasoningFormat | None:
    """The format the answers are split by: the server's parser, unless the request turns
    the split off (SGLang's separate_reasoning)."""
    parser = serving.args.reasoning_parser
    return reasoning_format(parser) if parser and body.separate_reasoning else None


def thinking_gate(
    tokenizer: Any, fmt: ReasoningFormat, body: ChatCompletionRequest, tools: ToolSetup | None
) -> ThinkingGate | ApiError | None:
    """Where a split request's grammar starts: after the thinking, where the format's tags are
    tokens of the model (vLLM's rule: the thinking stays free); else a constraint over the
    whole output is a 400 (it would leave no room to think, and the answer would land in the
    thinking), and tool_choice auto runs ungated (its calls are free text until their tag)."""
    end = single_token(tokenizer, fmt.end)
    start = None if fmt.thinks_first else single_token(tokenizer, fmt.start)
    if end is not None and (fmt.thinks_first or start is not None):
        return ThinkingGate(end, start)
    fields = constraint_fields(body)
    if tools is not None and tools.choice != "auto":
        fields.append("tool_choice")
    if not fields:
        return None
    msg = (f"{fields[0]} cannot wait for the thinking to end: this model's {fmt.end} is no "
           "single token (send separate_reasoning false to constrain the whole "
           "output)")  # fmt: skip
    return ApiError(400, msg, fields[0])


async def start_chat(
    serving: Serving, body: ChatCompletionRequest, endpoint: str
) -> ChatCall | ApiError:
    """The conversation's prompt, constraint and sampling parameters, as engine requests whose
    outputs `endpoint`'s tracker records (the Responses API runs its requests through here)."""
    tools = tool_setup(body, serving.tool_format)
    if isinstance(tools, ApiError):
        return tools
    ids = await asyncio.to_thread(chat_prompt, serving, body, tools)  # off the loop: as above
    if isinstance(ids, ApiError):
        return ids
    grammar = await asyncio.to_thread(chat_constraint, body, tools)
    if isinstance(grammar, ApiError):
        return grammar
    reasoning = reasoning_split(serving, body)
    gate = None
    if reasoning is not None and grammar is not None:
        gate = thinking_gate(serving.tokenizer, reasoning, body, tools)
        if isinstance(gate, ApiError):
            return gate
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens
    top = body.top_logprobs or 0
    params = serving.sampling_params(body, max_tokens, len(ids), top if body.logprobs else None,
                                     body.prompt_logprobs, grammar)  # fmt: skip
    if isinstance(params, ApiError):
        return params
    params.thinking = gate
    if tools is not None and opener_is_special(serving.tokenizer, tools.fmt):
        params.skip_special_tokens = False  # else the detokenizer drops what opens each call
    reqs = serving.make_reqs([ids], [params], body.n, body.stream, priority=body.priority)
    tok = serving.tokenizer
    scoring = None if body.prompt_logprobs is None else PromptScoring(ids)

    def make_choice(i: int, pi: int) -> ChoiceState:
        return ChoiceState(i, pi, tok, params, prompt=scoring,
                           ids_as_tokens=bool(body.return_tokens_as_token_ids))  # fmt: skip

    tracker = Tracker(serving, endpoint, reqs, make_choice, body.n)
    return ChatCall(body, tools, reqs, tracker, reasoning)


async def create_chat(serving: Serving, body: ChatCompletionRequest, request: Request) -> Response:
    call = await start_chat(serving, body, "chat")
    if isinstance(call, ApiError):
        return call.response()
    reqs, tracker, answer = call.reqs, call.tracker, call.answer
    rid, model = call_id(request, "chatcmpl"), serving.model_name
    created = now()

    ids_asked = bool(body.return_token_ids)  # vLLM's: the prompt's ids and each choice's
    prompt_ids = reqs[0].input_ids if ids_asked else None

    def chunk(choices: list[ChatStreamChoice], usage: Any = None, first: bool = False) -> str:
        """A stream chunk (with vLLM's continuous_usage_stats, the usage so far); the `first`
        has the prompt's ids when they are asked for."""
        if usage is None and choices and body.continuous_usage:
            usage = usage_of(tracker.ordered)
        return sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=choices,
                                       usage=usage, prompt_token_ids=prompt_ids if first
                                       else None))  # fmt: skip

    def prelude() -> list[str]:
        role = ChatDelta(role="assistant", content="")
        return [chunk([ChatStreamChoice(index=c.index, delta=role)], first=i == 0)
                for i, c in enumerate(tracker.ordered)]  # fmt: skip

    # Each choice's thinking apart from its answer, as it streams (--reasoning-parser).
    splits = {c.index: ReasoningStream(call.reasoning) for c in tracker.ordered
              if call.reasoning is not None}  # fmt: skip

    def delta(c: ChoiceState, text: str, out: TokenOutput) -> str | None:
        calls: list[dict[str, Any]] = []
        reason, thinking = c.finish_reason, ""
        if not call.streams_text:  # with tools the text is parsed whole: one delta at the end
            if not c.finished:
                return None
            a = answer(c)
            text, calls, reason, thinking = (
                a.content or "",
                a.tool_calls,
                a.finish_reason,
                a.reasoning or "",
            )
        elif c.index in splits:
            thinking, text = splits[c.index].feed(text)
            if c.finished:
                rest = splits[c.index].flush()
                thinking, text = thinking + rest[0], text + rest[1]
            thinking = thinking if body.include_reasoning else ""
        lp = c.chat_logprobs(only_new=True) if body.logprobs else None
        new_ids = ids_asked and len(c.token_ids) > c.ids_sent
        if not (text or thinking or c.finished or (lp is not None and lp.content) or new_ids):
            return None
        d = ChatDelta(
            content=text or None,
            reasoning_content=thinking or None,
            tool_calls=[{"index": k, **call} for k, call in enumerate(calls)] or None,
        )
        ids = c.unsent_token_ids() if ids_asked else None
        return chunk([ChatStreamChoice(index=c.index, delta=d, logprobs=lp,
                                       finish_reason=reason, token_ids=ids)])  # fmt: skip

    def whole() -> ChatCompletionResponse:
        choices = []
        for c in tracker.ordered:
            a = answer(c)
            message = ChatResponseMessage(content=a.content, tool_calls=a.tool_calls or None,
                                          reasoning_content=a.reasoning)  # fmt: skip
            lp = c.chat_logprobs() if body.logprobs else None
            ids = c.token_ids if ids_asked else None
            choices.append(ChatChoice(index=c.index, message=message, logprobs=lp,
                                      finish_reason=a.finish_reason, token_ids=ids))  # fmt: skip
        scores = None  # vLLM's: the conversation's, once for the n choices
        if body.prompt_logprobs is not None:
            scores = tracker.ordered[0].vllm_prompt_logprobs(body.prompt_logprobs)
        usage = usage_of(tracker.ordered)
        return ChatCompletionResponse(id=rid, created=created, model=model, choices=choices,
                                      usage=usage, prompt_logprobs=scores,
                                      prompt_token_ids=prompt_ids)  # fmt: skip

    endpoint = Endpoint(prelude, delta, lambda usage: chunk([], usage), whole)
    beams = serving.beam_search(reqs, body, (body.top_logprobs or 0) if body.logprobs else None)
    return await respond(serving, request, reqs, tracker, body, endpoint, beams)

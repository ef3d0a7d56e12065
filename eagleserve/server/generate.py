"""SGLang's native `POST /generate`: a prompt as text or token ids (or a batch of either) with
SGLang's `sampling_params`, answered in SGLang's form (`text`, `output_ids`, `meta_info`, with
`return_logprob` SGLang's logprob fields); streamed, each event holds the answer so far, as
SGLang's do: the form `sglang.bench_serving --backend sglang` and RL rollouts (reading
`output_token_logprobs`) read.

Its sampling_params are checked strictly (an unknown key is a 400 naming it, as SGLang's
`SamplingParams(**params)` refuses it); what changes the output and is not implemented
(images, LoRA, custom logit processors, hidden states, ...) is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, RootModel

from eagleserve.messages import TokenOutput
from eagleserve.sampling_params import GrammarSpec, SamplingParams, check_budget
from eagleserve.server.choices import MIN_LOGPROB, ChoiceState, PromptScoring
from eagleserve.server.detokenizer import token_strings
from eagleserve.server.engine_client import CHOICE_SEP
from eagleserve.server.protocol import MAX_N
from eagleserve.server.respond import Endpoint, respond, sse
from eagleserve.server.serving import ApiError, Serving, Tracker
from eagleserve.server.structured import checked, structural_tag_spec
from eagleserve.server.vllm_fields import guided_spec


class NativeSamplingParams(BaseModel):
    """SGLang's sampling_params (its defaults: 128 new tokens, temperature 1)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_new_tokens: int = Field(128, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)  # -1 and 0: off
    min_p: float = Field(0.0, ge=0, le=1)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    min_new_tokens: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=MAX_N)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None  # xgrammar's form, or SGLang's structures and triggers
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # the stop string or token stays in the text
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    # SGLang's, refused unless neutral (SAMPLING_REFUSED).
    spaces_between_special_tokens: bool = True
    custom_params: Any = None


GENERATE_EXAMPLES = [
    {"text": "The capital of France is", "sampling_params": {"temperature": 0,
                                                            "max_new_tokens": 8}},
    {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": {"max_new_tokens": 4, "n": 2,
     "sampling_seed": 3, "regex": "[0-9]+", "frequency_penalty": 0.5}},
]  # fmt: skip


class GenerateRequest(BaseModel):
    # The schema says what the route checks: exactly one of text and input_ids.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, json_schema_extra={
        "examples": GENERATE_EXAMPLES,
        "oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}],
    })  # fmt: skip

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    # Logprobs in SGLang's form: the generated tokens', and the prompt's from logprob_start_len
    # (-1: none of the prompt's), with top_logprobs_num alternatives each.
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)
    top_logprobs_num: int = Field(0, ge=0, le=20)
    return_text_in_logprobs: bool = False
    priority: int | None = None  # with --enable-priority-scheduling (every prompt's)
    # SGLang's, refused unless neutral (NATIVE_REFUSED).
    input_embeds: Any = None
    image_data: Any = None
    audio_data: Any = None
    lora_path: Any = None
    custom_logit_processor: Any = None
    return_hidden_states: bool | list[bool] = False
    token_ids_logprob: Any = None

    @property
    def include_usage(self) -> bool:  # respond()'s: SGLang's answers carry their own counts
        return False


class GenerateResponse(BaseModel):
    """One answer (a batch, or n > 1, answers a list of them; a streamed batch's events carry
    their `index`). meta_info: id, finish_reason ({"type": "stop", "matched": ...} or
    {"type": "length", "length": ...}), prompt_tokens, completion_tokens, cached_tokens,
    e2e_latency (seconds), spec_accept_length under speculation."""

    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]
    index: int | None = None


class AbortRequest(BaseModel):
    """SGLang's /abort_request body: a request's id (its meta_info id, or the rid it was
    sent with), or every request in flight."""

    model_config = ConfigDict(extra="ignore")

    rid: str = ""
    abort_all: bool = False


class AbortResult(BaseModel):
    aborted: int  # requests ended


class GenerateAnswer(RootModel[GenerateResponse | list[GenerateResponse]]):
    """The 200 body of /generate (the OpenAPI document's)."""


# Fields that change the output and eagleserve does not implement here: a 400 unless unset.
NATIVE_REFUSED = (
    "input_embeds", "image_data", "audio_data", "lora_path",
    "custom_logit_processor", "return_hidden_states", "token_ids_logprob",
)  # fmt: skip
# sampling_params' refused fields and their neutral values.
SAMPLING_REFUSED = (("custom_params", None), ("spaces_between_special_tokens", True))


def is_set(value: Any) -> bool:
    """Whether a refused field asks for something (a list: for some prompt)."""
    return any(value) if isinstance(value, list) else value not in (None, False)


def refused(body: GenerateRequest) -> ApiError | None:
    for name in NATIVE_REFUSED:
        if is_set(getattr(body, name)):
            return ApiError(400, f"{name} is not supported by this server's /generate", name,
                            "unsupported_parameter")  # fmt: skip
    for sp in sampling_list(body, 1):
        for name, neutral in SAMPLING_REFUSED:
            if getattr(sp, name) != neutral:
                param = f"sampling_params.{name}"
                msg = f"{param} is not supported by this server; only {json.dumps(neutral)} is"
                return ApiError(400, msg, param, "unsupported_parameter")
    return None


def sampling_list(body: GenerateRequest, n_prompts: int) -> list[NativeSamplingParams]:
    sp = body.sampling_params
    if isinstance(sp, list):
        return sp
    return [sp or NativeSamplingParams()] * n_prompts


def native_prompts(serving: Serving, body: GenerateRequest) -> list[list[int]] | ApiError:
    """Each prompt's ids: text encoded with the tokenizer's special tokens (as SGLang does),
    token ids as sent."""
    if (body.text is None) == (body.input_ids is None):
        return ApiError(400, "give exactly one of text and input_ids", "text")
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        prompts: list[list[int]] = []
        for t in texts:
            ids = serving.encode(t, True)
            if isinstance(ids, ApiError):
                return ids
            prompts.append(ids)
        param = "text"
    else:
        ids_in: list[Any] = list(body.input_ids or [])
        prompts = [list(p) for p in ids_in] if ids_in and isinstance(ids_in[0], list) else [ids_in]
        param = "input_ids"
    if not prompts:
        return ApiError(400, f"{param} is an empty batch", param)
    for ids in prompts:
        err = serving.check_prompt(ids, param)
        if err is not None:
            return err
    return prompts


# SamplingParams' error params -> SGLang's names.
PARAM_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens",
               "seed": "sampling_seed"}  # fmt: skip


def native_params(
    serving: Serving, body: GenerateRequest, sp: NativeSamplingParams, prompt_len: int
) -> SamplingParams | ApiError:
    given = [(name, v) for name, v in (("json_schema", sp.json_schema), ("regex", sp.regex),
                                       ("ebnf", sp.ebnf), ("structural_tag", sp.structural_tag))
             if v is not None]  # fmt: skip
    if len(given) > 1:
        param = f"sampling_params.{given[1][0]}"
        return ApiError(400, f"{given[0][0]} and {given[1][0]} cannot be combined", param)
    grammar: GrammarSpec | None = None
    if given:
        name, value = given[0]
        if name == "json_schema":
            spec = guided_spec("guided_json", value)
        elif name == "structural_tag":
            spec = structural_tag_spec(value)
        else:
            spec = GrammarSpec("regex" if name == "regex" else "ebnf", value)
        if isinstance(spec, str):
            return ApiError(400, f"{name}: {spec}", f"sampling_params.{name}")
        spec_or_err = checked(spec, f"sampling_params.{name}")
        if isinstance(spec_or_err, ApiError):
            return spec_or_err
        grammar = spec_or_err
    for key in sp.logit_bias or {}:
        if not (key.isascii() and key.isdigit()):
            return ApiError(400, "logit_bias keys must be token ids", "sampling_params.logit_bias")
    params = SamplingParams(
        max_new_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p,
        top_k=-1 if sp.top_k == 0 else sp.top_k, min_p=sp.min_p, seed=sp.sampling_seed,
        stop=[sp.stop] if isinstance(sp.stop, str) else list(sp.stop or []),
        include_stop_str_in_output=sp.no_stop_trim, skip_special_tokens=sp.skip_special_tokens,
        stop_token_ids=list(sp.stop_token_ids or []), ignore_eos=sp.ignore_eos,
        presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty, min_tokens=sp.min_new_tokens,
        logit_bias={int(k): v for k, v in (sp.logit_bias or {}).items()}, grammar=grammar,
        logprobs=body.top_logprobs_num if body.return_logprob else None,
        prompt_logprobs=body.top_logprobs_num if scores_prompt(body) else None,
    )  # fmt: skip
    vocab = serving.client.ready.vocab_size if serving.client.ready else 0
    bad = params.validate(vocab) or check_budget(
        prompt_len, params.max_new_tokens, serving.client.max_context_len
    )
    if bad is None:
        return params
    param = f"sampling_params.{PARAM_NAMES.get(bad.param or '', bad.param)}"
    return ApiError(400, bad.message, param, bad.code)


def scores_prompt(body: GenerateRequest) -> bool:
    return body.return_logprob and body.logprob_start_len >= 0


def triples(
    tokenizer: Any, entries: list[tuple[float | None, int]], with_text: bool
) -> list[list[Any]]:
    """SGLang's logprob entries: [logprob, token id, its text or None]."""
    texts: list[str | None] = [None] * len(entries)
    if with_text:
        texts = list(token_strings(tokenizer, [t for _, t in entries]))
    return [[None if v is None else max(v, MIN_LOGPROB), t, text]
            for (v, t), text in zip(entries, texts, strict=True)]  # fmt: skip


def sglang_logprobs(c: ChoiceState, body: GenerateRequest) -> dict[str, Any]:
    """meta_info's logprob fields: input_token_logprobs (the prompt's from logprob_start_len,
    the first token's None), output_token_logprobs, and with top_logprobs_num their
    alternatives per position (input_top_logprobs, output_top_logprobs)."""
    tok, text, k = c.tokenizer, body.return_text_in_logprobs, body.top_logprobs_num
    out = [(v, t) for t, _, v, _ in c.logprobs]
    meta: dict[str, Any] = {"output_token_logprobs": triples(tok, out, text)}
    prompt_in: list[tuple[float | None, int]] = []
    prompt_top: list[list[Any] | None] = []
    if c.prompt is not None and c.prompt_scores is not None:
        s, start = c.prompt_scores, body.logprob_start_len
        prompt_in = list(zip(s.logprobs[start:], c.prompt.ids[start:], strict=True))
        scored = zip(s.logprobs[start:], s.top[start:], strict=True)
        prompt_top = [None if v is None else triples(tok, [(a, t) for t, a in top[:k]], text)
                      for v, top in scored]  # fmt: skip
    meta["input_token_logprobs"] = triples(tok, prompt_in, text)
    if k:
        meta["input_top_logprobs"] = prompt_top
        meta["output_top_logprobs"] = [triples(tok, [(a, t) for t, a in top], text)
                                       for _, _, _, top in c.logprobs]  # fmt: skip
    return meta


def request_ids(
    serving: Serving, body: GenerateRequest, n_prompts: int, n: int
) -> list[str] | None | ApiError:
    """The client's request ids, one per prompt (SGLang's `rid`; /abort_request takes them),
    or None (fresh ones). An id already in flight is a 400."""
    if body.rid is None:
        return None
    rids = [body.rid] if isinstance(body.rid, str) else body.rid
    if len(rids) != n_prompts:
        return ApiError(400, f"rid has {len(rids)} ids for {n_prompts} prompts", "rid")
    if len(set(rids)) < len(rids) or any(not r or CHOICE_SEP in r for r in rids):
        return ApiError(400, f"rid must be distinct non-empty ids without {CHOICE_SEP!r}", "rid")
    live = [r for r in rids if r in serving.client.queues
            or any(q.startswith(r + CHOICE_SEP) for q in serving.client.queues)]  # fmt: skip
    if live:
        return ApiError(400, f"rid {live[0]!r} is in flight", "rid")
    return rids


def finish_reason(c: ChoiceState) -> dict[str, Any] | None:
    """SGLang's finish_reason: {"type": "stop", "matched": the stop string or id},
    {"type": "length", "length": max_new_tokens} or {"type": "abort"} (/abort_request)."""
    if not c.finished:
        return None
    if c.finish_reason == "length":
        return {"type": "length", "length": c.params.max_new_tokens}
    if c.finish_reason == "abort":
        return {"type": "abort", "message": "aborted by /abort_request"}
    return {"type": "stop", "matched": c.matched_stop}


async def create_generate(serving: Serving, body: GenerateRequest, request: Request) -> Response:
    err = refused(body) or serving.check_priority(body.priority)
    if err is not None:
        return err.response()
    prompts = await asyncio.to_thread(native_prompts, serving, body)  # off the event loop
    if isinstance(prompts, ApiError):
        return prompts.response()
    samplings = sampling_list(body, len(prompts))
    if len(samplings) != len(prompts):
        msg = f"sampling_params has {len(samplings)} entries for {len(prompts)} prompts"
        return ApiError(400, msg, "sampling_params").response()
    if len({sp.n for sp in samplings}) > 1:
        return ApiError(400, "n must be the same for every prompt", "sampling_params.n").response()
    n = samplings[0].n
    params = []
    for ids, sp in zip(prompts, samplings, strict=True):
        p = await asyncio.to_thread(native_params, serving, body, sp, len(ids))  # xgrammar parses
        if isinstance(p, ApiError):
            return p.response()
        params.append(p)
    rids = request_ids(serving, body, len(prompts), n)
    if isinstance(rids, ApiError):
        return rids.response()
    reqs = serving.make_reqs(prompts, params, n, body.stream, rids, body.priority or 0)
    tok = serving.tokenizer

    def make_choice(i: int, pi: int) -> ChoiceState:
        prompt = PromptScoring(prompts[pi]) if scores_prompt(body) else None
        return ChoiceState(i, pi, tok, params[pi], prompt=prompt)

    tracker = Tracker(serving, "generate", reqs, make_choice, n)
    start = time.monotonic()
    batch = not (len(prompts) == 1 and n == 1)

    def answer(c: ChoiceState) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": reqs[c.index].rid, "finish_reason": finish_reason(c),
            "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "cached_tokens": c.cached_tokens, "e2e_latency": time.monotonic() - start,
        }  # fmt: skip
        if c.spec_accept_length is not None:
            meta["spec_accept_length"] = c.spec_accept_length
        if body.return_logprob:
            meta |= sglang_logprobs(c, body)
        index = c.index if batch and body.stream else None
        out = GenerateResponse(text=c.text, output_ids=c.token_ids, meta_info=meta, index=index)
        return out.model_dump(exclude_none=True)

    def delta(c: ChoiceState, text: str, out: TokenOutput) -> str | None:
        return sse(answer(c)) if text or c.finished or out.new_token_ids else None

    def whole() -> Any:
        answers = [answer(c) for c in tracker.ordered]
        return answers if batch else answers[0]

    endpoint = Endpoint(lambda: [], delta, lambda usage: "", whole)
    return await respond(serving, request, reqs, tracker, body, endpoint)

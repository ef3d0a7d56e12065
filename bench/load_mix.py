"""The request mix of bench/load.py: what each simulated client sends (completions and chat,
streamed and not, greedy and sampled, short and long prompts, penalties, stop strings, structured
output and tool calls, logprobs, echo + logprobs, hang-ups, requests that can never fit), the
chat turns of --multi-turn conversations, and what the server makes of a request
(`engine_view`), which the offline checks replay."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eagleserve import SamplingParams
    from eagleserve.sampling_params import GrammarSpec

TOPICS = [
    "the sea",
    "a lighthouse",
    "prime numbers",
    "bread",
    "autumn",
    "a robot",
    "the moon",
    "trains",
    "chess",
    "volcanoes",
    "bees",
    "a library",
    "rain",
    "mountains",
    "jazz",
]
STARTS = [
    "Write a short poem about",
    "Explain in two sentences",
    "Tell me a fact about",
    "Describe",
    "List three things about",
    "Once upon a time, near",
]
# Stop strings: common in English (SmolLM2's answers), single characters (a tiny test model's).
STOPS = ["\n\n", ".", " the", ",", "e", " "]
BAD_WORDS = ["the", "and", "is", "a", "The", "to", "of", "in"]  # vLLM's bad_words
# Output constraints: OpenAI's response_format, SGLang's regex, chat tools (the server's formats).
SCHEMAS = [
    {"type": "object", "required": ["name", "age"],
     "properties": {"name": {"type": "string", "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    {"type": "object", "required": ["answer"],
     "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                    "tags": {"type": "array", "maxItems": 3,
                             "items": {"type": "string", "maxLength": 8}}}},
]  # fmt: skip
REGEXES = [r"(yes|no|maybe)[a-z ]{0,24}\.", r"[0-9]{1,4}(, [0-9]{1,4}){0,5}"]
TOOLS = [
    {"type": "function", "function": {
        "name": "weather", "description": "Today's weather in a city.",
        "parameters": {"type": "object", "required": ["city"],
                       "properties": {"city": {"type": "string", "maxLength": 12}}}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the library.",
        "parameters": {"type": "object", "required": ["query"],
                       "properties": {"query": {"type": "string", "maxLength": 16},
                                      "limit": {"type": "integer", "maximum": 5}}}}},
]  # fmt: skip
FILLER = (
    "The committee met on a grey morning to review the harbour plans, the budget for the "
    "new bridge, the school timetable and the library's opening hours. "
)


@dataclass
class Job:
    """One request a client sends."""

    kind: str  # "completion" | "chat"
    stream: bool
    greedy: bool
    prompt: str
    max_tokens: int
    ignore_eos: bool = False
    disconnect_after: int | None = None  # stream only: hang up after this many chunks
    never_fits: bool = False  # prompt + max_tokens > context: must get a 400
    seed: int | None = None
    history: list[dict[str, str]] = field(default_factory=list)  # chat: messages before prompt
    # Penalties, min_tokens, logit_bias, stop (API names and values), sent as they are.
    fields: dict[str, Any] = field(default_factory=dict)
    echo_logprobs: bool = False  # completion with echo + logprobs: the prompt is scored too
    logprobs: int | None = None  # logprobs asked for, with this many top alternatives
    n: int = 1  # choices (OpenAI's n): choice j samples with seed + j, as the server seeds it
    sampler: dict[str, Any] = field(default_factory=dict)  # sampled: temperature, top_p/k, min_p
    # response_format, regex or tools (+ tool_choice, parallel_tool_calls), sent as they are.
    constraint: dict[str, Any] = field(default_factory=dict)
    # Completions: more prompts in the request's list; choice index = prompt * n + j.
    more_prompts: list[str] = field(default_factory=list)

    @property
    def prompts(self) -> list[str]:
        return [self.prompt, *self.more_prompts]

    @property
    def num_choices(self) -> int:
        return self.n * len(self.prompts)

    @property
    def tools(self) -> bool:
        return "tools" in self.constraint


def make_job(rng: random.Random, args: argparse.Namespace, ctx: int) -> Job:
    kind = "chat" if rng.random() < 0.4 else "completion"
    long = rng.random() < args.long_share
    topic = rng.choice(TOPICS)
    prompt = f"{rng.choice(STARTS)} {topic} (#{rng.randrange(1000)})."
    if long:
        prompt = FILLER * rng.randint(*args.long_repeats) + prompt
    job = Job(
        kind=kind,
        stream=rng.random() < 0.5,
        greedy=rng.random() < 0.6,
        prompt=prompt,
        max_tokens=rng.randint(args.max_tokens // 2, args.long_max_tokens)
        if long
        else rng.randint(4, args.max_tokens),
        ignore_eos=long,
        seed=rng.randrange(1 << 16) if rng.random() < 0.5 else None,
        sampler=sampler_fields(rng),
    )
    if rng.random() < args.penalty_share:
        job.fields = penalty_fields(rng, job.max_tokens)
    if rng.random() < args.stop_share:
        job.fields["stop"] = rng.sample(STOPS, rng.randint(1, 2))
        if rng.random() < 0.3:  # low ids: inside any vocabulary
            job.fields["stop_token_ids"] = rng.sample(range(200), rng.randint(1, 3))
    if rng.random() < args.disconnect_share:
        job.stream, job.disconnect_after = True, rng.randint(1, 3)
        job.max_tokens = max(job.max_tokens, 32)
    elif rng.random() < 0.03:
        job.never_fits, job.max_tokens = True, ctx  # any prompt + ctx tokens > ctx
    elif rng.random() < args.echo_share:
        job.kind, job.greedy, job.echo_logprobs, job.logprobs = "completion", True, True, 1
        job.max_tokens = rng.choice([0, 0, 1, 4, 8])
        job.fields.pop("min_tokens", None)
    elif rng.random() < args.n_share:
        job.n = rng.randint(2, 3)
    if job.kind == "completion" and not job.never_fits and rng.random() < args.multi_prompt_share:
        job.more_prompts = [f"{rng.choice(STARTS)} {rng.choice(TOPICS)} (#{rng.randrange(1000)})."
                            for _ in range(rng.randint(1, 2))]  # fmt: skip
    if job.logprobs is None and rng.random() < args.logprobs_share:
        job.logprobs = rng.randint(0, 3)
    if rng.random() < args.structured_share:
        job.constraint = constraint_fields(rng, job.kind == "chat" and not long, ctx)
        job.fields.pop("min_tokens", None)  # the server refuses it with a constraint (a 400)
        if job.tools:  # room for a call or two
            job.max_tokens = max(job.max_tokens, 64)
    return job


def constraint_fields(rng: random.Random, tools_fit: bool, ctx: int) -> dict[str, Any]:
    """An output constraint: JSON (any object or a schema), a regex, or tools where they fit
    (a chat with a short prompt; one tool's description in a context under 2,048 tokens)."""
    which = rng.choice(["json_object", "json_schema", "regex"] + ["tools"] * tools_fit)
    if which == "json_object":
        return {"response_format": {"type": "json_object"}}
    if which == "json_schema":
        payload = {"name": "answer", "schema": rng.choice(SCHEMAS)}
        return {"response_format": {"type": "json_schema", "json_schema": payload}}
    if which == "regex":
        return {"regex": rng.choice(REGEXES)}
    tools = rng.sample(TOOLS, 1 if ctx < 2048 else rng.randint(1, len(TOOLS)))
    named = {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
    return {"tools": tools, "tool_choice": rng.choice(["auto", "required", named]),
            "parallel_tool_calls": rng.random() < 0.5}  # fmt: skip


def sampler_fields(rng: random.Random) -> dict[str, Any]:
    """A sampled request's temperature and filters: top_p, sometimes top_k or min_p."""
    out: dict[str, Any] = {"temperature": rng.choice([0.6, 0.8, 1.0, 1.3]),
                           "top_p": rng.choice([1.0, 0.95, 0.8])}  # fmt: skip
    if rng.random() < 0.3:
        out["top_k"] = rng.randint(1, 40)
    if rng.random() < 0.3:
        out["min_p"] = rng.choice([0.02, 0.1, 0.3])
    return out


def penalty_fields(rng: random.Random, max_tokens: int) -> dict[str, Any]:
    """A random subset of the penalty fields (OpenAI's ranges), sometimes with vLLM's
    bad_words and allowed_token_ids; bias keys are low token ids, inside any vocabulary."""
    every = {
        "presence_penalty": round(rng.uniform(-2, 2), 3),
        "frequency_penalty": round(rng.uniform(-2, 2), 3),
        "repetition_penalty": round(rng.uniform(0.7, 1.8), 3),
        "min_tokens": rng.randint(0, max_tokens),
        "logit_bias": {str(rng.randrange(200)): round(rng.uniform(-100, 100), 1)
                       for _ in range(rng.randint(1, 4))},
    }  # fmt: skip
    out = {k: v for k, v in every.items() if rng.random() < 0.6}
    if rng.random() < 0.3:  # vLLM's output constraints beside the penalties
        out["bad_words"] = rng.sample(BAD_WORDS, rng.randint(1, 3))
    if rng.random() < 0.15:  # low ids past the usual EOS ids: inside any vocabulary
        out["allowed_token_ids"] = rng.sample(range(3, 200), rng.randint(20, 120))
    return out


def request_body(job: Job, model: str) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": model, "max_tokens": job.max_tokens, "stream": job.stream}
    if job.n > 1:
        body["n"] = job.n
    body.update(sampling_fields(job))
    if job.ignore_eos:
        body["ignore_eos"] = True
    if job.stream:
        body["stream_options"] = {"include_usage": True}
    body.update(job.fields)
    body.update(job.constraint)
    if job.echo_logprobs:
        body["echo"] = True
    if job.logprobs is not None and job.kind == "chat":
        body.update(logprobs=True, top_logprobs=job.logprobs)
    elif job.logprobs is not None:
        body["logprobs"] = job.logprobs
    if job.kind == "chat":
        body["messages"] = messages_of(job)
        return "/v1/chat/completions", body
    body["prompt"] = job.prompts if job.more_prompts else job.prompt
    return "/v1/completions", body


def sampling_fields(job: Job, choice: int = 0) -> dict[str, Any]:
    """The temperature of the request's `choice`, and its filters and seed (maybe None) when it
    samples."""
    if job.greedy:
        return {"temperature": 0.0}
    seed = None if job.seed is None else job.seed + choice
    return {**job.sampler, "seed": seed}


def engine_view(
    job: Job, tokenizer: Any, prompt: int = 0
) -> tuple[str, list[int], GrammarSpec | None]:
    """The text of the job's `prompt`-th prompt (a chat's rendered by the template, tools
    described in its system message), its ids as the server encodes it, and the output
    constraint the server makes of the job's request body, by the server's own translation."""
    from eagleserve.server.chat import chat_constraint, chat_text
    from eagleserve.server.protocol import ChatCompletionRequest, CompletionRequest
    from eagleserve.server.serving import ApiError
    from eagleserve.server.structured import output_constraint
    from eagleserve.server.tool_calls import tool_setup

    _, body = request_body(job, "model")
    if job.kind != "chat":
        completion = CompletionRequest(**body)
        grammar = output_constraint(completion)
        assert not isinstance(grammar, ApiError), grammar.message
        text = job.prompts[prompt]
        ids = tokenizer.encode(text, add_special_tokens=completion.add_special_tokens)
        return text, ids, grammar
    req = ChatCompletionRequest(**body)
    tools = tool_setup(req)
    assert not isinstance(tools, ApiError), tools.message
    grammar = chat_constraint(req, tools)
    assert not isinstance(grammar, ApiError), grammar.message
    text = chat_text(tokenizer, req, tools)
    assert not isinstance(text, ApiError), text.message
    return text, tokenizer.encode(text, add_special_tokens=req.add_special_tokens), grammar


def request_params(job: Job, choice: int = 0, grammar: GrammarSpec | None = None) -> SamplingParams:
    """The SamplingParams the server makes of the job's request body (`request_body`) for its
    `choice`, given its output constraint (`engine_view`)."""
    from eagleserve import SamplingParams

    fields = {**job.fields, **sampling_fields(job, choice)}
    fields["logit_bias"] = {int(t): b for t, b in fields.get("logit_bias", {}).items()}
    return SamplingParams(max_new_tokens=job.max_tokens, ignore_eos=job.ignore_eos,
                          logprobs=job.logprobs,
                          prompt_logprobs=1 if job.echo_logprobs else None, grammar=grammar,
                          **fields)  # fmt: skip


def messages_of(job: Job) -> list[dict[str, str]]:
    return [*job.history, {"role": "user", "content": job.prompt}]


SYSTEM_PROMPTS = [
    "You are a careful assistant. Answer in plain words and keep answers short.",
    "You are a poet who answers every question with a few lines of verse.",
]


def next_turn(rng: random.Random, args: argparse.Namespace, ctx: int, history: list) -> Job:
    """The next chat turn of a conversation (a new one when `history` is empty)."""
    job = make_job(rng, args, ctx)
    if job.echo_logprobs:  # prompt scoring is a completions feature: a plain turn instead
        job.echo_logprobs, job.logprobs, job.max_tokens = False, None, max(job.max_tokens, 4)
    if job.tools:  # an answer of tool calls would need a tool's reply: JSON instead
        job.constraint = {"response_format": {"type": "json_object"}}
    job.kind, job.more_prompts = "chat", []
    job.history = history or [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
    return job

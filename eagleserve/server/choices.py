"""Per-choice output state: text (through the detokenizer), logprobs, finish reason, usage."""

from __future__ import annotations

from typing import Any

from eagleserve.messages import TokenOutput
from eagleserve.sampling_params import SamplingParams
from eagleserve.scheduler.output_processor import text_ids
from eagleserve.server.detokenizer import IncrementalDetokenizer, token_strings
from eagleserve.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)


class ChoiceState:
    """One generated sequence. `feed` takes its TokenOutputs and returns the new text."""

    def __init__(
        self,
        index: int,
        prompt_index: int,
        tokenizer: Any,
        params: SamplingParams,
        text_offset: int = 0,
        prompt_ids: list[int] | None = None,
        prompt_hidden: int = 0,
    ) -> None:
        """`params`: the request's (its stop strings and how its text shows them);
        `prompt_ids`: the prompt whose logprobs come with the first output (echo), of which
        the first `prompt_hidden` (special tokens the tokenizer added) are not in its text."""
        self.index = index
        self.prompt_index = prompt_index
        self.tokenizer = tokenizer
        self.params = params
        self.detok = IncrementalDetokenizer(
            tokenizer, params.stop, params.skip_special_tokens, params.min_tokens,
            params.include_stop_str_in_output,
        )  # fmt: skip
        self.text = ""
        self.finish_reason: str | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.spec_accept_length: float | None = None
        # Logprobs: (token string, logprob, top alternatives as (string, logprob)).
        self.lp: list[tuple[str, float, list[tuple[str, float]]]] = []
        self.lp_sent = 0  # entries of `lp` already streamed
        self.text_offset = text_offset  # completion logprobs: offset of the first token
        self.prompt_ids = prompt_ids
        self.prompt_hidden = prompt_hidden
        # Prompt logprobs (echo): (token string, logprob or None for the first, alternatives);
        # handed out once, before the generated tokens' entries.
        self.prompt_lp: list[tuple[str, float | None, list[tuple[str, float]]]] = []
        self.prompt_lp_sent = False

    def feed(self, out: TokenOutput) -> str:
        if out.prompt_logprobs is not None and self.prompt_ids is not None:
            names = token_strings(self.tokenizer, self.prompt_ids)
            tops = out.prompt_top_logprobs or [[] for _ in names]
            for name, value, top in zip(names, out.prompt_logprobs, tops, strict=True):
                self.prompt_lp.append((name, value, self._alternatives(top)))
        finished_by = out.matched_stop if out.finished else None
        delta = self.detok.add(text_ids(out.new_token_ids, finished_by, self.params))
        if out.logprobs is not None:
            names = token_strings(self.tokenizer, out.new_token_ids)
            tops = out.top_logprobs or [[] for _ in names]
            for name, value, top in zip(names, out.logprobs, tops, strict=False):
                self.lp.append((name, value, self._alternatives(top)))
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.cached_tokens = out.cached_tokens or self.cached_tokens
        self.completion_tokens = out.completion_tokens or self.completion_tokens
        if out.spec_accept_length is not None:
            self.spec_accept_length = out.spec_accept_length
        if out.finished:
            delta += self.detok.finish()
            self.finish_reason = "stop" if self.detok.stopped else (out.finish_reason or "stop")
        self.text += delta
        return delta

    def _alternatives(self, top: list[tuple[int, float]]) -> list[tuple[str, float]]:
        alt_names = token_strings(self.tokenizer, [t for t, _ in top])
        return [(s, v) for s, (_, v) in zip(alt_names, top, strict=True)]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _take_lp(self, only_new: bool) -> list[tuple[str, float, list[tuple[str, float]]]]:
        start = self.lp_sent if only_new else 0
        self.lp_sent = len(self.lp)
        return self.lp[start:]

    def completion_logprobs(self, only_new: bool = False) -> CompletionLogprobs:
        """The prompt's entries first (echo; the first token has no logprob and no
        alternatives, as in OpenAI's answers), then the generated tokens'."""
        out = CompletionLogprobs()
        if not (only_new and self.prompt_lp_sent):
            prompt_offset = 0
            for i, (name, value, alts) in enumerate(self.prompt_lp):
                out.tokens.append(name)
                out.token_logprobs.append(value)
                out.top_logprobs.append(None if value is None else dict(alts))
                out.text_offset.append(prompt_offset)
                if i >= self.prompt_hidden:  # a hidden token takes no room in the echo
                    prompt_offset += len(name)
            self.prompt_lp_sent = bool(self.prompt_lp)
        start = self.lp_sent if only_new else 0
        offset = self.text_offset + sum(len(name) for name, _, _ in self.lp[:start])
        for name, value, alts in self._take_lp(only_new):
            out.tokens.append(name)
            out.token_logprobs.append(value)
            out.top_logprobs.append(dict(alts))
            out.text_offset.append(offset)
            offset += len(name)
        return out

    def chat_logprobs(self, only_new: bool = False) -> ChatLogprobs:
        content = [
            ChatTokenLogprob(
                token=name,
                logprob=value,
                bytes=list(name.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(token=s, logprob=v, bytes=list(s.encode("utf-8"))) for s, v in alts
                ],
            )
            for name, value, alts in self._take_lp(only_new)
        ]
        return ChatLogprobs(content=content)


def usage_of(choices: list[ChoiceState]) -> UsageInfo:
    """Prompt tokens once per prompt (n choices share it); completion tokens of every choice."""
    prompts: dict[int, int] = {}
    cached: dict[int, int] = {}
    for c in choices:
        prompts[c.prompt_index] = max(prompts.get(c.prompt_index, 0), c.prompt_tokens)
        cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.cached_tokens)
    prompt = sum(prompts.values())
    completion = sum(c.completion_tokens for c in choices)
    spec = [c.spec_accept_length for c in choices if c.spec_accept_length is not None]
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached.values())),
        spec_accept_length=sum(spec) / len(spec) if spec else None,
    )

"""Per-choice output state: text (through the detokenizer), logprobs, finish reason, usage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagleserve.messages import PromptScores, TokenOutput
from eagleserve.sampling_params import SamplingParams
from eagleserve.scheduler.output_processor import text_ids
from eagleserve.server.answers import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from eagleserve.server.detokenizer import IncrementalDetokenizer, token_strings

# vLLM's floor for a logprob in an answer (JSON has no -inf).
MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class PromptScoring:
    """A choice's prompt, whose scores come with its first output: shown as vLLM's
    prompt_logprobs and, with `echo`, as the first entries of the echo's logprobs (`top`
    alternatives each; the first `hidden` tokens, special tokens the tokenizer added, take no
    room in the echoed text)."""

    ids: list[int]
    echo: bool = False
    top: int = 0
    hidden: int = 0


class ChoiceState:
    """One generated sequence. `feed` takes its TokenOutputs and returns the new text."""

    def __init__(
        self,
        index: int,
        prompt_index: int,
        tokenizer: Any,
        params: SamplingParams,
        text_offset: int = 0,
        prompt: PromptScoring | None = None,
        ids_as_tokens: bool = False,
    ) -> None:
        """`params`: the request's (its stop strings and how its text shows them); `prompt`:
        its prompt, when the first output brings the prompt's scores; `ids_as_tokens`:
        logprobs name tokens `token_id:N` (vLLM's return_tokens_as_token_ids), not by text."""
        self.index = index
        self.prompt_index = prompt_index
        self.tokenizer = tokenizer
        self.params = params
        self.detok = IncrementalDetokenizer(
            tokenizer, params.stop, params.skip_special_tokens, params.min_tokens,
            params.include_stop_str_in_output,
        )  # fmt: skip
        self.text = ""
        self.token_ids: list[int] = []
        self.ids_sent = 0  # entries of `token_ids` already streamed (return_token_ids)
        self.finish_reason: str | None = None
        self.matched_stop: int | str | None = None  # the stop string or id that ended it
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.spec_accept_length: float | None = None
        self.ids_as_tokens = ids_as_tokens
        # Logprobs of the generated tokens, when asked for: (token id, its text, logprob, top
        # alternatives as (id, logprob)); each answer format names them its own way.
        self.logprobs: list[tuple[int, str, float, list[tuple[int, float]]]] = []
        self.lp_sent = 0  # entries of `logprobs` already streamed
        self.text_offset = text_offset  # completion logprobs: offset of the first token
        # Tokens the text leaves out (skip_special_tokens): their entries take no room in it.
        self.unshown_ids = frozenset(
            getattr(tokenizer, "all_special_ids", ()) if params.skip_special_tokens else ()
        )
        self.prompt = prompt
        # The prompt's scores (with its first output); echo's entries go out once, first.
        self.prompt_scores: PromptScores | None = None
        self.prompt_lp_sent = False

    def _names(self, ids: list[int], texts: list[str] | None = None) -> list[str]:
        """How logprobs name tokens (`texts`: their texts, when known)."""
        if self.ids_as_tokens:
            return [f"token_id:{t}" for t in ids]
        return texts if texts is not None else token_strings(self.tokenizer, ids)

    def feed(self, out: TokenOutput) -> str:
        if out.prompt_logprobs is not None and self.prompt is not None:
            self.prompt_scores = out.prompt_logprobs
        finished_by = out.matched_stop if out.finished else None
        self.token_ids += out.new_token_ids
        delta = self.detok.add(text_ids(out.new_token_ids, finished_by, self.params))
        if out.logprobs is not None:
            texts = token_strings(self.tokenizer, out.new_token_ids)
            tops = out.top_logprobs or [[] for _ in texts]
            self.logprobs += zip(out.new_token_ids, texts, out.logprobs, tops, strict=False)
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.cached_tokens = out.cached_tokens or self.cached_tokens
        self.completion_tokens = out.completion_tokens or self.completion_tokens
        if out.spec_accept_length is not None:
            self.spec_accept_length = out.spec_accept_length
        if out.finished:
            self.matched_stop = out.matched_stop
            delta += self.detok.finish()
            self.finish_reason = "stop" if self.detok.stopped else (out.finish_reason or "stop")
        self.text += delta
        return delta

    def unsent_token_ids(self) -> list[int]:
        """The token ids not streamed yet (a stream's chunk takes them)."""
        ids, self.ids_sent = self.token_ids[self.ids_sent :], len(self.token_ids)
        return ids

    def _alternatives(self, top: list[tuple[int, float]]) -> list[tuple[str, float]]:
        alt_names = self._names([t for t, _ in top])
        return [(s, v) for s, (_, v) in zip(alt_names, top, strict=True)]

    def vllm_prompt_logprobs(self, k: int) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs: per prompt token, None for the first, else the token's own
        entry then its top `k` alternatives' (ranks 1..k), keyed by token id."""
        if self.prompt_scores is None or self.prompt is None:
            return None
        s, prompt = self.prompt_scores, self.prompt.ids
        ids = sorted({t for top in s.top for t, _ in top[:k]} | set(prompt))
        text_of = dict(zip(ids, token_strings(self.tokenizer, ids), strict=True))
        out: PromptLogprobs = []
        for token, value, rank, top in zip(prompt, s.logprobs, s.ranks, s.top, strict=True):
            if value is None:
                out.append(None)
                continue
            entry = {str(token): PromptLogprob(logprob=max(value, MIN_LOGPROB), rank=rank,
                                               decoded_token=text_of[token])}  # fmt: skip
            for j, (alt, alt_value) in enumerate(top[:k], start=1):
                entry.setdefault(
                    str(alt),
                    PromptLogprob(
                        logprob=max(alt_value, MIN_LOGPROB), rank=j, decoded_token=text_of[alt]
                    ),
                )
            out.append(entry)
        return out

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _take_lp(self, only_new: bool) -> list[tuple[str, float, list[tuple[str, float]]]]:
        """The generated tokens' entries (only those not streamed yet), named: (name,
        logprob, named alternatives)."""
        start = self.lp_sent if only_new else 0
        self.lp_sent = len(self.logprobs)
        entries = self.logprobs[start:]
        names = self._names([t for t, _, _, _ in entries], [text for _, text, _, _ in entries])
        return [(name, value, self._alternatives(top))
                for name, (_, _, value, top) in zip(names, entries, strict=True)]  # fmt: skip

    def completion_logprobs(self, only_new: bool = False) -> CompletionLogprobs:
        """The prompt's entries first (echo; the first token has no logprob and no
        alternatives, as in OpenAI's answers), then the generated tokens'."""
        out = CompletionLogprobs()
        echo = self.prompt if self.prompt is not None and self.prompt.echo else None
        if (
            echo is not None
            and self.prompt_scores is not None
            and not (only_new and self.prompt_lp_sent)
        ):
            s, texts = self.prompt_scores, token_strings(self.tokenizer, echo.ids)
            prompt_offset = 0
            for i, (name, text, value, top) in enumerate(zip(
                self._names(echo.ids, texts), texts, s.logprobs, s.top, strict=True
            )):  # fmt: skip
                out.tokens.append(name)
                out.token_logprobs.append(value)
                alts = self._alternatives(top[: echo.top])
                out.top_logprobs.append(None if value is None else dict(alts))
                out.text_offset.append(prompt_offset)
                if i >= echo.hidden:  # an added special token takes no room in the echo
                    prompt_offset += len(text)
            self.prompt_lp_sent = True
        start = self.lp_sent if only_new else 0
        offset = self.text_offset + sum(self._width(t, s) for t, s, _, _ in self.logprobs[:start])
        for (name, value, alts), (token, text, _, _) in zip(
            self._take_lp(only_new), self.logprobs[start:], strict=True
        ):  # fmt: skip
            out.tokens.append(name)
            out.token_logprobs.append(value)
            out.top_logprobs.append(dict(alts))
            out.text_offset.append(offset)
            offset += self._width(token, text)
        return out

    def _width(self, token: int, text: str) -> int:
        """How many characters of the answer's text a generated token takes."""
        return 0 if token in self.unshown_ids else len(text)

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

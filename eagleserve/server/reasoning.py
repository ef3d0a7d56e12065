"""`--reasoning-parser`: a reasoning model's thinking apart from its answer, as SGLang's and
vLLM's parsers of the same names give it: chat answers carry `reasoning_content` beside
`content` (streamed as deltas of each), and a response a `reasoning` item before its message.

A format is its two tags and whether the model thinks from its first token:
- `deepseek-r1`: DeepSeek-R1 and its distills (Llama, Qwen), whose templates open the thinking
  in the prompt: the output is thinking (a leading `<think>` dropped) up to `</think>`, the
  answer after it; with no `</think>` (cut by the length), all of it is thinking.
- `qwen3`: thinking only where the output opens with `<think>` (it may be switched off).
The split is of the text as generated: the stream's pieces join to the whole answer's parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    thinks_first: bool  # the output starts inside the thinking, tag or not


PARSERS = {
    "deepseek-r1": ReasoningFormat("<think>", "</think>", thinks_first=True),
    "qwen3": ReasoningFormat("<think>", "</think>", thinks_first=False),
}


def reasoning_format(name: str) -> ReasoningFormat:
    """The parser by SGLang's name or vLLM's (`deepseek_r1`); ValueError naming the known."""
    fmt = PARSERS.get(name.lower().replace("_", "-"))
    if fmt is None:
        raise ValueError(f"--reasoning-parser {name!r}: one of {', '.join(PARSERS)}")
    return fmt


def single_token(tokenizer: Any, text: str) -> int | None:
    """The id of the one token `text` encodes to (a reasoning model's tag), else None."""
    ids = tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else []
    return ids[0] if len(ids) == 1 else None


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str | None, str | None]:
    """(thinking, answer) of a whole output; None for a part it has none of."""
    thinking = fmt.thinks_first
    if text.startswith(fmt.start):
        text, thinking = text[len(fmt.start) :], True
    if not thinking:
        return None, text or None
    reasoning, sep, content = text.partition(fmt.end)
    return reasoning or None, (content or None) if sep else None


class ReasoningStream:
    """Splits an output streamed in pieces as `split_reasoning` splits it whole: a tag cut
    across pieces is held back until the next piece shows what it is."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self.state = "start"  # start (a leading tag may still come) | thinking | answer
        self.held = ""

    def feed(self, piece: str) -> tuple[str, str]:
        """(thinking, answer) text to send for this piece."""
        text, self.held = self.held + piece, ""
        if self.state == "start":
            if self.fmt.start.startswith(text):
                self.held = text  # maybe the leading tag: wait
                return "", ""
            if text.startswith(self.fmt.start):
                text, self.state = text[len(self.fmt.start) :], "thinking"
            else:
                self.state = "thinking" if self.fmt.thinks_first else "answer"
        if self.state == "answer":
            return "", text
        head, sep, tail = text.partition(self.fmt.end)
        if sep:
            self.state = "answer"
            return head, tail
        keep = next((k for k in range(len(self.fmt.end) - 1, 0, -1)
                     if text.endswith(self.fmt.end[:k])), 0)  # fmt: skip
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], ""

    def flush(self) -> tuple[str, str]:
        """What is still held once the output ended."""
        text, self.held = self.held, ""
        if self.state == "start":
            self.state = "thinking" if self.fmt.thinks_first else "answer"
            if text == self.fmt.start:
                return "", ""
        return (text, "") if self.state == "thinking" else ("", text)

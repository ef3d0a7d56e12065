"""Incremental detokenization for streaming.

`IncrementalDetokenizer.add(ids)` returns only text that is final: it never ends inside a
multi-byte UTF-8 character (a byte-level token may carry half an emoji), never repeats or drops
text, and holds back a tail that could be the start of a stop string. `finish()` flushes the
rest. Text is cut before the first stop string, as OpenAI does (after it with
`include_stop_str`, vLLM's include_stop_str_in_output); with `min_tokens`, only a stop
string that ends after the text of the first min_tokens tokens counts (the engine ignores
earlier ones too: scheduler/output_processor.py).
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
        include_stop_str: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str = include_stop_str
        self.min_tokens = min_tokens
        # Characters of `text` a stop string must end beyond (None: min_tokens not reached).
        self.stop_from: int | None = 0 if min_tokens <= 0 else None
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        # ids[prefix_offset:read_offset] were decoded already; decoding from prefix_offset keeps
        # tokenizers that strip a leading space (SentencePiece) consistent.
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # every complete character decoded so far
        self.sent = 0  # characters of `text` handed out
        self.stopped = False  # a stop string was seen: nothing more is handed out

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _advance(self, final: bool) -> None:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix):
            return
        if full.endswith(REPLACEMENT_CHAR) and not final:
            return  # the newest token ends inside a character: wait for its other bytes
        self.text += full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)

    def _holdback(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text) - self.sent), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        end = first = len(self.text)
        for s in self.stop if self.stop_from is not None else ():
            i = self.text.find(s, max(self.sent, self.stop_from - len(s) + 1))
            if i >= 0 and i < first:  # the first stop string to start ends the text
                first, end = i, i + len(s) if self.include_stop_str else i
                self.stopped = True
        if not self.stopped and not final:
            end -= self._holdback()
        delta = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta

    def add(self, new_ids: list[int]) -> str:
        """Takes the newest token ids; returns the text that became final (maybe "")."""
        if self.stop_from is None and len(self.ids) + len(new_ids) >= self.min_tokens:
            head = self.min_tokens - len(self.ids)
            self.ids.extend(new_ids[:head])
            self._advance(final=False)
            self.stop_from, new_ids = len(self.text), new_ids[head:]
        self.ids.extend(new_ids)
        self._advance(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """The request ended: returns everything not handed out yet (up to a stop string)."""
        self._advance(final=True)
        return self._release(final=True)


def token_strings(tokenizer: Any, ids: list[int]) -> list[str]:
    """One display string per token (for logprobs); partial characters show as U+FFFD."""
    if tokenizer is None:
        return [str(i) for i in ids]
    return [tokenizer.decode([i], clean_up_tokenization_spaces=False) for i in ids]

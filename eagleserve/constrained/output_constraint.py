"""A request's output constraint: what its next token may be, given the tokens it committed.

Three kinds, each a matcher with one interface (`accept`, `fill_paths`; grammar.py has the
invariant the workers keep): a grammar (xgrammar, structured output), vLLM's
`allowed_token_ids` (a fixed set) and vLLM's `bad_words` (a word's last token is banned where
the output so far ends with the rest of it). A request with several gets their intersection.
A reasoning model's grammar may wait for its thinking to end (`AfterThinking`).
A bitmask row is int32 words, bit b of word w allowing token 32 * w + b (grammar_mask.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from eagleserve.constrained.grammar import GrammarBackend, request_grammar
from eagleserve.constrained.grammar_mask import BITS
from eagleserve.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams, ThinkingGate


class TokenMatcher(Protocol):
    def accept(self, tokens: list[int]) -> None: ...
    def fill_paths(self, paths: list[list[int]], bitmask: torch.Tensor, first_row: int) -> None: ...


def token_bitmask(tokens: Sequence[int], vocab_size: int) -> torch.Tensor:
    """[W] int32 row allowing exactly `tokens`."""
    bits = torch.zeros((vocab_size + BITS - 1) // BITS * BITS, dtype=torch.bool)
    bits[list(tokens)] = True
    weights = torch.tensor([1 << b for b in range(BITS)], dtype=torch.int64)
    words = (bits.view(-1, BITS).long() * weights).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class AllowedTokens:
    """vLLM's `allowed_token_ids`: every position may hold only these tokens. A path through a
    forbidden token is one the verify never accepts (its parent's mask forbids it), so its
    rows' masks are left as at any other position."""

    def __init__(self, tokens: Sequence[int], vocab_size: int) -> None:
        self.row = token_bitmask(tokens, vocab_size)

    def accept(self, tokens: list[int]) -> None:
        pass

    def fill_paths(self, paths: list[list[int]], bitmask: torch.Tensor, first_row: int) -> None:
        bitmask[first_row : first_row + len(paths)] = self.row


class BadWords:
    """vLLM's `bad_words` as token sequences: a sequence's last token is banned wherever the
    output (its generated tokens, not the prompt) ends with the sequence's other tokens; a
    one-token sequence is banned everywhere."""

    def __init__(self, words: Sequence[Sequence[int]]) -> None:
        self.words = [list(w) for w in words]
        self.keep = max(len(w) for w in self.words) - 1  # output tokens a prefix can reach
        self.tail: list[int] = []

    def accept(self, tokens: list[int]) -> None:
        joined = self.tail + tokens
        self.tail = joined[max(0, len(joined) - self.keep) :]

    def banned(self, output_tail: list[int]) -> list[int]:
        """The tokens banned after an output ending with `output_tail`."""
        out = []
        for w in self.words:
            n = len(w) - 1
            if n <= len(output_tail) and (n == 0 or output_tail[-n:] == w[:-1]):
                out.append(w[-1])
        return out

    def fill_paths(self, paths: list[list[int]], bitmask: torch.Tensor, first_row: int) -> None:
        for i, path in enumerate(paths):
            row = first_row + i
            bitmask[row] = -1
            for t in self.banned(self.tail + path):
                bit = t % BITS
                bitmask[row, t // BITS] &= ~(1 << bit) if bit < BITS - 1 else 2**31 - 1


def set_bit(row: torch.Tensor, token: int) -> None:
    """Allows `token` in a bitmask row (int32 words: bit 31 is the sign bit)."""
    bit = token % BITS
    row[token // BITS] |= (1 << bit) if bit < BITS - 1 else -(2 ** (BITS - 1))


class AfterThinking:
    """A grammar that starts once a reasoning model's thinking ended (vLLM's structured output
    with a reasoning parser): while the output thinks every token is allowed; after its end
    token the grammar constrains the rest. With a start token (Qwen3) the output thinks only
    if it opens with it: the first token is the grammar's or that one."""

    def __init__(self, inner: TokenMatcher, gate: ThinkingGate) -> None:
        self.inner, self.gate = inner, gate
        self.state = "thinking" if gate.start_id is None else "start"  # | "answer"

    def _after(self, tokens: list[int]) -> tuple[str, list[int]]:
        """The state after `tokens`, and those of them the grammar reads (after the thinking)."""
        state = self.state
        for k, t in enumerate(tokens):
            if state == "answer":
                return state, tokens[k:]
            if state == "start":
                state = "thinking" if t == self.gate.start_id else "answer"
                if state == "answer":
                    return state, tokens[k:]
            elif t == self.gate.end_id:
                state = "answer"
        return state, []

    def accept(self, tokens: list[int]) -> None:
        self.state, read = self._after(tokens)
        if read:
            self.inner.accept(read)

    def fill_paths(self, paths: list[list[int]], bitmask: torch.Tensor, first_row: int) -> None:
        for i, path in enumerate(paths):
            state, read = self._after(path)
            if state == "thinking":
                bitmask[first_row + i] = -1
                continue
            self.inner.fill_paths([read], bitmask, first_row + i)
            if state == "start":  # the first token: the grammar's, or the thinking's opening
                assert self.gate.start_id is not None
                set_bit(bitmask[first_row + i], self.gate.start_id)


class OutputConstraint:
    """The intersection of a request's matchers (at least one). Where the first allows some
    token and the others together forbid them all (a grammar that can only go on with a bad
    word), only `end` (EOS) is allowed: the output stops there, never holding a token a
    constraint forbids (under a grammar EOS ends the request even with ignore_eos)."""

    def __init__(self, parts: list[TokenMatcher], vocab_size: int, end: int) -> None:
        self.parts = parts
        self.words = (vocab_size + BITS - 1) // BITS  # int32 words per bitmask row
        self.end_row = token_bitmask([end], vocab_size)

    @property
    def stateful(self) -> bool:
        """Whether its masks depend on the tokens (all but allowed_token_ids alone)."""
        return not all(isinstance(p, AllowedTokens) for p in self.parts)

    def accept(self, tokens: list[int]) -> None:
        for part in self.parts:
            part.accept(tokens)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The next token's mask at the committed state."""
        self.fill_paths([[]], bitmask, row)

    def fill_paths(self, paths: list[list[int]], bitmask: torch.Tensor, first_row: int) -> None:
        self.parts[0].fill_paths(paths, bitmask, first_row)
        if len(self.parts) == 1:
            return
        rows = bitmask[first_row : first_row + len(paths)]
        open_before = rows.ne(0).any(dim=-1)
        for part in self.parts[1:]:
            scratch = torch.full((len(paths), self.words), -1, dtype=torch.int32)
            part.fill_paths(paths, scratch, 0)
            rows &= scratch
        rows[open_before & ~rows.ne(0).any(dim=-1)] = self.end_row


def bad_words_token_ids(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """Each word's token ids as vLLM forbids them: the word as written (its leading blanks
    dropped), and the word after a space where that encodes to as many tokens with a different
    first one (a word token with its leading space, as in running text)."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(bare)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(spaced)
    return out


class ConstraintBuilder:
    """Builds requests' constraints for one model: its tokenizer (None: a model without one,
    which serves no grammar and no bad_words), vocabulary and EOS ids."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.grammars = None if tokenizer is None else GrammarBackend(
            tokenizer, vocab_size, sorted(eos_token_ids)
        )  # fmt: skip

    def build(self, params: SamplingParams) -> tuple[OutputConstraint | None, str | None]:
        """(the request's constraint, None when it has none; None) or (None, why it cannot
        run)."""
        parts: list[TokenMatcher] = []
        if params.grammar is not None:
            grammar, err = request_grammar(self.grammars, params.grammar)
            if grammar is None:
                return None, err
            gated = grammar if params.thinking is None else AfterThinking(grammar, params.thinking)
            parts.append(gated)
        if params.allowed_token_ids is not None:
            stop_ids = {*self.eos_token_ids, *params.stop_token_ids}
            if params.min_tokens > 0 and set(params.allowed_token_ids) <= stop_ids:
                return None, "allowed_token_ids holds only stop tokens, which min_tokens forbids"
            parts.append(AllowedTokens(params.allowed_token_ids, self.vocab_size))
        if params.bad_words:
            if self.tokenizer is None:
                return None, "bad_words need a model with a tokenizer"
            words = bad_words_token_ids(self.tokenizer, params.bad_words)
            if sum(map(len, words)) > MAX_BAD_WORD_TOKENS:
                return None, f"bad_words encode to over {MAX_BAD_WORD_TOKENS} tokens in all"
            outside = sorted({t for w in words for t in w if t >= self.vocab_size})
            if outside:
                return None, f"bad_words encode to token ids outside the vocabulary: {outside}"
            parts.append(BadWords(words))
        if not parts:
            return None, None
        end = self.eos_token_ids[0] if self.eos_token_ids else 0
        return OutputConstraint(parts, self.vocab_size, end), None

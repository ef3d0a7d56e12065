"""vLLM's allowed_token_ids and bad_words as output constraints (constrained/
output_constraint.py): their bitmasks against a plain reading of vLLM's rules, on fresh random
token sets, outputs and draft paths, bit 31 of a word included; their intersection with a
grammar; bad words encoded as vLLM encodes them."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import TINY_EOS, TINY_VOCAB

from eagleserve.constrained.constraint_batch import BatchConstraint
from eagleserve.constrained.grammar_mask import unpack_bitmask
from eagleserve.constrained.output_constraint import (
    AfterThinking,
    AllowedTokens,
    BadWords,
    ConstraintBuilder,
    bad_words_token_ids,
    token_bitmask,
)
from eagleserve.core import Req
from eagleserve.sampling_params import GrammarSpec, SamplingParams, ThinkingGate

V = 200  # not a multiple of 32: the last word is partly past the vocabulary
WORDS = (V + 31) // 32


def vllm_banned(words: list[list[int]], output: list[int]) -> set[int]:
    """vLLM's rule, read plainly: a word's last token is banned where the output ends with the
    word's other tokens."""
    return {w[-1] for w in words if len(w) - 1 <= len(output)
            and output[len(output) - len(w) + 1:] == w[:-1]}  # fmt: skip


def allowed_of(bitmask: torch.Tensor) -> torch.Tensor:
    return unpack_bitmask(bitmask, V)


def test_token_bitmask_allows_exactly_its_tokens() -> None:
    rng = random.Random()
    for _ in range(20):
        tokens = rng.sample(range(V), rng.randint(1, 40)) + [31, 63]  # sign bits of words
        got = allowed_of(token_bitmask(tokens, V)[None])[0]
        assert set(got.nonzero().flatten().tolist()) == set(tokens)


def test_bad_words_masks_follow_vllms_rule_along_outputs_and_paths() -> None:
    rng = random.Random()
    alphabet = [rng.randrange(V) for _ in range(4)] + [31, 95]  # few tokens: words match often
    words = [[rng.choice(alphabet) for _ in range(rng.randint(1, 4))] for _ in range(6)]
    bad = BadWords(words)
    output: list[int] = []
    for _ in range(12):
        chunk = [rng.choice(alphabet) for _ in range(rng.randint(1, 3))]
        bad.accept(chunk)
        output += chunk
        bm = torch.zeros(1, WORDS, dtype=torch.int32)
        bad.fill_paths([[]], bm, 0)
        assert set((~allowed_of(bm)[0]).nonzero().flatten().tolist()) == vllm_banned(words, output)
        paths = [[rng.choice(alphabet) for _ in range(rng.randint(0, 3))] for _ in range(5)]
        bm = torch.zeros(2 + len(paths), WORDS, dtype=torch.int32)
        bad.fill_paths(paths, bm, 2)
        for row, path in zip(allowed_of(bm)[2:], paths, strict=True):
            banned = set((~row).nonzero().flatten().tolist())
            assert banned == vllm_banned(words, output + path), (output, path)


def test_allowed_tokens_hold_at_every_path_position() -> None:
    tokens = random.sample(range(V), 7)
    allowed = AllowedTokens(tokens, V)
    bm = torch.zeros(4, WORDS, dtype=torch.int32)
    allowed.fill_paths([[1], [], [tokens[0], 5]], bm, 1)
    rows = allowed_of(bm)
    assert not rows[0].any()  # rows outside the paths untouched
    for row in rows[1:]:
        assert set(row.nonzero().flatten().tolist()) == set(tokens)


@pytest.fixture(scope="module")
def char_tokenizer(tiny_model_dir: str):  # noqa: ANN201 (a transformers tokenizer)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_a_request_gets_the_intersection_of_its_constraints(char_tokenizer) -> None:  # noqa: ANN001
    """A grammar with allowed_token_ids and bad_words: each row's mask is the AND of the three,
    at the committed state and after every draft path."""
    builder = ConstraintBuilder(char_tokenizer, TINY_VOCAB, [TINY_EOS])
    enc = lambda s: char_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    regex = GrammarSpec("regex", "[a-f]{2,8}")
    allowed = random.sample(enc("abcdef"), 4) + [TINY_EOS]
    params = SamplingParams(grammar=regex, allowed_token_ids=allowed, bad_words=["ab", "cc"])
    constraint, err = builder.build(params)
    assert err is None and constraint is not None
    grammar_only, _ = builder.build(SamplingParams(grammar=regex))
    reqs = [Req("free", [5], SamplingParams()), Req("all", [5], params)]
    reqs[1].constraint = constraint
    batch = BatchConstraint.of_reqs(reqs, TINY_VOCAB)
    assert batch is not None
    for committed in ([], enc("a"), enc("c")):
        constraint.accept(committed)
        assert grammar_only is not None
        grammar_only.accept(committed)
        got = batch.next_allowed(torch.device("cpu"))
        assert got[0].all()
        bm = torch.zeros(1, (TINY_VOCAB + 31) // 32, dtype=torch.int32)
        grammar_only.fill(bm, 0)
        want = unpack_bitmask(bm, TINY_VOCAB)[0] & token_mask(allowed)
        last = (committed or [-1])[-1]
        for word in (enc("ab"), enc("cc")):
            if word[0] == last:
                want[word[1]] = False
        assert torch.equal(got[1], want), committed


def token_mask(tokens: list[int]) -> torch.Tensor:
    m = torch.zeros(TINY_VOCAB, dtype=torch.bool)
    m[tokens] = True
    return m


def test_constraints_that_leave_no_token_allow_only_eos(char_tokenizer) -> None:  # noqa: ANN001
    """A grammar that can only go on with a banned word: EOS is the only token left, at the
    committed state and after a draft path; a path the grammar rejects stays all-forbidden."""
    builder = ConstraintBuilder(char_tokenizer, TINY_VOCAB, [TINY_EOS])
    enc = lambda s: char_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    word = "".join(random.sample("abcdefgh", 4))
    params = SamplingParams(grammar=GrammarSpec("regex", word + "[0-9]"), bad_words=[word[:3]])
    constraint, err = builder.build(params)
    assert err is None and constraint is not None
    constraint.accept(enc(word[:1]))
    bm = torch.zeros(3, (TINY_VOCAB + 31) // 32, dtype=torch.int32)
    constraint.fill(bm, 0)
    assert unpack_bitmask(bm, TINY_VOCAB)[0].nonzero().flatten().tolist() == [enc(word[1])[0]]
    constraint.fill_paths([enc(word[1]), enc("9")], bm, 1)
    rows = unpack_bitmask(bm, TINY_VOCAB)
    assert rows[1].nonzero().flatten().tolist() == [TINY_EOS]
    assert not rows[2].any()


def test_builder_refuses_what_cannot_run(char_tokenizer) -> None:  # noqa: ANN001
    builder = ConstraintBuilder(char_tokenizer, TINY_VOCAB, [TINY_EOS])
    _, err = builder.build(SamplingParams(allowed_token_ids=[TINY_EOS], min_tokens=2))
    assert err is not None and "min_tokens" in err
    _, err = ConstraintBuilder(None, TINY_VOCAB, [TINY_EOS]).build(SamplingParams(bad_words=["x"]))
    assert err is not None and "tokenizer" in err
    _, err = builder.build(SamplingParams(bad_words=["abcdefgh" * 20] * 100))
    assert err is not None and "1024 tokens" in err
    assert builder.build(SamplingParams()) == (None, None)


def test_bad_words_encode_as_vllm_with_and_without_a_leading_space(smollm2_dir: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    got = bad_words_token_ids(tok, ["  Paris", "hello world"])
    assert enc("Paris") != enc(" Paris") and len(enc(" Paris")) == len(enc("Paris"))
    assert got[:2] == [enc("Paris"), enc(" Paris")]
    assert enc("hello world") in got and enc(" hello world") in got[2:]


def test_allowed_token_ids_alone_read_no_tokens(char_tokenizer) -> None:  # noqa: ANN001
    """A batch whose constraints are allowed_token_ids alone never reads its tokens to the host
    (tokens on the meta device, which cannot be read, go through every method); one with bad
    words does."""
    builder = ConstraintBuilder(char_tokenizer, TINY_VOCAB, [TINY_EOS])
    allowed = random.sample(range(3, TINY_VOCAB), 9)
    reqs = [Req("a", [5], SamplingParams()), Req("b", [5], SamplingParams())]
    reqs[1].constraint, _ = builder.build(SamplingParams(allowed_token_ids=allowed))
    batch = BatchConstraint.of_reqs(reqs, TINY_VOCAB)
    assert batch is not None and not batch.reads_tokens
    meta = torch.device("meta")
    batch.advance(torch.zeros(2, 3, dtype=torch.long, device=meta), torch.ones(2, device=meta))
    tree = batch.tree_allowed(torch.zeros(2, 4, dtype=torch.long, device=meta),
                              torch.zeros(2, 4, dtype=torch.long, device=meta),
                              torch.device("cpu"))  # fmt: skip
    branches = batch.branch_allowed(torch.zeros(2, 3, 2, dtype=torch.long, device=meta),
                                    torch.device("cpu"))  # fmt: skip
    assert tree[0].all() and branches[:3].all()
    for row in [*tree[1], *branches[3:]]:
        assert row.nonzero().flatten().tolist() == sorted(allowed)
    reqs[0].constraint, _ = builder.build(SamplingParams(bad_words=["ab"]))
    both = BatchConstraint.of_reqs(reqs, TINY_VOCAB)
    assert both is not None and both.reads_tokens
    with pytest.raises((NotImplementedError, RuntimeError)):
        both.advance(torch.zeros(2, dtype=torch.long, device=meta))


def gate_rows(gate: AfterThinking, paths: list[list[int]]) -> torch.Tensor:
    rows = torch.zeros((len(paths), WORDS), dtype=torch.int32)
    gate.fill_paths(paths, rows, 0)
    return allowed_of(rows)


@pytest.mark.parametrize("opens", [False, True])
def test_a_grammar_after_thinking_starts_at_the_end_token(opens: bool) -> None:
    """While the output thinks every token is allowed; after the end token the inner matcher
    (here bad words, banning `word`'s last token after its first) constrains; with a start
    token (Qwen3) an output thinks only if it opens with it, which its first mask allows. A
    path's mask is the one its committed state reaches by accepting the path (sign bits of
    words among the tokens)."""
    rng = random.Random()
    start, end, lone = rng.sample([31, 63, 95, 127, 5, 9], 3)
    word = [rng.choice([x for x in range(V) if x not in (start, end)]), 159]
    ghost = BadWords([word, [lone], [start]])  # `start` banned by the grammar too
    gate = AfterThinking(ghost, ThinkingGate(end, start if opens else None))
    first = gate_rows(gate, [[]])[0]
    if opens:  # before any token: the grammar's mask and the start token
        assert first[start] and not first[lone]
    else:  # thinking from the first token: anything
        assert first.all()
    filler = [x for x in range(V) if x not in (start, end, lone, *word)]
    thinking = ([start] if opens else []) + rng.sample(filler, 5) + word
    assert gate_rows(gate, [thinking])[0].all()  # the word inside the thinking: no ban
    after = [*thinking, end, word[0]]
    row = gate_rows(gate, [after])[0]
    assert not row[word[1]] and not row[lone] and not row[start] and row.sum() == V - 3
    if opens:  # no opening tag: the grammar from the first token
        assert not gate_rows(gate, [[word[0]]])[0][word[1]]
    for _ in range(30):  # fill_paths == accepting the path on a copy, then the committed mask
        committed = [
            rng.choice([start, end, lone, *word, *filler[:4]]) for _ in range(rng.randint(0, 4))
        ]
        paths = [[rng.choice([start, end, *word, *filler[:4]]) for _ in range(rng.randint(0, 5))]
                 for _ in range(4)]  # fmt: skip
        g = AfterThinking(
            BadWords([word, [lone], [start]]), ThinkingGate(end, start if opens else None)
        )
        g.accept(committed)
        got = gate_rows(g, paths)
        for path, row in zip(paths, got):
            copy = AfterThinking(BadWords([word, [lone], [start]]), g.gate)
            copy.accept(committed + path)
            assert torch.equal(row, gate_rows(copy, [[]])[0]), (committed, path)

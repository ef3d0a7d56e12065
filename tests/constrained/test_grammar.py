"""The xgrammar backend (constrained/grammar.py, constrained/constraint_batch.py) on the tiny
model's one-character-per-token tokenizer: the LRU cache and its counters, error messages, and masks
along draft paths equal to a fresh matcher advanced along the same tokens, state restored."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import TINY_EOS, TINY_VOCAB

from eagleserve.constrained.constraint_batch import BatchConstraint
from eagleserve.constrained.grammar import (
    GrammarBackend,
    GrammarError,
    RequestGrammar,
    check_grammar,
)
from eagleserve.constrained.grammar_mask import unpack_bitmask
from eagleserve.constrained.output_constraint import OutputConstraint
from eagleserve.core import Req
from eagleserve.sampling_params import GrammarSpec, SamplingParams

SCHEMA = {"type": "object", "required": ["a", "b"],
          "properties": {"a": {"enum": ["xy", "xz", "q"]}, "b": {"type": "integer"}}}  # fmt: skip
SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def backend(tiny_model_dir: str) -> GrammarBackend:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return GrammarBackend(tok, TINY_VOCAB, [TINY_EOS], cache_size=2)


def ids(text: str, backend: GrammarBackend) -> list[int]:
    return backend.tokenizer.encode(text, add_special_tokens=False)


def mask_of(g: RequestGrammar | OutputConstraint) -> torch.Tensor:
    bm = torch.zeros(1, (TINY_VOCAB + 31) // 32, dtype=torch.int32)
    g.fill(bm, 0)
    return unpack_bitmask(bm, TINY_VOCAB)[0]


def test_cache_counts_hits_and_evicts(backend: GrammarBackend) -> None:
    before = (backend.stats.compiles, backend.stats.cache_hits)
    specs = [SPEC, GrammarSpec("regex", "ab+"), SPEC, GrammarSpec("regex", "c"), SPEC]
    for s in specs:
        backend.compile(s)
    # SPEC, ab+ compiled; SPEC hit; c compiled (evicts ab+); SPEC hit.
    assert (backend.stats.compiles - before[0], backend.stats.cache_hits - before[1]) == (3, 2)
    assert list(backend.cache) == [GrammarSpec("regex", "c"), SPEC]
    assert backend.stats.compile_seconds > 0


@pytest.mark.parametrize(
    ("spec", "words"),
    [(GrammarSpec("json_schema", '{"type": 3}'), "invalid json_schema: Type should be a string"),
     (GrammarSpec("json_schema", "{not json"), "invalid json_schema"),
     (GrammarSpec("regex", "(?<=a)b"), "invalid regex: Regex parsing error at position 3"),
     (GrammarSpec("ebnf", "root ::= x"), 'invalid ebnf: EBNF parser error')],
)  # fmt: skip
def test_errors_name_the_problem(backend: GrammarBackend, spec: GrammarSpec, words: str) -> None:
    with pytest.raises(GrammarError, match="^" + words.replace("(", r"\(").replace("?", r"\?")):
        backend.compile(spec)


def test_masks_after_draft_paths_match_a_fresh_matcher(backend: GrammarBackend) -> None:
    g = backend.new_matcher(SPEC)
    g.accept(ids('{"a": "x', backend))
    committed = mask_of(g)
    paths = [ids(p, backend) for p in ["", "y", "z", "q", 'y"', "yy"]]
    bm = torch.zeros(len(paths), (TINY_VOCAB + 31) // 32, dtype=torch.int32)
    g.fill_paths(paths, bm, 0)
    got = unpack_bitmask(bm, TINY_VOCAB)
    assert torch.equal(mask_of(g), committed), "the committed state is restored"
    for row, path in zip(got, paths):
        fresh = backend.new_matcher(SPEC)
        fresh.accept(ids('{"a": "x', backend))
        ok = all(fresh.matcher.accept_token(t) for t in path)
        want = mask_of(fresh) if ok else torch.zeros(TINY_VOCAB, dtype=torch.bool)
        assert torch.equal(row, want), path
    assert not got[3].any() and not got[5].any()  # "xq", "xyy" leave the grammar


def test_batch_tree_masks_follow_each_nodes_path(backend: GrammarBackend) -> None:
    """Rows without a grammar allow everything; node i of a grammar row has the mask after
    the tokens of nodes on its path (the root's token is already committed)."""
    reqs = [Req("a", [5], SamplingParams()), Req("b", [5], SamplingParams())]
    reqs[1].constraint = OutputConstraint([backend.new_matcher(SPEC)], TINY_VOCAB, TINY_EOS)
    reqs[1].constraint.accept(ids('{"a": ', backend))
    bg = BatchConstraint.of_reqs(reqs, TINY_VOCAB)
    assert bg is not None and bg.rows == [1]
    quote, x, y, q = ids('"xyq', backend)
    tokens = torch.tensor([[7, 8, 9, 10], [0, quote, x, q]])
    parents = torch.tensor([[-1, 0, 1, 2], [-1, 0, 1, 1]])  # node 3 is node 2's sibling
    got = bg.tree_allowed(tokens, parents, torch.device("cpu"))
    assert got[0].all()
    for node, text in enumerate(["", '"', '"x', '"q']):
        fresh = backend.new_matcher(SPEC)
        fresh.accept(ids('{"a": ' + text, backend))
        assert torch.equal(got[1, node], mask_of(fresh)), text
    bg.advance(torch.tensor([[1, 2, 3], [quote, x, y]]), torch.tensor([0, 3]))
    after = backend.new_matcher(SPEC)
    after.accept(ids('{"a": "xy', backend))
    assert torch.equal(mask_of(reqs[1].constraint), mask_of(after))


def test_without_xgrammar_a_spec_gets_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """xgrammar is installed --no-deps beside eagleserve: where it is missing, a structured
    request is refused with the line that installs it (not a 500 from an ImportError)."""
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    err = check_grammar(GrammarSpec("json_object"))
    assert err is not None and "pip install --no-deps xgrammar" in err

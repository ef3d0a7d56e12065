"""Grammar-constrained greedy output with EAGLE (chain, tree, EAGLE-3 with a reduced draft
vocabulary, adaptive with plain decodes; overlap on and off) equals constrained greedy output
without speculation, token for token; seeded constrained sampling repeats whatever shares the
batch, with and without speculation. The target is a tiny Llama with a one-character-per-token
tokenizer whose next token mostly follows from the current one, so a head that passes the token
embedding through drafts well and verifies see long accepted runs and rejections."""

from __future__ import annotations

import json
import os

import pytest
import torch
from lossless_fixtures import (
    CHAR_VOCAB,
    char_heads,
    char_target_dir,
    run_staggered,
)

from eagleserve import Engine, SamplingParams
from eagleserve.sampling_params import GrammarSpec

__all__ = ["char_heads", "char_target_dir"]  # module-scoped fixtures of lossless_fixtures

pytestmark = pytest.mark.usefixtures("torch_threads")

VOCAB = CHAR_VOCAB
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "eagle"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "kind", "n", "tags"],
}
EBNF = 'root ::= "(" item ("," item)? ("," item)? ")"\nitem ::= [a-z] [a-z]? | "[" [0-9]? "]"'
GRAMMARS = [
    GrammarSpec("json_schema", json.dumps(SCHEMA)),
    GrammarSpec("regex", r"(ab|c[d-f]{2,4}){1,9}x"),
    GrammarSpec("json_object"),
    GrammarSpec("ebnf", EBNF),
]


def cases(temperature: float = 0.0) -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(5)
    lens = [3, 11, 6, 20, 1, 9]
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]
    params = []
    for i in range(len(lens)):
        p = SamplingParams(max_new_tokens=[100, 40, 50, 30, 100, 30][i], temperature=temperature,
                           seed=100 + i, grammar=GRAMMARS[i % len(GRAMMARS)])  # fmt: skip
        if i == 5:
            p.grammar = None  # free text next to constrained rows
        if i == 3:  # penalties and bias, then the grammar mask, on every verify node
            p.frequency_penalty, p.presence_penalty, p.logit_bias = 0.7, 0.3, {ord("c") - 29: 3.0}
        params.append(p)
    return prompts, params


def engine(target: str, head: str | None, overlap: bool, **spec: int | bool) -> Engine:
    kw = {} if head is None else dict(
        speculative_algorithm="EAGLE3" if os.path.basename(head).startswith("EAGLE3") else "EAGLE",
        speculative_draft_model_path=head, **spec,
    )  # fmt: skip
    return Engine(model=target, device="cpu", max_total_tokens=2048, max_running_requests=8,
                  disable_overlap_schedule=not overlap, **kw)  # fmt: skip


@pytest.fixture(scope="module")
def reference(char_target_dir: str) -> list[list[int]]:
    return run_staggered(engine(char_target_dir, None, False), *cases())


def test_target_only_follows_the_grammars(char_target_dir: str, reference: list[list[int]]) -> None:
    """The reference itself is constrained: the JSON parses and validates, the regex and the
    EBNF match; a completed grammar ends with EOS."""
    import re

    import jsonschema
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(char_target_dir)
    texts = [tok.decode(ids, skip_special_tokens=True) for ids in reference]
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert re.fullmatch(r"(ab|c[d-f]{2,4}){1,9}x", texts[1]), texts[1]
    assert texts[2].startswith('{"'), texts[2]  # an object whose key runs to max_tokens
    item = r"(?:[a-z]{1,2}|\[[0-9]?\])"
    assert re.fullmatch(rf"\({item}(?:,{item}){{0,2}}\)", texts[3]), texts[3]
    assert reference[0][-1] == 2, "a completed grammar ends with EOS"


CASES = [
    # (head, num_steps, topk, num_draft_tokens, adaptive)
    ("EAGLE", 3, 1, 4, False),
    ("EAGLE", 3, 2, 6, False),
    ("EAGLE3", 3, 2, 6, False),
    ("EAGLE", 3, 1, 4, True),
]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize(("head", "steps", "topk", "ndt", "adaptive"), CASES)
def test_constrained_greedy_is_lossless(
    char_target_dir: str,
    char_heads: dict[str, str],
    reference: list[list[int]],
    head: str,
    steps: int,
    topk: int,
    ndt: int,
    adaptive: bool,
    overlap: bool,
) -> None:
    eng = engine(char_target_dir, char_heads[head], overlap, speculative_num_steps=steps,
                 speculative_eagle_topk=topk, speculative_num_draft_tokens=ndt,
                 speculative_adaptive=adaptive)  # fmt: skip
    if adaptive:  # plain decodes (k = 0) between drafts of every depth
        picks = iter([0, 1, 3, 2, 0, 3] * 200)
        eng.scheduler.worker.controller.choose = lambda alphas, catching_up=False: next(picks)
    got = run_staggered(eng, *cases())
    for i, (g, r) in enumerate(zip(got, reference)):
        first = next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
        assert g == r, f"request {i}: first mismatch at token {first}"
    stats = eng.stats()
    assert stats.spec_verify_calls_total > 0
    if head == "EAGLE" and not adaptive:
        assert stats.spec_accepted_tokens_total > 1.5 * stats.spec_verify_calls_total


def test_seeded_constrained_sampling_repeats(
    char_target_dir: str, char_heads: dict[str, str]
) -> None:
    """A seeded constrained request gives the same tokens alone or in a batch, with and without
    speculation (each mode its own stream: verify draws differ from decode draws)."""
    prompts, params = cases(temperature=0.9)
    for head in (None, char_heads["EAGLE"]):
        spec = {} if head is None else dict(speculative_num_steps=3, speculative_eagle_topk=1,
                                            speculative_num_draft_tokens=4)  # fmt: skip
        eng = engine(char_target_dir, head, True, **spec)
        together = run_staggered(eng, prompts, params)
        alone = [eng.generate([p], [sp])[0]["token_ids"] for p, sp in zip(prompts[:2], params)]
        assert together[:2] == alone


@pytest.mark.parametrize("head", [None, "EAGLE"], ids=["target-only", "eagle-chain"])
def test_constrained_greedy_survives_retraction_and_chunks(
    char_target_dir: str, char_heads: dict[str, str], reference: list[list[int]], head: str | None
) -> None:
    """A KV pool too small for the batch retracts requests (re-prefilled with their outputs:
    their matchers keep the committed state), and 8-token prefill chunks leave requests
    part-way through their prompt (no token committed, matchers untouched): same tokens."""
    spec = {} if head is None else dict(speculative_num_steps=3, speculative_eagle_topk=1,
                                        speculative_num_draft_tokens=4)  # fmt: skip
    eng = Engine(model=char_target_dir, device="cpu", max_total_tokens=120, max_running_requests=8,
                 chunked_prefill_size=8, disable_overlap_schedule=False,
                 **({} if head is None else dict(speculative_algorithm="EAGLE",
                    speculative_draft_model_path=char_heads[head], **spec)))  # fmt: skip
    assert run_staggered(eng, *cases()) == reference
    assert eng.stats().num_retracted_total > 0

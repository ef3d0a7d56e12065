"""vLLM's allowed_token_ids and bad_words with EAGLE (chain and tree, EAGLE-3 with a reduced
draft vocabulary; overlap on and off): greedy output equals target-only output under the same
constraints, token for token, and that output keeps them (no banned sequence, no token outside
the allowed set) where the unconstrained output broke them. The target and tokenizer are
lossless_fixtures.py's `char_target_dir` (one character per token)."""

from __future__ import annotations

import random

import pytest
from lossless_fixtures import (
    CHAR_EOS,
    CHAR_VOCAB,
    char_heads,
    char_target_dir,
    run_staggered,
)

from eagleserve import Engine, SamplingParams
from eagleserve.sampling_params import GrammarSpec, ThinkingGate

__all__ = ["char_heads", "char_target_dir"]  # module-scoped fixtures of lossless_fixtures

pytestmark = pytest.mark.usefixtures("torch_threads")

VOCAB, EOS = CHAR_VOCAB, CHAR_EOS
SEED = random.randrange(1 << 30)  # fresh per run; printed on a failure by the asserts


def engine(target: str, head: str | None, overlap: bool, **spec: int) -> Engine:
    kw = {} if head is None else dict(
        speculative_algorithm="EAGLE3" if "EAGLE3" in head else "EAGLE",
        speculative_draft_model_path=head, **spec,
    )  # fmt: skip
    return Engine(model=target, device="cpu", max_total_tokens=2048, max_running_requests=8,
                  disable_overlap_schedule=not overlap, **kw)  # fmt: skip


def prompts() -> list[list[int]]:
    rng = random.Random(SEED)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (4, 9, 2, 13, 6, 7, 3, 5, 8, 11)]


@pytest.fixture(scope="module")
def free(char_target_dir: str) -> list[list[int]]:
    """Unconstrained greedy outputs: the constraints below are made from them, so they bite."""
    params = [SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)] * 10
    return run_staggered(engine(char_target_dir, None, False), prompts(), params)


def constrained(free: list[list[int]], tok) -> list[SamplingParams]:  # noqa: ANN001
    """Rows 0, 3, 6-9: bad words (bigrams and a trigram of the free output, a single token);
    rows 1, 4: allowed_token_ids (half the free output's tokens and a few others); row 2: both
    with a regex; row 5: free text beside them."""
    rng = random.Random(SEED + 1)
    out = []
    for i, ids in enumerate(free):
        p = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
        if i in (0, 2, 3, 6, 7, 8, 9):
            starts = rng.sample(range(len(ids) - 3), 3)
            grams = [ids[s : s + 2] for s in starts[:2]] + [ids[starts[2] : starts[2] + 3]]
            p.bad_words = [tok.decode(g) for g in grams] + [tok.decode(ids[5:6])]
        if i in (1, 2, 4):
            seen = sorted(set(ids))
            others = [t for t in rng.sample(range(3, VOCAB), 4) if t not in seen]
            p.allowed_token_ids = rng.sample(seen, len(seen) // 2) + others
        if i == 2:
            p.ignore_eos = False
            p.grammar = GrammarSpec("regex", "[ -~]{3,30}")
            p.allowed_token_ids += [EOS] + tok.encode("abcdefgh", add_special_tokens=False)
        out.append(p)
    return out


def holds(ids: list[int], p: SamplingParams, tok) -> bool:  # noqa: ANN001
    words = [tok.encode(w, add_special_tokens=False) for w in p.bad_words]
    for w in words:
        if any(ids[j : j + len(w)] == w for j in range(len(ids))):
            return False
    return p.allowed_token_ids is None or set(ids) <= set(p.allowed_token_ids)


@pytest.fixture(scope="module")
def reference(char_target_dir: str, free: list[list[int]]) -> tuple[list[SamplingParams], list]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(char_target_dir)
    params = constrained(free, tok)
    got = run_staggered(engine(char_target_dir, None, False), prompts(), params)
    return params, got


def test_target_only_keeps_the_constraints(
    char_target_dir: str, free: list[list[int]], reference: tuple[list[SamplingParams], list]
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(char_target_dir)
    params, got = reference
    for i, (p, ids, before) in enumerate(zip(params, got, free, strict=True)):
        assert holds(ids, p, tok), (SEED, i, ids)
        if i != 5:
            assert not holds(before, p, tok), (SEED, i)  # the constraint changed the output
    assert got[5] == free[5]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize(
    ("head", "steps", "topk", "ndt"),
    [("EAGLE", 3, 1, 4), ("EAGLE", 3, 2, 6), ("EAGLE3", 2, 2, 5)],
)
def test_constrained_greedy_is_lossless(
    char_target_dir: str,
    char_heads: dict[str, str],
    reference: tuple[list[SamplingParams], list],
    head: str,
    steps: int,
    topk: int,
    ndt: int,
    overlap: bool,
) -> None:
    params, want = reference
    eng = engine(char_target_dir, char_heads[head], overlap, speculative_num_steps=steps,
                 speculative_eagle_topk=topk, speculative_num_draft_tokens=ndt)  # fmt: skip
    got = run_staggered(eng, prompts(), params)
    for i, (g, r) in enumerate(zip(got, want, strict=True)):
        first = next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
        assert g == r, f"seed {SEED}, request {i}: first mismatch at token {first}"
    assert eng.stats().spec_verify_calls_total > 0


@pytest.mark.parametrize(("head", "steps", "topk", "ndt"), [("EAGLE", 3, 1, 4), ("EAGLE", 3, 2, 6)])
def test_a_grammar_after_thinking_is_lossless(
    char_target_dir: str, char_heads: dict[str, str], free: list[list[int]],
    head: str, steps: int, topk: int, ndt: int,
) -> None:  # fmt: skip
    """A reasoning model's grammar (--reasoning-parser) starts after its end token: here each
    request's 5th free token. The output is the free one up to that token, then the regex's;
    greedy EAGLE (drafts masked along their paths across the gate) equals target-only."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(char_target_dir)
    letters = tok.encode("abcdefgh", add_special_tokens=False)
    params = []
    for ids in free:
        p = SamplingParams(max_new_tokens=40, temperature=0)
        p.grammar = GrammarSpec("regex", "[a-h]{2,12}")
        p.thinking = ThinkingGate(end_id=ids[4])
        params.append(p)
    want = run_staggered(engine(char_target_dir, None, False), prompts(), params)
    for ids, out in zip(free, want, strict=True):
        cut = ids.index(ids[4]) + 1  # the thinking: the free output up to its end token
        assert out[:cut] == ids[:cut], SEED
        tail = [t for t in out[cut:] if t != EOS]
        assert 2 <= len(tail) <= 12 and set(tail) <= set(letters), (SEED, out)
    eng = engine(char_target_dir, char_heads[head], True, speculative_num_steps=steps,
                 speculative_eagle_topk=topk, speculative_num_draft_tokens=ndt)  # fmt: skip
    assert run_staggered(eng, prompts(), params) == want, SEED
    assert eng.stats().spec_verify_calls_total > 0

"""Penalties, min_tokens and logit_bias under speculation: greedy output equals target-only
output with the same fields, token for token (chain, tree, EAGLE-3, adaptive with plain decodes,
overlap on and off); and target-only output is what the definitions give, step by step, on the
transformers model. Sampled output: tests/spec/test_eagle_sampling.py (penalized cases)."""

from __future__ import annotations

import pytest
import torch
from conftest import reference_penalize
from lossless_fixtures import VOCAB, heads, run_staggered, target_dir  # noqa: F401 (fixtures)
from transformers import LlamaForCausalLM

from eagleserve import Engine, SamplingParams

EOS = VOCAB - 1


def prompts(g: torch.Generator) -> list[list[int]]:
    lens = [3, 17, 5, 30, 1, 9]
    return [torch.randint(1, VOCAB - 1, (n,), generator=g).tolist() for n in lens]


def penalized_params(g: torch.Generator) -> list[SamplingParams]:
    """Strong enough to change most outputs; one request without any, one with bias only."""
    u = lambda lo, hi: lo + (hi - lo) * float(torch.rand(1, generator=g))
    out = []
    for i in range(6):
        p = SamplingParams(max_new_tokens=[30, 12, 25, 20, 30, 16][i], temperature=0.0)
        if i != 1:
            bias = {int(t): u(-8, 8) for t in torch.randint(0, VOCAB, (4,), generator=g)}
            p.logit_bias = bias
        if i not in (1, 5):
            p.presence_penalty, p.frequency_penalty = u(-0.5, 2), u(0, 2)
            p.repetition_penalty = u(1.0, 1.8) if i % 2 else u(0.7, 1.0)
        if i == 3:
            p.min_tokens, p.logit_bias[EOS] = 12, 6.0  # EOS would win without min_tokens
        out.append(p)
    return out


@pytest.fixture(scope="module")
def cases() -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    return prompts(g), penalized_params(g)


@pytest.fixture(scope="module")
def reference(target_dir: str, cases) -> list[list[int]]:  # noqa: F811
    eng = Engine(model=target_dir, device="cpu", max_total_tokens=2048, max_running_requests=8,
                 disable_overlap_schedule=True)  # fmt: skip
    return run_staggered(eng, *cases)


def test_target_only_follows_the_definitions(target_dir: str, cases, reference) -> None:  # noqa: F811
    """Each step: the model's last logits, penalized from the definitions, argmax; EOS and
    max_tokens end it, EOS not before min_tokens."""
    model = LlamaForCausalLM.from_pretrained(target_dir).eval()
    plain = Engine(model=target_dir, device="cpu", max_total_tokens=2048, max_running_requests=8,
                   disable_overlap_schedule=True)  # fmt: skip
    neutral = [SamplingParams(max_new_tokens=p.max_new_tokens, temperature=0.0) for p in cases[1]]
    changed = 0
    for prompt, p, got, unpenalized in zip(*cases, reference, run_staggered(plain, cases[0],
                                                                           neutral)):  # fmt: skip
        out: list[int] = []
        with torch.no_grad():
            while len(out) < p.max_new_tokens:
                logits = model(torch.tensor([prompt + out])).logits[0, -1].tolist()
                scores = reference_penalize(logits, prompt, out, p)
                if len(out) < p.min_tokens:
                    scores[EOS] = float("-inf")
                out.append(max(range(VOCAB), key=scores.__getitem__))
                if out[-1] == EOS:
                    break
        assert got == out
        changed += got != unpenalized
    assert changed >= 4, "the penalties should change most outputs"
    assert len(reference[3]) >= 12 and EOS not in reference[3][:12]


CASES = [
    # (head, num_steps, topk, num_draft_tokens, adaptive)
    ("EAGLE", 3, 1, 4, False),
    ("EAGLE", 5, 1, 6, False),
    ("EAGLE", 3, 2, 6, False),
    ("EAGLE", 4, 3, 8, False),
    ("EAGLE3", 3, 2, 6, False),
    ("EAGLE", 3, 1, 4, True),
]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize(("head", "steps", "topk", "ndt", "adaptive"), CASES)
def test_greedy_with_penalties_is_lossless(
    target_dir: str,  # noqa: F811
    heads: dict[str, str],  # noqa: F811
    cases,
    reference: list[list[int]],
    head: str,
    steps: int,
    topk: int,
    ndt: int,
    adaptive: bool,
    overlap: bool,
) -> None:
    eng = Engine(
        model=target_dir,
        device="cpu",
        max_total_tokens=2048,
        max_running_requests=8,
        disable_overlap_schedule=not overlap,
        speculative_algorithm="EAGLE3" if head == "EAGLE3" else "EAGLE",
        speculative_draft_model_path=heads[head],
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=ndt,
        speculative_adaptive=adaptive,
    )
    if adaptive:  # plain decodes (k = 0) between drafts of every depth
        picks = iter([0, 1, 3, 2, 0, 3] * 200)
        eng.scheduler.worker.controller.choose = lambda alphas, catching_up=False: next(picks)
    got = run_staggered(eng, *cases)
    for i, (g, r) in enumerate(zip(got, reference)):
        first = next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
        assert g == r, f"request {i}: first mismatch at token {first}"
    stats = eng.stats()
    assert stats.spec_verify_calls_total > 0
    if head == "EAGLE" and not adaptive:
        assert stats.spec_accepted_tokens_total > 1.3 * stats.spec_verify_calls_total

"""Logprobs of generated tokens with speculation: each token's logprob and its top alternatives
are the raw target's at that position (a teacher-forced transformers forward over the output),
whether the token came from a prefill, a decode, or a verify of a chain or a tree, greedy or
sampled, batched with requests that ask for more alternatives or none."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from lossless_fixtures import heads, prompts, target_dir
from transformers import AutoModelForCausalLM

from eagleserve import Engine, SamplingParams

__all__ = ["heads", "target_dir"]  # module-scoped fixtures of lossless_fixtures

pytestmark = pytest.mark.usefixtures("torch_threads")

CHAIN3 = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
SPEC = {  # (head, its settings)
    "target-only": (None, {}),
    "chain3": ("EAGLE", CHAIN3),
    "tree": ("EAGLE", dict(speculative_num_steps=3, speculative_eagle_topk=2,
                           speculative_num_draft_tokens=6)),
    "eagle3-chain3": ("EAGLE3", CHAIN3),
}  # fmt: skip
TOP = 3


@pytest.fixture(scope="module")
def target_hf(target_dir: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def raw_logprobs(hf: torch.nn.Module, prompt: list[int], out: list[int]) -> torch.Tensor:
    """[len(out), V]: row i is the target's log distribution of out[i]."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(out)], dim=-1)


@pytest.mark.parametrize("spec", SPEC)
def test_logprobs_are_the_targets_with_speculation(
    spec: str, target_dir: str, heads: dict[str, str], target_hf: torch.nn.Module
) -> None:
    head, settings = SPEC[spec]
    kw: dict[str, Any] = dict(settings)
    if head is not None:
        kw.update(speculative_algorithm=head, speculative_draft_model_path=heads[head])
    eng = Engine(model=target_dir, device="cpu", max_total_tokens=2048, max_running_requests=8,
                 **kw)  # fmt: skip
    seed = random.randrange(1 << 20)
    ps = prompts(seed)
    params = [
        SamplingParams(max_new_tokens=24, temperature=0.0 if i % 2 else 0.9, seed=seed + i,
                       ignore_eos=True, logprobs=TOP if i % 3 else 0)
        for i in range(len(ps))
    ]  # fmt: skip
    outs = eng.generate(ps, params)
    for i, (prompt, p, out) in enumerate(zip(ps, params, outs, strict=True)):
        where = f"seed {seed}, request {i}"
        ids = out["token_ids"]
        assert len(out["logprobs"]) == len(out["top_logprobs"]) == len(ids) == 24, where
        want = raw_logprobs(target_hf, prompt, ids)
        chosen = want.gather(1, torch.tensor(ids)[:, None])[:, 0]
        assert out["logprobs"] == pytest.approx(chosen.tolist(), abs=2e-4), where
        top_vals, _ = want.topk(TOP, dim=-1)
        for row, (alts, ref) in enumerate(zip(out["top_logprobs"], top_vals, strict=True)):
            assert len(alts) == p.logprobs, where
            got = [v for _, v in alts]
            assert got == pytest.approx(ref[: p.logprobs].tolist(), abs=2e-4), f"{where}, {row}"
            # Each alternative's logprob is the target's for that token id.
            assert got == pytest.approx([want[row, t].item() for t, _ in alts], abs=2e-4), where
        if p.temperature == 0.0:  # greedy: the chosen token is the most likely
            assert chosen.tolist() == pytest.approx(want.max(dim=-1).values.tolist()), where
    stats = eng.stats()
    if head is not None:  # the tokens came from verifies (the EAGLE head's drafts pass often)
        assert stats.spec_verify_calls_total > 0, where
        assert head != "EAGLE" or stats.spec_accepted_tokens_total > 0, where

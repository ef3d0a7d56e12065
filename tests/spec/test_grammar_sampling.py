"""Grammar-constrained sampling with speculation has the constrained target's distribution
(chain and tree): on an 8-token target, the joint of the first 3 sampled tokens under a regex
that allows a different token set at each position, from 20k seeded requests, against the exact
joint from the target's own masked conditionals (the threshold of test_eagle_sampling.py, for
this sample size); no sample ever holds a token the grammar forbids at its position."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from sampling_fixtures import (  # noqa: F401 (fixtures)
    PROMPT,
    VOCAB,
    head_dir,
    small_target,
    tv_threshold,
)

from eagleserve import Engine, SamplingParams
from eagleserve.sampling_params import GrammarSpec

pytestmark = pytest.mark.usefixtures("torch_threads")

CHARS = "abcdefgh"  # token i is CHARS[i]
REGEX = "[a-d]([a-f][b-h])*"  # never complete: no EOS needed (the target has none)
N_SAMPLES = 3000


def allowed_at(position: int) -> list[int]:
    sets = ["abcd", "abcdef", "bcdefgh"]
    return [CHARS.index(c) for c in sets[position]]


@pytest.fixture(scope="module")
def target_with_tokenizer(small_target):  # noqa: F811
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    path, model = small_target
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return path, model


def exact_constrained_joint(model, temperature: float) -> np.ndarray:  # noqa: ANN001
    joint = np.zeros((VOCAB,) * 3)
    with torch.no_grad():

        def cond(prefix: list[int]) -> np.ndarray:
            logits = model(torch.tensor([PROMPT + prefix])).logits[0, -1].double() / temperature
            keep = torch.zeros(VOCAB, dtype=torch.bool)
            keep[allowed_at(len(prefix))] = True
            return torch.softmax(logits.masked_fill(~keep, float("-inf")), -1).numpy()

        p1 = cond([])
        for a in range(VOCAB):
            p2 = cond([a]) if p1[a] else np.zeros(VOCAB)
            for b in range(VOCAB):
                if p1[a] * p2[b]:
                    joint[a, b] = p1[a] * p2[b] * cond([a, b])
    return joint / joint.sum()


@pytest.mark.parametrize(("steps", "topk", "ndt"), [(3, 1, 4), (3, 2, 6)], ids=["chain", "tree"])
def test_constrained_sampling_matches_target(target_with_tokenizer, head_dir, steps, topk, ndt):  # noqa: F811
    path, model = target_with_tokenizer
    params = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True,
                            grammar=GrammarSpec("regex", REGEX))  # fmt: skip
    joint = exact_constrained_joint(model, 1.0)
    eng = Engine(model=path, device="cpu", max_total_tokens=32768, max_running_requests=2048,
                 speculative_algorithm="EAGLE", speculative_draft_model_path=head_dir,
                 speculative_num_steps=steps, speculative_eagle_topk=topk,
                 speculative_num_draft_tokens=ndt)  # fmt: skip
    seeded = [dataclasses.replace(params, seed=i) for i in range(N_SAMPLES)]
    counts = np.zeros((VOCAB,) * 3)
    for o in eng.generate([PROMPT] * N_SAMPLES, seeded):
        counts[tuple(o["token_ids"][:3])] += 1
    emp = counts / N_SAMPLES
    stats = eng.stats()
    assert stats.spec_accepted_tokens_total / stats.spec_verify_calls_total > 1.2
    threshold = tv_threshold(joint, N_SAMPLES, np.random.default_rng(0))
    tv = 0.5 * np.abs(emp - joint).sum()
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"
    for pos in range(3):
        banned = [i for i in range(VOCAB) if i not in allowed_at(pos)]
        assert emp.sum(axis=tuple(a for a in range(3) if a != pos))[banned].sum() == 0, pos

"""Sampled output with speculation has the target's distribution (chain and tree).

On a target with an 8-token vocabulary, the joint distribution of the first 3 sampled tokens
(20k samples) is compared with the exact joint computed from the target's own conditionals.
The threshold is the 99.9th percentile of the total-variation distance of 20k exact samples,
simulated, so a correct sampler fails about once in a thousand runs and a biased one fails.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import reference_penalize
from sampling_fixtures import N_SAMPLES, PROMPT, VOCAB, head_dir, small_target, tv_threshold
from transformers import LlamaForCausalLM

from eagleserve import Engine, SamplingParams

__all__ = ["head_dir", "small_target"]  # module-scoped fixtures of sampling_fixtures


def exact_joint(model: LlamaForCausalLM, params: SamplingParams) -> np.ndarray:
    """P(t1, t2, t3 | PROMPT) under penalties, bias, temperature and top-k, from the target's
    own conditionals."""
    joint = np.zeros((VOCAB,) * 3)
    with torch.no_grad():

        def cond(prefix: list[int]) -> np.ndarray:
            raw = model(torch.tensor([PROMPT + prefix])).logits[0, -1].double()
            logits = torch.tensor(reference_penalize(raw.tolist(), PROMPT, prefix, params))
            logits = logits.double() / params.temperature
            if params.top_k > 0:
                kth = logits.topk(params.top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            return torch.softmax(logits, -1).numpy()

        p1 = cond([])
        for a in range(VOCAB):
            p2 = cond([a])
            for b in range(VOCAB):
                joint[a, b] = p1[a] * p2[b] * cond([a, b])
    return joint / joint.sum()


def empirical_joint(engine: Engine, params: SamplingParams) -> np.ndarray:
    # One seed per request: independent draws, and the same ones every run (no flaky CI).
    seeded = [dataclasses.replace(params, seed=i) for i in range(N_SAMPLES)]
    outs = engine.generate([PROMPT] * N_SAMPLES, seeded)
    counts = np.zeros((VOCAB,) * 3)
    for o in outs:
        counts[tuple(o["token_ids"][:3])] += 1
    return counts / counts.sum()


@pytest.mark.parametrize(
    ("steps", "topk", "ndt", "temperature", "top_k", "adaptive"),
    [
        (3, 1, 4, 1.0, -1, False),
        (2, 2, 4, 0.8, -1, False),
        (3, 1, 4, 1.3, 4, False),
        (3, 1, 4, 1.0, -1, True),
    ],
)
def test_sampling_matches_target(
    small_target, head_dir, steps, topk, ndt, temperature, top_k, adaptive
):
    path, model = small_target
    params = SamplingParams(max_new_tokens=3, temperature=temperature, top_k=top_k, ignore_eos=True)
    joint = exact_joint(model, params)
    eng = Engine(
        model=path,
        device="cpu",
        max_total_tokens=32768,
        max_running_requests=2048,
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=head_dir,
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=ndt,
        speculative_adaptive=adaptive,
    )
    if adaptive:  # every draft depth, a plain decode included, within each 3-token answer
        picks = iter([0, 1, 3, 2, 0, 3] * 100)
        eng.scheduler.worker.controller.choose = lambda alphas, catching_up=False: next(picks)
    emp = empirical_joint(eng, params)
    stats = eng.stats()
    assert stats.spec_accepted_tokens_total / stats.spec_verify_calls_total > 1.3
    tv = 0.5 * np.abs(emp - joint).sum()
    threshold = tv_threshold(joint, N_SAMPLES, np.random.default_rng(0))
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"
    assert stats.kv_used_tokens == 0


PENALTIES = dict(presence_penalty=1.5, frequency_penalty=2.0, repetition_penalty=2.0,
                 logit_bias={3: 2.0, 5: -1.5})  # fmt: skip


@pytest.mark.parametrize(("steps", "topk", "ndt"), [(3, 1, 4), (3, 2, 6)], ids=["chain", "tree"])
def test_sampling_with_penalties_matches_target(small_target, head_dir, steps, topk, ndt):
    """Seeded sampling with penalties and logit_bias: the joint of the first three tokens is the
    target's under the same fields (each draft node is judged with its own path's counts)."""
    path, model = small_target
    params = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True, **PENALTIES)
    joint = exact_joint(model, params)
    plain = exact_joint(model, dataclasses.replace(params, **{k: SamplingParams().__dict__[k]
                                                              for k in PENALTIES}))  # fmt: skip
    eng = Engine(model=path, device="cpu", max_total_tokens=32768, max_running_requests=2048,
                 speculative_algorithm="EAGLE", speculative_draft_model_path=head_dir,
                 speculative_num_steps=steps, speculative_eagle_topk=topk,
                 speculative_num_draft_tokens=ndt)  # fmt: skip
    emp = empirical_joint(eng, params)
    stats = eng.stats()
    assert stats.spec_accepted_tokens_total / stats.spec_verify_calls_total > 1.2
    threshold = tv_threshold(joint, N_SAMPLES, np.random.default_rng(0))
    assert 0.5 * np.abs(plain - joint).sum() > 4 * threshold, "the penalties change too little"
    tv = 0.5 * np.abs(emp - joint).sum()
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"


def test_threshold_detects_bias(small_target):
    """The same check rejects a distribution that is off by what a biased rule would give."""
    _, model = small_target
    params = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True)
    joint = exact_joint(model, params)
    rng = np.random.default_rng(1)
    threshold = tv_threshold(joint, N_SAMPLES, rng)
    # Sharpen by squaring (what accepting drafts too eagerly does to a peaky target).
    biased = joint**1.5 / (joint**1.5).sum()
    emp = rng.multinomial(N_SAMPLES, biased.ravel()) / N_SAMPLES
    assert 0.5 * np.abs(emp - joint.ravel()).sum() > threshold


def test_seeded_sampling_repeats_with_speculation(small_target, head_dir):
    path, _ = small_target
    eng = Engine(
        model=path,
        device="cpu",
        max_total_tokens=4096,
        max_running_requests=16,
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=head_dir,
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
    )
    ps = [
        SamplingParams(max_new_tokens=20, temperature=1.0, seed=s, ignore_eos=True)
        for s in (11, 11, 12)
    ]
    a = eng.generate([PROMPT] * 3, ps)
    b = eng.generate([PROMPT, [3, 3], PROMPT, [4]], [ps[0], ps[2], ps[1], ps[2]])
    assert a[0]["token_ids"] == a[1]["token_ids"] == b[0]["token_ids"] == b[2]["token_ids"]
    assert a[2]["token_ids"] != a[0]["token_ids"]

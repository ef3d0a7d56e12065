"""Speculative greedy output equals target-only greedy output, token for token.

The target is a tiny random Llama whose attention and MLP outputs are scaled down, so its next
token depends mostly (not only) on the current one; an EAGLE-1 head whose fc passes the token
embedding through then predicts it well, which exercises long accepted runs, partial acceptance
and rejection. EAGLE-3 heads are random (mostly rejections) and use a reduced draft vocabulary.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import SPEC_VOCAB, assert_kv_accounted, save_spec_target

from eagleserve import Engine, SamplingParams
from eagleserve.config import ModelConfig
from eagleserve.messages import GenerateReqInput
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.spec.head_loader import init_eagle_head, save_eagle_head

VOCAB = SPEC_VOCAB


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_spec_target(str(tmp_path_factory.mktemp("target")), 1234, VOCAB - 1, 0)


def _head_dir(
    target_dir: str, algorithm: str, tmp: str, quality: float, seed: int, layers: int = 1
) -> str:
    runner = ModelRunner(
        ModelConfig.from_dir(target_dir), target_dir, torch.device("cpu"), torch.float32, 64, 1, 512
    )
    draft_vocab = 48 if algorithm == "EAGLE3" else None
    head = init_eagle_head(algorithm, runner.model, draft_vocab_size=draft_vocab, seed=seed,
                           num_hidden_layers=layers)  # fmt: skip
    if algorithm == "EAGLE" and quality > 0:
        h = head.hidden_size
        with torch.no_grad():
            # fc passes the embedding of the newest token through: the head then guesses the
            # target's next token from the current one, which is mostly what the target does.
            head.fc.weight[:, :h].copy_(torch.eye(h) * quality + head.fc.weight[:, :h])
    out = os.path.join(tmp, f"{algorithm}-{quality}-{seed}-{layers}")
    save_eagle_head(head, out)
    return out


@pytest.fixture(scope="module")
def heads(target_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = str(tmp_path_factory.mktemp("heads"))
    return {
        "EAGLE": _head_dir(target_dir, "EAGLE", tmp, 1.0, 0),
        "EAGLE-random": _head_dir(target_dir, "EAGLE", tmp, 0.0, 1),
        "EAGLE3": _head_dir(target_dir, "EAGLE3", tmp, 0.0, 2),
        # vLLM's multi-layer EAGLE3 layout: the midlayer, then a plain decoder layer.
        "EAGLE3-2layers": _head_dir(target_dir, "EAGLE3", tmp, 0.0, 3, layers=2),
    }


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [3, 17, 5, 40, 1, 9, 26, 12]
    return [torch.randint(1, VOCAB - 1, (n,), generator=g).tolist() for n in lens]


def _params() -> list[SamplingParams]:
    # Mixed finish conditions: long runs, short max_tokens, stop ids, ignore_eos.
    out = []
    for i in range(8):
        p = SamplingParams(max_new_tokens=[40, 7, 33, 12, 25, 3, 40, 18][i], temperature=0.0)
        if i == 2:
            p.stop_token_ids = [7, 11, 13]
        if i in (4, 6):
            p.ignore_eos = True
        out.append(p)
    return out


def run_staggered(
    engine: Engine, prompts: list[list[int]], params: list[SamplingParams]
) -> list[list[int]]:
    """Adds requests two at a time while others decode; returns each request's tokens."""
    sched = engine.scheduler
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    pending = list(enumerate(zip(prompts, params)))
    steps = 0
    while pending or len(finished) < len(prompts):
        if pending and steps % 2 == 0:
            for _ in range(2):
                if pending:
                    i, (p, sp) = pending.pop(0)
                    tokens[f"r{i}"] = []
                    sched.add_request(GenerateReqInput(f"r{i}", p, sp))
        for out in sched.step():
            assert out.error is None, out.error
            tokens[out.rid].extend(out.new_token_ids)
            if out.finished:
                finished.add(out.rid)
        steps += 1
        assert steps < 5000
    while sched.has_work():
        assert not sched.step()
    assert_kv_accounted(sched)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def reference(target_dir: str) -> list[list[int]]:
    eng = Engine(
        model=target_dir,
        device="cpu",
        kv_cache_tokens=2048,
        max_running_requests=8,
        disable_overlap_schedule=True,
    )
    return run_staggered(eng, _prompts(0), _params())


def test_overlap_target_only_matches(target_dir: str, reference: list[list[int]]) -> None:
    eng = Engine(model=target_dir, device="cpu", kv_cache_tokens=2048, max_running_requests=8,
                 disable_overlap_schedule=False)  # fmt: skip
    assert eng.scheduler.enable_overlap
    assert run_staggered(eng, _prompts(0), _params()) == reference


CASES = [
    # (head, num_steps, topk, num_draft_tokens)
    ("EAGLE", 1, 1, 2),
    ("EAGLE", 2, 1, 3),
    ("EAGLE", 3, 1, 4),
    ("EAGLE", 4, 1, 5),
    ("EAGLE", 5, 1, 6),
    ("EAGLE", 2, 2, 3),
    ("EAGLE", 3, 2, 6),
    ("EAGLE", 4, 3, 8),
    ("EAGLE", 5, 4, 12),
    ("EAGLE", 3, 4, 16),
    ("EAGLE", 2, 3, 4),
    ("EAGLE-random", 3, 1, 4),
    ("EAGLE-random", 3, 2, 5),
    ("EAGLE3", 1, 1, 2),
    ("EAGLE3", 4, 1, 5),
    ("EAGLE3", 3, 2, 6),
    ("EAGLE3", 2, 4, 8),
    ("EAGLE3-2layers", 3, 1, 4),
    ("EAGLE3-2layers", 3, 2, 6),
]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize(("head", "steps", "topk", "ndt"), CASES)
def test_greedy_lossless(
    target_dir: str,
    heads: dict[str, str],
    reference: list[list[int]],
    head: str,
    steps: int,
    topk: int,
    ndt: int,
    overlap: bool,
) -> None:
    algo = "EAGLE3" if head.startswith("EAGLE3") else "EAGLE"
    eng = Engine(
        model=target_dir,
        device="cpu",
        kv_cache_tokens=2048,
        max_running_requests=8,
        disable_overlap_schedule=not overlap,
        speculative_algorithm=algo,
        speculative_draft_model_path=heads[head],
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=ndt,
    )
    got = run_staggered(eng, _prompts(0), _params())
    for i, (g, r) in enumerate(zip(got, reference)):
        first = next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
        assert g == r, f"request {i}: first mismatch at token {first}"
    stats = eng.stats()
    assert stats.spec_verify_calls_total > 0
    if head == "EAGLE":
        # The crafted head must actually get drafts accepted, or this test proves little.
        assert stats.spec_accepted_tokens_total / stats.spec_verify_calls_total > 1.5


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize(("spec", "topk", "ndt"), [(None, 1, 1), ("EAGLE", 1, 4), ("EAGLE", 2, 6)])
def test_small_kv_pool_waits_and_retracts(
    target_dir: str,
    heads: dict[str, str],
    reference: list[list[int]],
    overlap: bool,
    spec: str | None,
    topk: int,
    ndt: int,
) -> None:
    """A pool far below the total demand: requests wait or get retracted, tokens stay exact."""
    kwargs = {}
    if spec:
        kwargs = dict(
            speculative_algorithm=spec,
            speculative_draft_model_path=heads["EAGLE"],
            speculative_num_steps=3,
            speculative_eagle_topk=topk,
            speculative_num_draft_tokens=ndt,
        )
    eng = Engine(
        model=target_dir,
        device="cpu",
        kv_cache_tokens=130,
        max_running_requests=8,
        disable_overlap_schedule=not overlap,
        **kwargs,
    )
    got = run_staggered(eng, _prompts(0), _params())
    assert got == reference
    assert eng.stats().num_retracted_total > 0, "the pool was meant to force retraction"

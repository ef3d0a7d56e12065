"""Tensor parallelism end to end (offline Engine, 2 gloo ranks): greedy EAGLE output, chain and
tree, EAGLE and EAGLE-3, with and without the overlap scheduler, equals TP=2 target-only output
token for token, which equals TP=1's; sampled requests run through the broadcast acceptance."""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
from dataclasses import replace
from typing import Any

import pytest
import torch
from conftest import SPEC_VOCAB, save_spec_target

from eagleserve import Engine, SamplingParams
from eagleserve.config import ModelConfig
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.spec.head_loader import init_eagle_head, save_eagle_head

pytestmark = pytest.mark.usefixtures("torch_threads")
VOCAB = SPEC_VOCAB
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """8 layers (EAGLE-3 fuses three), 4 query and 2 KV heads: one KV head per rank."""
    return save_spec_target(str(tmp_path_factory.mktemp("tp_target")), 4321, VOCAB - 1, 0)


@pytest.fixture(scope="module")
def heads(target_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An EAGLE head that mostly guesses right (fc passes the newest token's embedding on) and
    a random EAGLE-3 head, made without tensor parallelism and loaded by every rank."""
    runner = ModelRunner(ModelConfig.from_dir(target_dir), target_dir, torch.device("cpu"),
                         torch.float32, 64, 1, 512)  # fmt: skip
    out: dict[str, str] = {}
    tmp = str(tmp_path_factory.mktemp("tp_heads"))
    for algorithm in ("EAGLE", "EAGLE3"):
        vocab = 48 if algorithm == "EAGLE3" else None
        head = init_eagle_head(algorithm, runner.model, draft_vocab_size=vocab, seed=3)
        if algorithm == "EAGLE":
            h = head.hidden_size
            with torch.no_grad():
                head.fc.weight[:, :h].add_(torch.eye(h))
        out[algorithm] = os.path.join(tmp, algorithm)
        save_eagle_head(head, out[algorithm])
    # The good head with the held-out accuracy a trained one carries: the adaptive controller
    # starts from it and drafts from the first iterations (from the 0.5 prior it may price a
    # draft above a decode on this CPU and wait longer than a short run for its first probe).
    out["EAGLE-logged"] = os.path.join(tmp, "EAGLE-logged")
    shutil.copytree(out["EAGLE"], out["EAGLE-logged"])
    log = {"val_accuracy_by_depth": {f"acc{d}": 0.9 for d in range(3)}}
    with open(os.path.join(out["EAGLE-logged"], "training_log.json"), "w") as f:
        json.dump(log, f)
    return out


def _generate(target: str, prompts: list[list[int]], params: list[SamplingParams],
              **kw: Any) -> list[list[int]]:  # fmt: skip
    engine = Engine(target, device="cpu", dtype="float32", max_total_tokens=2048, **kw)
    try:
        return [r["token_ids"] for r in engine.generate(prompts, params)]
    finally:
        engine.close()


def _spec(algorithm: str, head: str, steps: int, topk: int, tokens: int) -> dict[str, Any]:
    return dict(speculative_algorithm=algorithm, speculative_draft_model_path=head,
                speculative_num_steps=steps, speculative_eagle_topk=topk,
                speculative_num_draft_tokens=tokens)  # fmt: skip


def test_tp2_eagle_greedy_equals_tp2_target_only(target_dir: str, heads: dict[str, str]) -> None:
    rng = random.Random()
    prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    greedy = [SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)] * 4
    tp1 = _generate(target_dir, prompts, greedy)
    tp2 = _generate(target_dir, prompts, greedy, tp_size=2)
    assert tp2 == tp1
    tp2_overlap = _generate(target_dir, prompts, greedy, tp_size=2, disable_overlap_schedule=False)
    assert tp2_overlap == tp2
    # One sampled request rides along: its acceptance is rank 0's on both ranks.
    sampled = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.8, seed=rng.randrange(99),
                             ignore_eos=True)  # fmt: skip
    runs = {
        "EAGLE chain": _spec("EAGLE", heads["EAGLE"], 3, 1, 4),
        "EAGLE chain, overlap": {
            **_spec("EAGLE", heads["EAGLE"], 3, 1, 4),
            "disable_overlap_schedule": False,
        },  # fmt: skip
        # Each rank times its own iterations: the chosen depth must be rank 0's on both.
        "EAGLE chain, adaptive": {
            **_spec("EAGLE", heads["EAGLE-logged"], 3, 1, 4),
            "speculative_adaptive": True,
        },  # fmt: skip
        "EAGLE tree": _spec("EAGLE", heads["EAGLE"], 3, 2, 6),
        "EAGLE-3 chain": _spec("EAGLE3", heads["EAGLE3"], 2, 1, 3),
    }
    for name, spec in runs.items():
        engine = Engine(target_dir, device="cpu", dtype="float32", max_total_tokens=2048,
                        tp_size=2, **spec)  # fmt: skip
        try:
            results = engine.generate([*prompts, prompts[0]], [*greedy, sampled])
            stats = engine.stats()
        finally:
            engine.close()
        assert [r["token_ids"] for r in results[:4]] == tp2, name
        assert len(results[4]["token_ids"]) == NEW_TOKENS, name
        assert stats.spec_verify_calls_total > 0, name
        if name.startswith("EAGLE chain"):  # the good head: drafts were accepted
            assert stats.spec_accepted_tokens_total > stats.spec_verify_calls_total, name


def test_tp2_sampled_requests_without_a_seed_draft_alike_on_both_ranks(
    target_dir: str, heads: dict[str, str]
) -> None:
    """A sampled request that names no seed gets the same one on every rank: each rank draws a
    sampled chain's drafts on that seed's noise, and ranks that drafted different tokens would
    verify a mix of their shards' inputs. So the run equals one whose requests name the seeds
    rank 0 drew. (With the head that mostly guesses right, drafts are often accepted: a mixed
    verify then changes the tokens, which it rarely does where drafts are rejected.)"""
    rng = random.Random()
    prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    unseeded = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True)
    spec = _spec("EAGLE", heads["EAGLE"], 3, 1, 4)
    runs, drawn = [], []
    for named_seeds in (False, True):
        engine = Engine(target_dir, device="cpu", dtype="float32", max_total_tokens=2048,
                        tp_size=2, **spec)  # fmt: skip
        try:
            if not named_seeds:  # the seeds rank 0 draws for the requests, in their order
                seeds = copy.deepcopy(engine.scheduler.request_seeds)
                drawn = [seeds.seed_for(None) for _ in prompts]
            params = [replace(unseeded, seed=s) if named_seeds else unseeded for s in drawn]
            runs.append([r["token_ids"] for r in engine.generate(prompts, params)])
        finally:
            engine.close()
    assert runs[0] == runs[1]
    assert all(len(t) == NEW_TOKENS for t in runs[0])

"""Speculative greedy output equals target-only greedy output, token for token.

The target is a tiny random Llama whose attention and MLP outputs are scaled down, so its next
token depends mostly (not only) on the current one; an EAGLE-1 head whose fc passes the token
embedding through then predicts it well, which exercises long accepted runs, partial acceptance
and rejection. EAGLE-3 heads are random (mostly rejections) and use a reduced draft vocabulary.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any

import pytest
import torch
from conftest import SPEC_VOCAB, assert_kv_accounted, save_spec_target

from eagleserve import Engine, SamplingParams
from eagleserve.config import ModelConfig
from eagleserve.core import ScheduleBatch
from eagleserve.messages import GenerateReqInput
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.spec.head_loader import init_eagle_head, save_eagle_head

VOCAB = SPEC_VOCAB


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_spec_target(str(tmp_path_factory.mktemp("target")), 1234, VOCAB - 1, 0)


def _head_dir(target_dir: str, algorithm: str, tmp: str, quality: float, seed: int) -> str:
    runner = ModelRunner(
        ModelConfig.from_dir(target_dir), target_dir, torch.device("cpu"), torch.float32, 64, 1, 512
    )
    draft_vocab = 48 if algorithm == "EAGLE3" else None
    head = init_eagle_head(algorithm, runner.model, draft_vocab_size=draft_vocab, seed=seed)
    if algorithm == "EAGLE" and quality > 0:
        h = head.hidden_size
        with torch.no_grad():
            # fc passes the embedding of the newest token through: the head then guesses the
            # target's next token from the current one, which is mostly what the target does.
            head.fc.weight[:, :h].copy_(torch.eye(h) * quality + head.fc.weight[:, :h])
    out = os.path.join(tmp, f"{algorithm}-{quality}-{seed}")
    save_eagle_head(head, out)
    return out


@pytest.fixture(scope="module")
def heads(target_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = str(tmp_path_factory.mktemp("heads"))
    return {
        "EAGLE": _head_dir(target_dir, "EAGLE", tmp, 1.0, 0),
        "EAGLE-random": _head_dir(target_dir, "EAGLE", tmp, 0.0, 1),
        "EAGLE3": _head_dir(target_dir, "EAGLE3", tmp, 0.0, 2),
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
    algo = "EAGLE3" if head == "EAGLE3" else "EAGLE"
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


def adaptive_engine(
    target_dir: str, head_dir: str, overlap: bool, tree: bool = False, **kw: object
) -> Engine:
    return Engine(
        model=target_dir,
        device="cpu",
        kv_cache_tokens=kw.pop("kv_cache_tokens", 2048),  # type: ignore[arg-type]
        max_running_requests=8,
        disable_overlap_schedule=not overlap,
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=head_dir,
        speculative_num_steps=3,
        speculative_eagle_topk=2 if tree else 1,
        speculative_num_draft_tokens=6 if tree else 4,
        speculative_adaptive=True,
        speculative_adaptive_probe_interval=kw.pop("speculative_adaptive_probe_interval", 8),
        **kw,
    )


def script_choices(engine: Engine, choices: list[int]) -> None:
    """The controller picks k from `choices`, cycling: stretches without drafting (held head
    inputs), catch-ups, and every chain length."""
    controller = engine.scheduler.worker.controller
    assert controller is not None
    picks = iter(choices * 1000)
    controller.choose = lambda alphas, catching_up=False: next(picks)  # type: ignore[method-assign]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize(
    ("head", "tree"), [("EAGLE", False), ("EAGLE-random", False), ("EAGLE", True)]
)
def test_adaptive_greedy_lossless(
    target_dir: str,
    heads: dict[str, str],
    reference: list[list[int]],
    head: str,
    tree: bool,
    overlap: bool,
) -> None:
    # A 4-pair ring of held head inputs: the stretch of six k = 0 iterations flushes it.
    scripted = adaptive_engine(
        target_dir, heads[head], overlap, tree, speculative_adaptive_probe_interval=4
    )
    cycle = (
        [0, 0, 3, 0, 3, 3, 0, 0, 0, 0, 0, 0, 3]
        if tree
        else [0, 0, 3, 1, 0, 0, 0, 0, 0, 0, 2, 3, 0, 1]
    )
    script_choices(scripted, cycle)
    drafter = scripted.scheduler.worker.drafter
    flushes = []
    flush = drafter.flush
    drafter.flush = lambda batch, rows: (flushes.append(rows), flush(batch, rows))[1]
    assert run_staggered(scripted, _prompts(0), _params()) == reference
    hist = scripted.stats().spec_iterations_per_num_drafts
    assert all(hist[k] > 0 for k in set(cycle)), hist  # every k, 0 included, really ran
    assert flushes  # ...and full rings were flushed
    real = adaptive_engine(target_dir, heads[head], overlap, tree)
    assert run_staggered(real, _prompts(0), _params()) == reference


def test_overlap_waits_only_after_a_verify(
    target_dir: str, heads: dict[str, str], reference: list[list[int]]
) -> None:
    """With overlap, a launch waits for the forward before it to publish its lengths only when
    that forward verified drafts: after a decode without drafts the host knows them."""
    eng = adaptive_engine(target_dir, heads["EAGLE"], True)
    script_choices(eng, [0, 0, 0, 2])
    fmap, forwarder = eng.scheduler.future_map, eng.scheduler.forwarder
    assert fmap is not None and forwarder is not None
    waits: list[int] = []
    drafts: list[int | None] = []
    wait, launch = fmap.wait_published, forwarder.launch

    def counted_wait(*args: Any, **kwargs: Any) -> None:
        waits.append(1)
        wait(*args, **kwargs)

    def recorded_launch(batch: ScheduleBatch) -> Any:
        drafts.append(batch.num_drafts)  # set by plan_launch before the launch
        return launch(batch)

    fmap.wait_published = counted_wait  # type: ignore[method-assign]
    forwarder.launch = recorded_launch  # type: ignore[method-assign]
    assert run_staggered(eng, _prompts(0), _params()) == reference
    verifies = sum(1 for k in drafts if k)
    assert drafts.count(0) > 2 * verifies > 0, drafts
    assert 0 < len(waits) <= verifies, (len(waits), drafts)


def test_adaptive_retraction_keeps_tokens(
    target_dir: str, heads: dict[str, str], reference: list[list[int]]
) -> None:
    eng = adaptive_engine(target_dir, heads["EAGLE"], True, kv_cache_tokens=130)
    script_choices(eng, [0, 0, 0, 2, 0, 3])
    assert run_staggered(eng, _prompts(0), _params()) == reference
    assert eng.stats().num_retracted_total > 0


def test_adaptive_controller_follows_acceptance(target_dir: str, heads: dict[str, str]) -> None:
    """On an injected cost model: a random head (acceptance near 0) against drafts that cost
    a third of a decode each gets k = 0; the crafted head (acceptance near 1) against nearly
    free drafts gets the longest chain."""
    chosen = {}
    for head, per_draft in (("EAGLE-random", 0.35), ("EAGLE", 0.02)):
        eng = adaptive_engine(target_dir, heads[head], False)
        costs = eng.scheduler.worker.controller.costs
        for key in costs.seconds:
            costs.seconds[key] = 1.0 + per_draft * key[1]
        costs.observe = lambda *a: None  # type: ignore[method-assign]
        eng.generate(_prompts(1), SamplingParams(max_new_tokens=40, temperature=0.0))
        chosen[head] = eng.stats().spec_iterations_per_num_drafts
    rand, good = chosen["EAGLE-random"], chosen["EAGLE"]
    assert rand[0] > 3 * sum(rand[1:]), rand
    assert good[3] > 3 * sum(good[:3]), good


def test_acceptance_starts_from_the_heads_training_log(
    target_dir: str, heads: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A head trained by `eagleserve train-draft` carries its held-out accuracy by depth: the
    engine's acceptance starts there, not at a made-up prior, and a new request's own EMA
    starts from it."""
    head = str(tmp_path_factory.mktemp("logged_head") / "head")
    shutil.copytree(heads["EAGLE-random"], head)
    rng = random.Random()
    accs = [round(rng.uniform(0.05, 0.6), 4) for _ in range(2)]  # fewer depths than steps
    log = {"val_accuracy_by_depth": {f"acc{d}": a for d, a in enumerate(accs)}}
    with open(os.path.join(head, "training_log.json"), "w") as f:
        json.dump(log, f)
    eng = adaptive_engine(target_dir, head, False)
    assert eng.stats().spec_acceptance_ema == pytest.approx([*accs, accs[-1]])
    plain = adaptive_engine(target_dir, heads["EAGLE-random"], False)
    assert plain.stats().spec_acceptance_ema == [0.5] * 3


def head_kv(engine: Engine, req_pool_idx: int, length: int) -> torch.Tensor:
    drafter = engine.scheduler.worker.drafter
    slots = engine.scheduler.req_to_token_pool.req_to_token[req_pool_idx, :length]
    return drafter.kv_pool.k_buffer[0][slots].clone()


@pytest.mark.parametrize(
    "without", [0, 5, 11], ids=["draft-after-prefill", "catch-up", "flushed-rings"]
)
def test_head_kv_after_a_stretch_without_drafting(
    target_dir: str, heads: dict[str, str], without: int
) -> None:
    """After k = 0 iterations and the catch-up, the head's KV equals that of a run that ran the
    head after every token (here: a fixed 1-chain), position by position; also where the
    stretch outlasts the ring of held inputs (4 here), which is flushed twice on the way, and
    where the first decode drafts (the prompt's last row, held by the prefill, caught up)."""
    prompt = _prompts(3)[3]
    runs = {}
    for name in ("lagged", "always"):
        eng = (
            adaptive_engine(target_dir, heads["EAGLE-random"], False,
                            speculative_adaptive_probe_interval=4 if without > 8 else 8)
            if name == "lagged"
            else Engine(model=target_dir, device="cpu", kv_cache_tokens=2048,
                        max_running_requests=8, speculative_algorithm="EAGLE",
                        speculative_draft_model_path=heads["EAGLE-random"],
                        speculative_num_steps=1, speculative_eagle_topk=1,
                        speculative_num_draft_tokens=2)
        )  # fmt: skip
        if name == "lagged":
            script_choices(eng, [0] * without + [1])
        sched = eng.scheduler
        sched.add_request(
            GenerateReqInput("r", prompt, SamplingParams(max_new_tokens=30, temperature=0.0))
        )
        for _ in range(without + 2):  # prefill, the stretch, and the decode that catches up
            sched.step()
        req = sched.running_batch.reqs[0]
        runs[name] = (eng, req.req_pool_idx, req.kv_committed_len)
    n = min(length for _, _, length in runs.values())
    assert n > len(prompt) + without
    lagged, always = (head_kv(e, idx, n) for e, idx, _ in runs.values())
    torch.testing.assert_close(lagged, always, atol=1e-5, rtol=1e-5)
    for eng, _, _ in runs.values():
        for rid in ("r",):
            eng.scheduler.abort_request(rid)
        while eng.scheduler.has_work():
            eng.scheduler.step()

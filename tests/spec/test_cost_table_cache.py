"""The adaptive controller's cost table is kept in the cache directory: a second start with the
same key reuses it (no timing run), a changed key or --speculative-adaptive-retime times it
again, and a stored table is replaced whole."""

from __future__ import annotations

import copy
import glob
import json
import logging
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import SPEC_VOCAB, save_spec_target

from eagleserve import Engine, SamplingParams
from eagleserve.config import ModelConfig
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.spec.cost_table import CostTable
from eagleserve.spec.cost_table_cache import load_table, save_table, table_path
from eagleserve.spec.head_loader import init_eagle_head, save_eagle_head

pytestmark = pytest.mark.usefixtures("torch_threads")
LOGGER = "eagleserve.spec.cost_table_cache"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A cache directory of this test's own."""
    root = tmp_path / "cache"
    monkeypatch.setenv("EAGLESERVE_CACHE", str(root))
    yield root


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    tmp = tmp_path_factory.mktemp("cost_cache")
    target = save_spec_target(str(tmp / "target"), random.randrange(1 << 30), SPEC_VOCAB - 1, 0)
    runner = ModelRunner(ModelConfig.from_dir(target), target, torch.device("cpu"),
                         torch.float32, 64, 1, 512)  # fmt: skip
    head = init_eagle_head("EAGLE", runner.model, seed=random.randrange(1 << 30))
    save_eagle_head(head, str(tmp / "head"))
    return target, str(tmp / "head")


def build(model: tuple[str, str], **kw: Any) -> tuple[Engine, CostTable]:
    target, head = model
    engine = Engine(model=target, device="cpu", max_total_tokens=1024, max_running_requests=4,
                    speculative_algorithm="EAGLE", speculative_draft_model_path=head,
                    speculative_num_steps=2, speculative_num_draft_tokens=3,
                    speculative_adaptive=True, **kw)  # fmt: skip
    controller = engine.scheduler.worker.controller
    assert controller is not None
    return engine, controller.costs


def outcome(caplog: pytest.LogCaptureFixture) -> str:
    """What the last start did with its cost table, from its INFO line."""
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines, "no start-up line about the cost table"
    return "reused" if "cost table reused" in lines[-1] else "timed"


def test_second_start_reuses_the_table_and_a_changed_key_retimes(
    model: tuple[str, str], cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    first, costs1 = build(model)
    assert outcome(caplog) == "timed"
    files = glob.glob(str(cache / "cost_tables" / "*.json"))
    assert len(files) == 1
    # The stored table is the one the first engine's controller runs on.
    stored = json.loads(Path(files[0]).read_text())
    assert sorted(map(tuple, stored["table"]["seconds"])) == sorted(
        (b, k, s) for (b, k), s in costs1.seconds.items()
    )
    # The first engine refines its table online (its live figures may move when it drafts);
    # what is stored, and what a second start reads, stays the start-up figures.
    costs1 = copy.deepcopy(costs1)
    prompt = [random.randrange(1, SPEC_VOCAB - 1) for _ in range(6)]
    first.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))

    second, costs2 = build(model)
    assert outcome(caplog) == "reused"
    assert costs2.seconds == costs1.seconds and costs2.catch_up == costs1.catch_up
    assert costs2.scale == {}  # the online refinement starts over from the stored figures
    out = second.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0,
                                                   ignore_eos=True))  # fmt: skip
    assert len(out[0]["token_ids"]) == 8

    # Another thread count times a table of its own; the first one stays.
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        _, costs3 = build(model)
    finally:
        torch.set_num_threads(threads)
    assert outcome(caplog) == "timed"
    assert costs3.seconds != costs1.seconds
    assert len(glob.glob(str(cache / "cost_tables" / "*.json"))) == 2

    # Another dtype too.
    build(model, dtype="bfloat16")
    assert outcome(caplog) == "timed"
    assert len(glob.glob(str(cache / "cost_tables" / "*.json"))) == 3

    # And the original key again: reused.
    _, costs4 = build(model)
    assert outcome(caplog) == "reused"
    assert costs4.seconds == costs1.seconds


def test_retime_flag_times_the_table_again(
    model: tuple[str, str], cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    _, costs1 = build(model)
    assert outcome(caplog) == "timed"
    _, costs2 = build(model, speculative_adaptive_retime=True)
    assert outcome(caplog) == "timed"
    assert costs2.seconds != costs1.seconds
    # The re-timed table replaced the stored one (same key, one file), and is the one reused.
    assert len(glob.glob(str(cache / "cost_tables" / "*.json"))) == 1
    _, costs3 = build(model)
    assert outcome(caplog) == "reused"
    assert costs3.seconds == costs2.seconds


def random_table(rng: random.Random) -> CostTable:
    buckets = (1, 2, 4)
    return CostTable(
        buckets,
        {(b, k): rng.uniform(1e-4, 1e-1) for b in buckets for k in range(3)},
        catch_up={b: rng.uniform(1e-4, 1e-2) for b in buckets},
    )


def test_a_stored_table_is_replaced_whole(cache: Path) -> None:
    """A reader that opened the old table reads all of the old one while a new one is stored
    (the new one arrives by rename, never by rewriting the file in place), and nothing else is
    left in the folder."""
    rng = random.Random()
    key = {"buckets": [1, 2, 4], "choices": [0, 1, 2], "salt": rng.random()}
    path = table_path(key)
    old, new = random_table(rng), random_table(rng)
    save_table(path, key, old)
    with open(path) as reader:
        save_table(path, key, new)
        assert json.load(reader)["table"]["seconds"] == [
            [b, k, s] for (b, k), s in sorted(old.seconds.items())
        ]
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]
    got = load_table(path, key)
    assert got is not None and got.seconds == new.seconds and got.catch_up == new.catch_up


def test_a_partial_or_foreign_table_is_not_used(cache: Path) -> None:
    rng = random.Random()
    key = {"buckets": [1, 2, 4], "choices": [0, 1, 2], "salt": rng.random()}
    path = table_path(key)
    save_table(path, key, random_table(rng))
    text = Path(path).read_text()
    Path(path).write_text(text[: rng.randrange(1, len(text) - 1)])  # cut short
    assert load_table(path, key) is None
    save_table(path, key, random_table(rng))
    assert load_table(path, {**key, "salt": rng.random()}) is None  # stored under another key
    assert load_table(path, {**key, "choices": [0, 1]}) is None


def test_warm_up_runs_each_iteration_once_its_parts_in_serving_order(
    model: tuple[str, str],
) -> None:
    """What an accelerator runs where a stored table spares the timing, and what the timing
    times: a decode, then each depth's iteration whole as serving runs it (k - 1 head steps,
    the verify of k + 1 tokens, the head extend), then a catch-up's extend, on scratch slots
    given back afterwards."""
    from eagleserve.spec import cost_model

    engine, _ = build(model, speculative_adaptive_retime=True)
    worker = engine.scheduler.worker
    runner, drafter, kv = worker.runner, worker.drafter, engine.scheduler.kv_pool
    calls: list[tuple[str, int]] = []
    forward, head, extend = runner.forward, drafter.head.forward, drafter.extend
    runner.forward = lambda fb: (calls.append((fb.mode, fb.host.max_extend)), forward(fb))[1]
    drafter.head.forward = lambda *a: (calls.append(("head", a[0].shape[0])), head(*a))[1]
    drafter.extend = lambda fb, *a: (calls.append(("extend", fb.host.max_extend)),
                                     extend(fb, *a))[1]  # fmt: skip
    free = kv.available_size()
    cost_model.warm_up(runner, drafter, (0, 1, 2))
    assert kv.available_size() == free
    # An extend's head forward runs on the last row of each request only.
    assert calls == [("decode", 1),
                     ("verify", 2), ("extend", 2), ("head", 1),
                     ("head", 1), ("verify", 3), ("extend", 3), ("head", 1),
                     ("extend", 3), ("head", 1)]  # fmt: skip


def test_an_edit_to_the_forward_code_changes_the_key(tmp_path: Path) -> None:
    """Every part of TIMED_CODE exists (a moved folder would silently drop out of the key),
    and editing a file a forward runs changes the code digest."""
    import shutil

    from eagleserve.spec.cost_table_cache import PACKAGE, TIMED_CODE, code_digest

    for part in TIMED_CODE:
        assert os.path.exists(os.path.join(PACKAGE, part)), part
    root = tmp_path / "eagleserve"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    before = code_digest(str(root))
    edited = random.choice(["models/llama.py", "layers/attention.py",
                            "model_executor/model_runner.py", "kernels/cpu_gemv.cpp"])  # fmt: skip
    with open(root / edited, "a") as f:
        comment = "//" if edited.endswith(".cpp") else "#"
        f.write(f"\n{comment} {random.random()}\n")
    assert code_digest(str(root)) != before, edited


def test_short_context_rows_still_time_the_table(cache: Path, model: tuple[str, str]) -> None:
    """--context-length below the timing context: the start-up timing fits its scratch requests
    in a request's slot row (it wrote 128 slots into rows of fewer and failed to start), and
    the engine serves greedy output equal to target-only's."""
    max_context = random.randrange(24, 64)
    engine, costs = build(model, context_length=max_context)
    assert all(0 < s < float("inf") for s in costs.seconds.values())
    target, _ = model
    plain = Engine(model=target, device="cpu", max_total_tokens=1024, max_running_requests=4,
                   context_length=max_context)  # fmt: skip
    prompts = [[random.randrange(3, SPEC_VOCAB - 1) for _ in range(random.randrange(3, 9))]
               for _ in range(3)]  # fmt: skip
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    got = [o["token_ids"] for o in engine.generate(prompts, params)]
    assert got == [o["token_ids"] for o in plain.generate(prompts, params)]

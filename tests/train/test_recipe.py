"""`train-draft --recipe gpu` on CPU: the online feature store equals per-window teacher-forced
targets, and the whole recipe (tiny target, tiny budget, tiny shard limit) trains, saves a
sharded head that loads as the trained one, and reports held-out accuracy by depth."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from eagleserve.spec.head_loader import init_eagle_head, load_eagle_head
from eagleserve.train.cli import main
from eagleserve.train.features import IGNORE, label_map
from eagleserve.train.online import (
    FeatureStore,
    StoreSource,
    build_store,
    cut_windows,
    store_batch,
)
from eagleserve.train.recipe import device_defaults
from eagleserve.train.target import load_target, target_layer_ids
from eagleserve.train.teacher import teacher_targets
from eagleserve.train.ttt import head_step

pytestmark = pytest.mark.usefixtures("torch_threads")


def _items(n: int, seed: int) -> list[tuple[list[int], list[bool]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for m in torch.randint(5, 50, (n,), generator=g).tolist():
        ids = torch.randint(3, 256, (m,), generator=g).tolist()
        out.append((ids, (torch.rand(m, generator=g) < 0.6).tolist()))
    return out


def test_store_equals_per_window_targets(chat_target: str) -> None:
    """Windows batched with padding give each window's own teacher-forced targets: features,
    top-k mapped into the draft vocabulary, labels only where the next token is an answer."""
    target, _ = load_target(chat_target, "float32", 64)
    layers = target_layer_ids("EAGLE3", target.config.num_hidden_layers)
    items = _items(9, 1)
    wins = cut_windows(items, 16)
    assert sum(len(w) for w, _ in wins) <= sum(len(i) for i, _ in items)
    assert all(len(w) <= 16 and any(f[1:]) for w, f in wins)
    draft = torch.tensor(
        sorted(torch.randperm(256, generator=torch.Generator().manual_seed(0))[:90])
    )
    lmap = label_map(draft, 256)
    store, stats = build_store(target, wins, layers, 4, 10**6, batch_tokens=40)
    assert stats["tokens"] == store.tokens == sum(len(w) for w, _ in wins)
    for (ids, flags), (a, m) in zip(wins, store.windows, strict=True):
        need = torch.zeros(m, dtype=torch.bool)
        nxt = torch.tensor(flags[1:], dtype=torch.bool)
        need[: len(nxt)] = nxt
        f, ti, tp = teacher_targets(target, ids, layers, 4, need)
        assert store.ids[a : a + m].tolist() == ids
        assert torch.equal(store.nxt_answer[a : a + m], need)
        torch.testing.assert_close(store.feats[a : a + m].float(), f.float(), rtol=2e-2, atol=2e-2)
        agree = (store.top_ids[a : a + m][need] == ti[need]).float().mean()
        assert agree > 0.95  # ties may swap at fp16 level
        torch.testing.assert_close(store.top_p[a : a + m][need].float(), tp[need].float(),
                                   rtol=1e-2, atol=1e-3)  # fmt: skip
        assert (store.top_ids[a : a + m][~need] == -1).all()
    b = store_batch(store, store.windows[:3], lmap, depths=2, max_len=64)
    (a, m) = store.windows[1]
    assert b.x[1, :m].tolist() == wins[1][0] and not b.fmask[1, m:].any()
    tid = store.top_ids[a : a + m].long()
    mapped = torch.where(tid >= 0, lmap[tid.clamp(min=0)], IGNORE)
    assert torch.equal(b.soft_ids[1, :m], torch.where(mapped == IGNORE, -1, mapped))
    lab = torch.where(need_of(wins[1]) & (mapped[:, 0] != IGNORE), mapped[:, 0], IGNORE)
    assert torch.equal(b.y[1, :m], lab) and (b.y[1, m:] == IGNORE).all()
    assert (b.y[1, :m] != IGNORE).any() and (b.y[1, :m] == IGNORE).any()
    cut, st = build_store(target, wins, layers, 4, 10**6, batch_tokens=40, max_seconds=0.0)
    assert cut.windows == [] and st["tokens"] == 0  # out of time: nothing half-stored
    src = StoreSource(store, lmap, 4, 2, seed=0)
    seen = sorted(w for batch in src.plan(1) for w in batch)
    assert seen == sorted(store.windows)  # an epoch visits every window once


def test_extraction_stops_before_a_forward_that_would_end_past_its_limit(
    chat_target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each forward costs its padded rows at one rate (a clock the test advances): the store
    takes the forwards that end within `max_seconds` and none that would end past it; the
    first one always runs (no rate is known before it)."""
    from eagleserve.train import online

    target, _ = load_target(chat_target, "float32", 64)
    layers = target_layer_ids("EAGLE3", target.config.num_hidden_layers)
    wins = cut_windows(_items(24, int(torch.randint(0, 1000, ()))), 16)
    now = [0.0]
    forwards: list[float] = []  # each forward's end on the clock
    real = online._store_group

    def timed(model, store, group, starts, n, layer_ids, k):  # noqa: ANN001, ANN202
        real(model, store, group, starts, n, layer_ids, k)
        now[0] += 1e-3 * len(group) * n  # 1 ms a padded row
        forwards.append(now[0])

    monkeypatch.setattr(online, "_store_group", timed)
    monkeypatch.setattr(online.time, "time", lambda: now[0])
    full, _ = build_store(target, wins, layers, 4, 10**6, batch_tokens=40)
    ends = list(forwards)
    assert len(ends) > 3
    limit = (ends[1] + ends[2]) / 2  # two forwards end within it, the third would not
    forwards.clear()
    now[0] = 0.0
    cut, st = build_store(target, wins, layers, 4, 10**6, batch_tokens=40, max_seconds=limit)
    assert forwards == ends[:2] and st["seconds"] <= limit
    assert 0 < len(cut.windows) < len(full.windows)
    forwards.clear()
    now[0] = 0.0
    first, _ = build_store(target, wins, layers, 4, 10**6, batch_tokens=40, max_seconds=1e-6)
    assert len(forwards) == 1 and first.windows  # the first forward runs whatever its cost


def need_of(win: tuple[list[int], list[bool]]) -> torch.Tensor:
    ids, flags = win
    need = torch.zeros(len(ids), dtype=torch.bool)
    nxt = torch.tensor(flags[1:], dtype=torch.bool)
    need[: len(nxt)] = nxt
    return need


def test_recipe_trains_saves_sharded_and_evaluates(chat_target: str, tmp_path) -> None:
    """With a head MLP wider than the target's (--draft-intermediate-size): trained, saved and
    loaded at that width."""
    out, work = str(tmp_path / "head"), str(tmp_path / "work")
    target, _ = load_target(chat_target, "float32", 64)
    wide = target.config.intermediate_size * int(torch.randint(2, 4, (1,))) + 16
    args = ["train-draft", "--model", chat_target, "--out", out, "--recipe", "gpu",
            "--device", "cpu", "--work-dir", work, "--max-conversations", "16",
            "--max-seq-len", "400", "--max-len", "32", "--batch-size", "4", "--ttt-steps", "3",
            "--draft-vocab-size", "64", "--top-k", "4", "--val-tokens", "300",
            "--max-tokens", "1500", "--extract-batch-tokens", "128", "--max-shard-mb", "0.02",
            "--time-budget", "300", "--epochs", "3", "--lr", "3e-3", "--dtype", "float32",
            "--tokenize-procs", "2", "--val-fraction", "0.01",
            "--draft-intermediate-size", str(wide)]  # fmt: skip
    assert main(args) == 0
    shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(shards) >= 2 and "model.safetensors" not in shards
    for f in shards:  # at most the limit, or one tensor larger than it alone
        sizes = [t.nbytes for t in load_file(os.path.join(out, f)).values()]
        assert sum(sizes) <= 0.02 * 2**20 or len(sizes) == 1
    log = json.load(open(os.path.join(out, "training_log.json")))
    assert log["steps"] >= 3 and log["token_passes"] > 0 and log["tokens"] <= 1500
    assert set(log["tok_per_s"]) == {
        "data",
        "self_distill",
        "features",
        "train_token_passes",
        "train_token_depths",
    }
    val = log["val_accuracy_by_depth"]
    assert {"acc0", "acc1", "acc2"} <= set(val) and 0 <= val["acc0"] <= 1
    seen = log["train_sample_accuracy_by_depth"]  # the same measure on trained-on windows
    assert set(seen) == set(val) and all(0 <= seen[k] <= 1 for k in seen)

    # the sharded head loads as the trained one (fp32 master weights kept in --work-dir)
    state = torch.load(os.path.join(work, "trainer_state.pt"), weights_only=False)["head"]
    loaded = load_eagle_head(out, "EAGLE3", target, torch.device("cpu"), torch.float32)
    assert json.load(open(os.path.join(out, "config.json")))["intermediate_size"] == wide
    assert loaded.config.intermediate_size == wide
    trained = init_eagle_head("EAGLE3", target, draft_token_ids=loaded.to_target_ids(
        torch.arange(64)), intermediate_size=wide)  # fmt: skip
    trained.load_state_dict(state)
    assert not torch.equal(
        state["fc.weight"],
        init_eagle_head(
            "EAGLE3", target, draft_token_ids=torch.arange(64), intermediate_size=wide
        ).fc.weight,  # fmt: skip
    )  # it did train
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 256, (2, 10), generator=g)
    feats = torch.randn(2, 10, loaded.feature_size, generator=g)
    pos = torch.arange(10).expand(2, 10)
    with torch.no_grad():
        a = head_step(loaded, ids, feats, pos, [])
        b = head_step(trained, ids, feats, pos, [])
    assert all(torch.equal(x, y) for x, y in zip(a[:2], b[:2]))
    logits_a = torch.nn.functional.linear(a[0], loaded.lm_head.weight)
    assert torch.equal(logits_a, torch.nn.functional.linear(b[0], trained.lm_head.weight))

    # --eval-head scores another head (its own draft vocabulary) on the same held-out store:
    # this head, scored by a second run, gets exactly the numbers it got at the end of its own
    out2 = str(tmp_path / "head2")
    assert main([*args[:4], out2, *args[5:], "--max-steps", "1", "--eval-head", out]) == 0
    base = json.load(open(os.path.join(out2, "training_log.json")))
    base = base["baseline_val_accuracy_by_depth"]
    assert base["head"] == out and all(abs(base[k] - val[k]) < 1e-6 for k in val), (base, val)

    # --init-head trains on from a saved head. At lr 0 its one step leaves the weights as loaded:
    # the run saves them unchanged, keeps the head's width and draft vocabulary and scores what
    # the head scored.
    out3 = str(tmp_path / "head3")
    warm = [*args[:4], out3, *args[5:], "--max-steps", "1", "--lr", "0", "--init-head", out]
    assert main(warm) == 0

    def tensors(folder: str) -> dict[str, torch.Tensor]:
        return {k: v for f in os.listdir(folder) if f.endswith(".safetensors")
                for k, v in load_file(os.path.join(folder, f)).items()}  # fmt: skip

    before, after = tensors(out), tensors(out3)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    log3 = json.load(open(os.path.join(out3, "training_log.json")))
    assert log3["draft_vocab_size"] == 64
    assert all(abs(log3["val_accuracy_by_depth"][k] - val[k]) < 1e-6 for k in val)
    out4 = str(tmp_path / "head4")  # at the recipe's lr the step trains the loaded weights
    assert main([*args[:4], out4, *args[5:], "--max-steps", "1", "--init-head", out]) == 0
    assert not torch.equal(tensors(out4)["fc.weight"], before["fc.weight"])
    with pytest.raises(SystemExit, match="wide"):
        main([*warm[:-2], "--init-head", out, "--draft-intermediate-size", str(wide + 1)])
    size = warm.index("--draft-vocab-size") + 1
    with pytest.raises(SystemExit, match="never narrowed"):
        main([*warm[:size], "32", *warm[size + 1 :]])
    # A larger --draft-vocab-size widens the head (train/vocab.py): at lr 0 every weight and
    # every old token's row saved as loaded, the old vocabulary within the new one.
    out5 = str(tmp_path / "head5")
    assert main([*warm[:4], out5, *warm[5:size], "96", *warm[size + 1 :]]) == 0
    wide5 = tensors(out5)
    assert json.load(open(os.path.join(out5, "training_log.json")))["draft_vocab_size"] == 96
    assert wide5.keys() == before.keys() and wide5["lm_head.weight"].shape[0] == 96
    same = [k for k in before if k not in ("lm_head.weight", "d2t", "t2d")]
    assert all(torch.equal(before[k], wide5[k]) for k in same)
    ids = before["d2t"] + torch.arange(64)
    ids5 = wide5["d2t"] + torch.arange(96)
    at = torch.searchsorted(ids5, ids)
    assert torch.equal(ids5[at], ids)
    assert torch.equal(wide5["lm_head.weight"][at], before["lm_head.weight"])
    assert torch.equal(wide5["t2d"].nonzero().flatten(), ids5)


def test_a_store_sample_is_a_seeded_subset_of_its_windows_of_enough_rows() -> None:
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    lens = torch.randint(1, 40, (50,), generator=g).tolist()
    starts = torch.tensor([0, *lens]).cumsum(0).tolist()
    n = sum(lens)
    store = FeatureStore(torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.bool),
                         torch.zeros(n, 2), torch.zeros(n, 1, dtype=torch.int32),
                         torch.zeros(n, 1), list(zip(starts, lens)))  # fmt: skip
    want = int(torch.randint(1, n // 2, (), generator=g))
    part = store.sample(want, seed=3)
    assert len(set(part.windows)) == len(part.windows) and set(part.windows) <= set(store.windows)
    assert want <= part.tokens < want + max(lens)  # enough rows, one window past at most
    assert part.windows == store.sample(want, seed=3).windows
    assert part.windows != store.sample(want, seed=4).windows
    assert part.feats is store.feats  # a view: nothing copied
    assert store.sample(n + 1, seed=3).tokens == n


def test_recipe_out_of_memory_saves_what_it_trained_and_fails(
    chat_target: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Device memory running out mid-training (a long batch): the head trained so far is
    saved, scored and logged with the step that ran out, and the command exits 1."""
    from eagleserve.train import trainer

    real_step = trainer.train_step
    fail_at = int(torch.randint(3, 6, ()))

    def step_or_oom(head, batch, cfg, step):  # noqa: ANN001, ANN202
        if step + 1 == fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real_step(head, batch, cfg, step)

    monkeypatch.setattr(trainer, "train_step", step_or_oom)
    out = str(tmp_path / "head")
    args = ["train-draft", "--model", chat_target, "--out", out, "--recipe", "gpu",
            "--device", "cpu", "--max-conversations", "16", "--max-seq-len", "400",
            "--max-len", "32", "--batch-size", "4", "--ttt-steps", "2",
            "--draft-vocab-size", "64", "--top-k", "4", "--val-tokens", "300",
            "--max-tokens", "1500", "--time-budget", "300", "--epochs", "3",
            "--tokenize-procs", "2", "--val-fraction", "0.01"]  # fmt: skip
    assert main(args) == 1
    log = json.load(open(os.path.join(out, "training_log.json")))
    assert log["steps"] == fail_at - 1
    assert log["train_metrics_ema"]["out_of_memory_at_step"] == fail_at
    assert {"acc0", "acc1"} <= set(log["val_accuracy_by_depth"])
    target, _ = load_target(chat_target, "float32", 64)
    load_eagle_head(out, "EAGLE3", target, torch.device("cpu"), torch.float32)  # servable


def test_device_defaults_fill_only_what_was_left_unset() -> None:
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    ns = argparse.Namespace(batch_size=None, extract_batch_tokens=None)
    device_defaults(ns, gpu)
    assert (ns.batch_size, ns.extract_batch_tokens) == (64, 65536)
    ns = argparse.Namespace(batch_size=None, extract_batch_tokens=None)
    device_defaults(ns, cpu)  # a CPU forward of 65536 rows overran a 40 s extraction limit
    assert (ns.batch_size, ns.extract_batch_tokens) == (8, 4096)
    ns = argparse.Namespace(batch_size=12, extract_batch_tokens=1024)  # the user's stay
    device_defaults(ns, gpu)
    assert (ns.batch_size, ns.extract_batch_tokens) == (12, 1024)

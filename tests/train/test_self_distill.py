"""Self-distillation data (train/self_distill.py): the items are exactly the engine's greedy
tokens for the templated prompts, benchmark prompts stay out, a second call reads the cache
instead of generating, and `train-draft --recipe gpu --self-distill` trains on them."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from transformers import AutoTokenizer

from eagleserve import Engine
from eagleserve.sampling_params import SamplingParams
from eagleserve.spec.head_loader import load_eagle_head
from eagleserve.train.cli import main
from eagleserve.train.conversations import (
    conversation_order,
    held_out_prompts,
    probe_keys,
    sharegpt_conversations,
)
from eagleserve.train.data import sharegpt_path
from eagleserve.train.self_distill import (
    SelfDistillConfig,
    cache_key,
    chat_prompt_ids,
    distill_prompts,
    model_identity,
    sampling_params,
    self_distill_items,
)
from eagleserve.train.target import load_target

pytestmark = pytest.mark.usefixtures("torch_threads")


def _convs(n: int, seed: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "tree", "river", "code", "sum", "why", "list"]
    out = []
    for _ in range(n):
        q = " ".join(rng.choice(words) for _ in range(rng.randint(2, 9)))
        out.append([{"role": "user", "content": q}, {"role": "assistant", "content": "ok"}])
    return out


def _engine(path: str, batch: int) -> Engine:
    return Engine(model=path, device="cpu", dtype="float32", max_running_requests=batch,
                  max_total_tokens=batch * 128 + 128, disable_overlap_schedule=True)  # fmt: skip


def test_items_are_the_engines_greedy_tokens_and_cached(chat_target: str, tmp_path) -> None:
    tok = AutoTokenizer.from_pretrained(chat_target)
    convs = _convs(11, seed=random.randrange(10**6))
    probe = "Write a function that sums the even numbers of a list and explains itself"
    convs.insert(4, [{"role": "user", "content": f"Please: {probe}."},
                     {"role": "assistant", "content": "no"}])  # fmt: skip
    cfg = SelfDistillConfig(mode="add", max_new_tokens=10, batch_size=3, max_prompt_tokens=90)
    prompts = distill_prompts(tok, convs, probe_keys([probe]), cfg)
    every = [chat_prompt_ids(tok, c[0]["content"]) for i, c in enumerate(convs) if i != 4]
    assert prompts == [p for p in every if len(p) <= 90]  # the benchmark prompt stays out
    assert len(prompts) >= 5
    assert len(distill_prompts(tok, convs, [], SelfDistillConfig(max_prompts=5))) == 5

    built: list[Engine] = []

    def make() -> Engine:
        built.append(_engine(chat_target, cfg.batch_size))
        return built[-1]

    key = cache_key(model_identity(chat_target), "cpu/float32", cfg, prompts)
    items, stats = self_distill_items(make, prompts, cfg, key, str(tmp_path), max_seq_len=10**4)
    assert len(built) == 1 and stats["cached"] is False and stats["prompts"] == len(prompts)
    assert stats["tokens"] == sum(len(ids) for ids, _ in items) - sum(map(len, prompts))

    # an independent engine, one prompt at a time, gives the same tokens
    ref = _engine(chat_target, 1)
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    for p, (ids, flags) in zip(prompts, items, strict=True):
        ans = ref.generate([p], greedy)[0]["token_ids"]
        assert ids == p + ans
        assert flags == [False] * len(p) + [True] * len(ans)

    again, st2 = self_distill_items(make, prompts, cfg, key, str(tmp_path), max_seq_len=10**4)
    assert len(built) == 1 and st2["cached"] is True and again == items  # no engine built

    cut, _ = self_distill_items(make, prompts, cfg, key, str(tmp_path), max_seq_len=8)
    assert all(len(ids) <= 8 and len(f) == len(ids) for ids, f in cut)
    # settings that change the tokens change the key; the batch size does not
    other = SelfDistillConfig(mode="add", max_new_tokens=11, batch_size=3)
    assert cache_key(model_identity(chat_target), "cpu/float32", other, prompts) != key
    same = SelfDistillConfig(mode="replace", max_new_tokens=10, batch_size=64)
    assert cache_key(model_identity(chat_target), "cpu/float32", same, prompts) == key


def test_sampled_answers_follow_the_per_prompt_seed(chat_target: str, tmp_path) -> None:
    """At temperature > 0 each prompt is sampled with its own seed: the answers equal an
    independent engine's sampled with those seeds, and another --seed changes them."""
    tok = AutoTokenizer.from_pretrained(chat_target)
    prompts = distill_prompts(tok, _convs(5, seed=random.randrange(10**6)), [],
                              SelfDistillConfig())  # fmt: skip
    assert prompts
    cfg = SelfDistillConfig(mode="replace", max_new_tokens=12, temperature=0.9, batch_size=4,
                            seed=3)  # fmt: skip
    items, _ = self_distill_items(lambda: _engine(chat_target, 4), prompts, cfg, "a",
                                  str(tmp_path), 10**4)  # fmt: skip
    ref = _engine(chat_target, 1)
    for i, (p, (ids, _)) in enumerate(zip(prompts, items, strict=True)):
        assert ids == p + ref.generate([p], sampling_params(cfg, i))[0]["token_ids"]
    cfg2 = SelfDistillConfig(mode="replace", max_new_tokens=12, temperature=0.9, batch_size=4,
                             seed=4)  # fmt: skip
    items2, _ = self_distill_items(lambda: _engine(chat_target, 4), prompts, cfg2, "b",
                                   str(tmp_path), 10**4)  # fmt: skip
    assert items2 != items


def test_recipe_trains_on_self_distilled_answers(chat_target: str, tmp_path) -> None:
    out, cache = str(tmp_path / "head"), str(tmp_path / "sd")
    args = ["train-draft", "--model", chat_target, "--out", out, "--recipe", "gpu",
            "--device", "cpu", "--work-dir", str(tmp_path / "work"),
            "--max-conversations", "12", "--max-seq-len", "400", "--max-len", "32",
            "--batch-size", "4", "--ttt-steps", "2", "--draft-vocab-size", "64", "--top-k", "4",
            "--val-tokens", "200", "--max-tokens", "1200", "--extract-batch-tokens", "128",
            "--time-budget", "300", "--epochs", "1", "--max-steps", "4", "--dtype", "float32",
            "--tokenize-procs", "1", "--val-fraction", "0.01", "--self-distill", "add",
            "--self-distill-max-prompts", "5", "--self-distill-max-new-tokens", "12",
            "--self-distill-max-prompt-tokens", "300", "--self-distill-batch-size", "5",
            "--self-distill-cache-dir", cache]  # fmt: skip
    assert main(args) == 0
    log = json.load(open(os.path.join(out, "training_log.json")))
    sd = log["self_distill"]
    assert sd["prompts"] == 5 and sd["cached"] is False and sd["tokens"] > 0
    assert log["steps"] >= 1 and log["tok_per_s"]["self_distill"] > 0
    target, _ = load_target(chat_target, "float32", 64)
    head = load_eagle_head(out, "EAGLE3", target, torch.device("cpu"), torch.float32)
    assert head.draft_vocab_size == 64

    # the prompts are the first user turns of held-in conversations only
    convs = sharegpt_conversations(sharegpt_path())
    train_i, val_i = conversation_order(len(convs), 0, 0.01)
    tok = AutoTokenizer.from_pretrained(chat_target)
    cfg = SelfDistillConfig(max_prompts=5, max_prompt_tokens=300)
    keys = probe_keys(held_out_prompts())
    want = distill_prompts(tok, [convs[i] for i in train_i[:12]], keys, cfg)
    (entry,) = [os.path.join(cache, f) for f in os.listdir(cache)]
    cached = json.load(open(entry))
    assert cached["prompts"] == want and len(cached["answers"]) == 5
    val_first = {tuple(chat_prompt_ids(tok, convs[i][0]["content"])) for i in val_i}
    assert not val_first & {tuple(p) for p in cached["prompts"]}

    # a second run (training on the generated answers only; the chit-chat conversations come
    # after ShareGPT's, so the first 5 prompts are the same) reuses them
    out2 = str(tmp_path / "head2")
    args2 = [*args[:4], out2, *args[5:], "--extra-conversations", "chitchat"]
    args2[args2.index("add")] = "replace"
    assert main(args2) == 0
    log2 = json.load(open(os.path.join(out2, "training_log.json")))
    assert log2["self_distill"]["cached"] is True and log2["self_distill"]["path"] == entry
    assert log2["data_tokens"] > log["data_tokens"]  # the chit-chat turns were tokenized
    assert log2["tokens"] <= sd["tokens"] + 5 * 300  # trained on prompts + answers only

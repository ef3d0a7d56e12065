"""Teacher-forced data: targets equal an independent forward, shards round-trip, the soft-label
loss is the cross-entropy it claims, conversations are flagged turn by turn, and training on
shards resumes bit for bit."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoTokenizer
from transformers import LlamaForCausalLM as HFLlama

from eagleserve.train.batches import soft_cross_entropy
from eagleserve.train.cli import main
from eagleserve.train.conversations import tokenize_conversation
from eagleserve.train.dense_backend import hidden_states_entering
from eagleserve.train.extract import extract, self_distilled_items
from eagleserve.train.shards import Seq, ShardWriter, load_shard, read_index
from eagleserve.train.target import load_target, target_layer_ids
from eagleserve.train.teacher import teacher_targets

pytestmark = pytest.mark.usefixtures("torch_threads")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _seqs(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(6, 40, (n,), generator=g).tolist()
    seqs = [torch.randint(3, 256, (m,), generator=g).tolist() for m in lens]
    return seqs, [m // 3 for m in lens]


@pytest.fixture(scope="module")
def target(tiny_model_dir: str) -> object:
    return load_target(tiny_model_dir, "float32", 64)[0]


def test_teacher_targets_equal_an_independent_forward(tiny_model_dir: str, target) -> None:
    """Features == the existing feature path bit for bit, and == transformers' hidden states;
    top-k == transformers' softmax top-k; rows not asked for carry no distribution."""
    layers = target_layer_ids("EAGLE3", target.config.num_hidden_layers)
    ids = _seqs(1, 5)[0][0]
    need = torch.rand(len(ids), generator=torch.Generator().manual_seed(0)) < 0.7
    feats, top_ids, top_p = teacher_targets(target, ids, layers, 8, need)
    ref = hidden_states_entering(target, [torch.tensor(ids)], layers)
    assert torch.equal(feats, ref.to(torch.bfloat16))
    hf = HFLlama.from_pretrained(tiny_model_dir).float().eval()
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    hf_feats = torch.cat([out.hidden_states[i][0] for i in sorted(layers)], dim=-1)
    torch.testing.assert_close(ref, hf_feats, rtol=1e-4, atol=1e-4)
    p_ref, i_ref = out.logits[0].softmax(-1).topk(8)
    torch.testing.assert_close(top_p[need].float(), p_ref[need], rtol=2e-3, atol=1e-4)
    assert (top_ids[need] == i_ref[need]).float().mean() > 0.95  # ties may swap at fp16 level
    assert (top_ids[~need] == -1).all() and (top_p[~need] == 0).all()


def test_shards_round_trip_and_resume(tmp_path, target) -> None:
    seqs, plens = _seqs(7, 1)
    items = self_distilled_items(seqs, plens)
    layers = target_layer_ids("EAGLE3", target.config.num_hidden_layers)
    w = ShardWriter(str(tmp_path), shard_tokens=60, meta={"k": 4})
    stats = extract(target, items[:4], w, layers, 4, max_tokens=10**6, max_minutes=1e9)
    assert read_index(str(tmp_path))["cursor"] == 4
    w2 = ShardWriter(str(tmp_path), shard_tokens=60, meta={"k": 4})  # resumes from the cursor
    extract(target, items, w2, layers, 4, max_tokens=10**6, max_minutes=1e9)
    index = read_index(str(tmp_path))
    assert index["cursor"] == 7 and len(index["shards"]) >= 3
    got = [s for e in index["shards"] for s in load_shard(str(tmp_path), e)]
    assert [s.ids.tolist() for s in got] == seqs
    assert stats["tokens"] == sum(len(s) for s in seqs[:4])
    for s, ids, p in zip(got, seqs, plens):
        assert s.answer.tolist() == [i >= p for i in range(len(ids))]
        f, ti, tp = teacher_targets(target, ids, layers, 4, torch.ones(len(ids), dtype=torch.bool))
        assert torch.equal(s.feats, f)
        keep = torch.zeros(len(ids), dtype=torch.bool)
        keep[:-1] = s.answer[1:]  # distributions are stored where the next token is an answer
        assert torch.equal(s.top_ids[keep], ti[keep]) and torch.equal(s.top_p[keep], tp[keep])
        assert (s.top_ids[~keep] == -1).all()


def test_write_then_load_is_exact(tmp_path) -> None:
    g = torch.Generator().manual_seed(2)
    seqs = [
        Seq(
            torch.randint(0, 99, (n,), dtype=torch.int32, generator=g),
            torch.rand(n, generator=g) < 0.5,
            torch.randn(n, 6, generator=g).to(torch.bfloat16),
            torch.randint(-1, 99, (n, 3), dtype=torch.int32, generator=g),
            torch.rand(n, 3, generator=g).to(torch.float16),
        )
        for n in (5, 9, 2)
    ]
    w = ShardWriter(str(tmp_path), shard_tokens=10**6, meta={})
    for i, s in enumerate(seqs):
        w.add(s, cursor=i + 1)
    assert read_index(str(tmp_path)) is None  # nothing flushed yet
    w.flush(cursor=3)
    back = load_shard(str(tmp_path), read_index(str(tmp_path))["shards"][0])
    for a, b in zip(seqs, back):
        for name in ("ids", "answer", "feats", "top_ids", "top_p"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_soft_cross_entropy() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=g)
    labels = torch.tensor([0, 3, 10, 7, 7])
    ids = torch.stack([labels, torch.full((5,), -1), (labels + 1) % 11], dim=1)
    one_hot = torch.tensor([[1.0, 0.3, 0.0]]).expand(5, 3)  # the -1 entry is dropped
    torch.testing.assert_close(
        soft_cross_entropy(logits, ids, one_hot), F.cross_entropy(logits, labels)
    )
    # Hand-computed: logits (0, ln 3) over two tokens, target mass (0.2, 0.6) -> q = (1/4, 3/4);
    # log softmax = (ln 1/4, ln 3/4); loss = -(1/4 ln 1/4 + 3/4 ln 3/4).
    val = soft_cross_entropy(
        torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([[0, 1, -1]]),
        torch.tensor([[0.2, 0.6, 0.2]]),
    )  # fmt: skip
    want = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert abs(val.item() - want) < 1e-6


def test_conversation_flags_mark_exactly_the_answers(tiny_model_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = CHATML
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok?"},
        {"role": "assistant", "content": "sure"},
    ]
    ids, flags = tokenize_conversation(tok, msgs, 10**6)
    assert ids == tok.encode(
        tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False
    )
    answer = "".join(tok.decode([t]) for t, f in zip(ids, flags) if f)
    assert answer == "yo<|im_end|>\nsure<|im_end|>\n"
    assert tokenize_conversation(tok, msgs, 50) is None  # cut before any answer token
    cut = tokenize_conversation(tok, msgs, 60)
    assert cut is not None and cut[0] == ids[:60] and cut[1] == flags[:60]


def test_train_on_shards_resumes_bit_for_bit(tmp_path, tiny_model_dir: str, target) -> None:
    layers = target_layer_ids("EAGLE3", target.config.num_hidden_layers)
    seqs, plens = _seqs(24, 3)
    shards = str(tmp_path / "shards")
    extract(target, self_distilled_items(seqs, plens), ShardWriter(shards, 200, {"k": 8}),
            layers, 8, max_tokens=10**6, max_minutes=1e9)  # fmt: skip
    args = ["train-draft", "--model", tiny_model_dir, "--data-source", "teacher-forced",
            "--shards", shards, "--epochs", "1.5", "--batch-size", "4", "--max-len", "24",
            "--ttt-steps", "3", "--draft-vocab-size", "128", "--dtype", "float32",
            "--save-every", "2", "--lr", "3e-3"]  # fmt: skip
    whole, split = str(tmp_path / "whole"), str(tmp_path / "split")
    vseqs, vplens = _seqs(6, 4)
    extract(target, self_distilled_items(vseqs, vplens), ShardWriter(f"{whole}/val_shards", 200,
            {"k": 8}), layers, 8, max_tokens=10**6, max_minutes=1e9)  # fmt: skip
    assert main([*args, "--out", whole]) == 0
    assert main([*args, "--out", split, "--max-steps", "3"]) == 0
    assert torch.load(os.path.join(split, "trainer_state.pt"), weights_only=False)["step"] == 3
    assert main([*args, "--out", split, "--resume"]) == 0
    a = load_file(os.path.join(whole, "model.safetensors"))
    b = load_file(os.path.join(split, "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    s = torch.load(os.path.join(whole, "trainer_state.pt"), weights_only=False)
    assert s["step"] > 3 and s["metrics"]["loss"] > 0

    # --eval-head on the held-out shards reproduces the end-of-training evaluation
    val = json.load(open(os.path.join(whole, "training_log.json")))["val_accuracy_by_depth"]
    ev = [*args[:-6], "--out", whole, "--eval-head", whole, "--shards", f"{whole}/val_shards"]
    assert main(ev) == 0
    got = json.load(open(os.path.join(whole, "eval_whole.json")))
    assert val["acc0"] > 0 and set(val) <= set(got)
    assert all(abs(val[k] - got[k]) < 1e-6 for k in val), (val, got)
    # --eval-head alone implies teacher-forced shards; with self-distilled data it is refused,
    # not ignored while a fresh head trains.
    bare = [a for a in ev if a not in ("--data-source", "teacher-forced")]
    os.remove(os.path.join(whole, "eval_whole.json"))
    assert main(bare) == 0
    assert json.load(open(os.path.join(whole, "eval_whole.json"))) == got
    with pytest.raises(SystemExit, match="teacher-forced shards"):
        main([*bare, "--data-source", "self-distilled"])


def test_window_batch_aligns_labels_with_rows() -> None:
    """Row t of a window at a: token ids[a+t], label = the stored top-k at a+t where token
    a+t+1 is an answer and the argmax is in the draft vocab; padding rows are ignored."""
    from eagleserve.train.features import IGNORE, label_map
    from eagleserve.train.shard_data import window_batch, windows

    n, k = 9, 3
    ids = torch.arange(10, 10 + n, dtype=torch.int32)
    answer = torch.tensor([0, 0, 0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    top_ids = torch.stack([ids + 1, ids + 2, torch.full((n,), 99, dtype=torch.int32)], 1)
    top_ids[1, 0] = 50  # an argmax outside the draft vocabulary
    seq = Seq(ids, answer, torch.randn(n, 4).to(torch.bfloat16), top_ids, torch.rand(n, k).half())
    draft = torch.tensor(sorted({*range(10, 25)} - {17}))  # 17 = ids[6] + 1 left out
    lmap = label_map(draft, 128)
    assert windows([n], 4) == [(0, 0, 4), (0, 4, 4), (0, 8, 1)]
    wins = [(0, 0, 4), (0, 4, 4), (0, 8, 1)]
    # Windows of 4 pad to the length bucket (64) where windows may be that long, never further
    b = window_batch([seq], wins, lmap, depths=2, max_len=1000)
    assert b.x.shape == (3, 64 + 2) and not b.fmask[:, 4:].any() and (b.x[:, 4:] == 0).all()
    assert window_batch([seq], wins, lmap, depths=2, max_len=40).x.shape == (3, 40 + 2)
    b = window_batch([seq], wins, lmap, depths=2, max_len=4)
    assert b.x.shape == (3, 6) and b.x[1, :4].tolist() == [14, 15, 16, 17]
    want = [[IGNORE, IGNORE, lmap[13], lmap[14]], [lmap[15], IGNORE, IGNORE, lmap[18]]]
    assert b.y[0, :4].tolist() == want[0] and b.y[1, :4].tolist() == want[1]
    assert (b.y[2] == IGNORE).all() and (b.y[:, 4:] == IGNORE).all()  # sequence end, padding
    assert b.soft_ids[0, 2].tolist() == [lmap[13], lmap[14], -1]  # 99 is outside: -1
    assert torch.equal(b.soft_p[1, :4], seq.top_p[4:8].float())
    assert torch.equal(b.f[1, :4], seq.feats[4:8].float()) and not b.fmask[2, 1:].any()

"""Training a head on teacher-forced shards (the second half of `--data-source teacher-forced`)."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from eagleserve.train.features import IGNORE, label_map
from eagleserve.train.shard_data import ShardSource, answer_token_counts, shard_entries
from eagleserve.train.trainer import TrainConfig, train_head, train_step
from eagleserve.train.training_log import write_training_log
from eagleserve.train.vocab import DEFAULT_DRAFT_VOCAB, vocab_from_counts


@torch.no_grad()
def evaluate_shards(head: object, source: ShardSource, cfg: TrainConfig) -> dict[str, float]:
    """Per-depth top-1 accuracy against the target's argmax: `acc{d}` over the answer rows
    whose argmax the head can draft (in its vocabulary), `acc{d}_all` over every answer row (an
    argmax outside the vocabulary is a miss: the measure that compares heads of different
    vocabularies); and the share of answer rows whose argmax is outside the vocabulary."""
    hits: dict[int, float] = {}
    rows: dict[int, float] = {}
    every: dict[int, float] = {}
    outside = answer_rows = 0
    for within in range(source.per_epoch):
        batch = source.batch(0, within)
        t = batch.f.shape[1] - cfg.depths - 1  # train_step's label columns s+1 .. s+t
        labelled = batch.soft_p[..., 0] > 0  # rows whose next token is an answer token
        _, m = train_step(head, batch, cfg, 0)
        for s in range(cfg.depths):
            cols = slice(s + 1, s + 1 + t)
            n = int((batch.y[:, cols] != IGNORE).sum())
            hits[s] = hits.get(s, 0.0) + float(m[f"acc{s}"]) * n
            rows[s] = rows.get(s, 0.0) + n
            every[s] = every.get(s, 0.0) + int(labelled[:, cols].sum())
        answer_rows += int(labelled.sum())
        outside += int((labelled & (batch.y == IGNORE)).sum())
    out = {f"acc{s}": hits[s] / max(1.0, rows[s]) for s in hits}
    out |= {f"acc{s}_all": hits[s] / max(1.0, every[s]) for s in hits}
    out["argmax_outside_draft_vocab"] = outside / max(1, answer_rows)
    return out


def head_accuracy(ns: argparse.Namespace) -> dict:
    """Per-depth accuracy of the saved head `ns.eval_head` on `ns.shards` (default
    OUT/val_shards): the same measure as the end-of-training one."""
    from eagleserve.spec.head_loader import load_eagle_head
    from eagleserve.train.assets import resolve_head_path
    from eagleserve.train.target import load_target

    target, _ = load_target(ns.model, "float32", ns.max_len + 16)
    path = resolve_head_path(ns.eval_head)
    head = load_eagle_head(path, ns.algorithm, target, torch.device("cpu"), torch.float32).eval()
    draft_ids = head.to_target_ids(torch.arange(head.draft_vocab_size))
    lmap = label_map(draft_ids, target.config.vocab_size)
    dirs = ns.shards or [os.path.join(ns.out, "val_shards")]
    src = ShardSource(shard_entries(dirs), lmap, ns.batch_size, ns.max_len, ns.ttt_steps, ns.seed)
    cfg = TrainConfig(out_dir=ns.out, batch_size=ns.batch_size, max_len=ns.max_len,
                      depths=ns.ttt_steps, seed=ns.seed, soft_labels=True)  # fmt: skip
    return {"head": ns.eval_head, "shards": dirs, **evaluate_shards(head, src, cfg)}


def eval_head_on_shards(ns: argparse.Namespace) -> int:
    """`--eval-head PATH`: head_accuracy, written to OUT/eval_<name>.json."""
    from eagleserve.train.assets import resolve_head_path

    res = head_accuracy(ns)
    name = os.path.basename(os.path.normpath(resolve_head_path(ns.eval_head)))
    os.makedirs(ns.out, exist_ok=True)
    with open(os.path.join(ns.out, f"eval_{name}.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res))
    return 0


def train_on_shards(ns: argparse.Namespace, extract_stats: dict) -> int:
    from eagleserve.spec.head_loader import save_eagle_head
    from eagleserve.train.target import fresh_head, load_target

    t0 = time.time()
    # The head trains in fp32 next to an fp32 target (it reads the target's embeddings).
    target, _ = load_target(ns.model, "float32", ns.max_len + 16)
    vocab = target.config.vocab_size
    entries = shard_entries(ns.shards or [os.path.join(ns.out, "shards")])
    vocab_path = os.path.join(ns.out, "draft_vocab.pt")
    draft_ids = None
    if ns.algorithm == "EAGLE3":
        if os.path.exists(vocab_path):  # fixed on the first run: --resume must not change it
            draft_ids = torch.load(vocab_path)
        else:
            size = min(ns.draft_vocab_size or DEFAULT_DRAFT_VOCAB, vocab)
            draft_ids = vocab_from_counts(answer_token_counts(entries), size, vocab)
            torch.save(draft_ids, vocab_path)
    head = fresh_head(ns, ns.algorithm, target, draft_ids)
    ckpt = os.path.join(ns.out, "trainer_state.pt")
    state = torch.load(ckpt, weights_only=False) if ns.resume and os.path.exists(ckpt) else None
    if state is not None:
        head.load_state_dict(state["head"])
    cfg = TrainConfig(
        out_dir=ns.out, lr=ns.lr, batch_size=ns.batch_size, max_len=ns.max_len,
        epochs=ns.epochs, max_minutes=ns.max_minutes, depths=ns.ttt_steps,
        compute_dtype=ns.compute_dtype, save_every=ns.save_every, seed=ns.seed,
        max_steps=ns.max_steps, soft_labels=ns.loss == "soft",
    )  # fmt: skip
    lmap = label_map(draft_ids, vocab)
    source = ShardSource(entries, lmap, ns.batch_size, ns.max_len, ns.ttt_steps, ns.seed)
    t_setup = time.time()
    head.train()
    metrics = train_head(head, source, cfg, state)
    head.eval()
    t_train = time.time()
    val_dir = os.path.join(ns.out, "val_shards")
    val = {}
    if os.path.exists(os.path.join(val_dir, "index.json")):
        vsrc = ShardSource(shard_entries([val_dir]), lmap, ns.batch_size, ns.max_len,
                           ns.ttt_steps, ns.seed)  # fmt: skip
        val = evaluate_shards(head, vsrc, cfg)
    if ns.dtype == "bfloat16":
        head = head.to(torch.bfloat16)
    save_eagle_head(head, ns.out)
    tokens = sum(sum(e["seq_lens"]) for _, e in entries)
    log = {
        "model": ns.model,
        "algorithm": ns.algorithm,
        "source": "teacher-forced shards " + ", ".join(sorted({d for d, _ in entries})),
        "tokens": tokens,
        "answer_tokens": sum(e["answer_tokens"] for _, e in entries),
        "shards": len(entries),
        "draft_vocab_size": head.draft_vocab_size,
        "loss": ns.loss,
        "extract": extract_stats,
        "minutes": {"setup": (t_setup - t0) / 60, "train": (t_train - t_setup) / 60},
        "token_depths_per_s": metrics.get("token_depths_per_s"),
        "train_metrics_ema": metrics,
        "val_accuracy_by_depth": val,
    }
    write_training_log(ns, log, ("tokens", "val_accuracy_by_depth"))
    return 0

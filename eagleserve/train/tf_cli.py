"""`train-draft --data-source teacher-forced`: extract shards, then train on soft labels.

The target runs once over whole ShareGPT conversations (all turns; MT-bench and HumanEval
prompts kept out) plus any self-distilled `--data` files; features and top-k distributions go
to `OUT/shards` (held-out conversations to `OUT/val_shards`). Training streams the shards.
"""

from __future__ import annotations

import argparse
import os

import torch

from eagleserve.train.conversations import sharegpt_split, tokenize_unless_leak
from eagleserve.train.data import load_sequences, sharegpt_path
from eagleserve.train.extract import Source, extract, mixed_order, self_distilled_items
from eagleserve.train.shards import ShardWriter
from eagleserve.train.target import load_target, target_layer_ids


def add_tf_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("teacher-forced data (--data-source teacher-forced)")
    g.add_argument("--data-source", default=None, choices=["self-distilled", "teacher-forced"],
                   help="default: teacher-forced where --shards or --eval-head (both read "
                   "shards) is given, else self-distilled")  # fmt: skip
    g.add_argument("--max-tokens", type=int, default=None,
                   help="training tokens to extract (default: 2 M into shards; with --recipe gpu, "
                   "as many as the feature store holds)")  # fmt: skip
    g.add_argument("--val-tokens", type=int, default=40_000, help="held-out tokens to extract")
    g.add_argument("--extract-minutes", type=float, default=60.0, help="extraction time budget")
    g.add_argument("--max-seq-len", type=int, default=2048, help="conversation cut (tokens)")
    g.add_argument("--top-k", type=int, default=32, help="target probabilities kept per token")
    g.add_argument("--shard-tokens", type=int, default=65536)
    g.add_argument("--extract-dtype", default="bfloat16", choices=["bfloat16", "float32", "served"],
                   help="target form for extraction ('served': the engine's default, e.g. packed "
                   "int4 for a GGUF)")  # fmt: skip
    g.add_argument("--shards", nargs="*", default=None, help="train on these shard folders "
                   "(default OUT/shards)")  # fmt: skip
    g.add_argument("--extract-only", action="store_true", help="stop after extraction")
    g.add_argument("--eval-head", default=None, help="only evaluate this head on --shards "
                   "(default OUT/val_shards): per-depth accuracy")  # fmt: skip
    g.add_argument("--loss", default="soft", choices=["soft", "hard"],
                   help="soft: CE against the target's top-k; hard: its argmax")  # fmt: skip


def extract_data(ns: argparse.Namespace, target: object, tok: object) -> dict:
    """Extracts (or resumes extracting) OUT/val_shards and OUT/shards; returns their stats."""
    layers = target_layer_ids(ns.algorithm, target.config.num_hidden_layers)
    convs, train_i, val_i, keys = sharegpt_split(sharegpt_path(), ns.seed, ns.val_fraction)

    def conv(i: int) -> Source:
        return lambda: tokenize_unless_leak(tok, convs[i], keys, ns.max_seq_len)

    distilled: list[Source] = []
    for path in ns.data:
        seqs, lens, _ = load_sequences(path)
        distilled += self_distilled_items([s[: ns.max_seq_len] for s in seqs], lens)
    meta = {
        "layer_ids": list(layers),
        "k": ns.top_k,
        "extract_dtype": ns.extract_dtype,
        "sources": f"ShareGPT_V3 all turns ({len(train_i)} train / {len(val_i)} held-out "
        f"conversations, seed {ns.seed})"
        + (f" + self-distilled {list(ns.data)}" if ns.data else ""),
    }
    stats = {}
    for name, items, budget, minutes in (
        ("val_shards", [conv(i) for i in val_i], ns.val_tokens, float("inf")),
        ("shards", mixed_order([[conv(i) for i in train_i], distilled], ns.seed),
         ns.max_tokens or 2_000_000, ns.extract_minutes),
    ):  # fmt: skip
        writer = ShardWriter(os.path.join(ns.out, name), ns.shard_tokens, meta)
        stats[name] = extract(target, items, writer, layers, ns.top_k, budget, minutes, name)
        print(name, stats[name], flush=True)
    return stats


def resolve_data_source(given: str | None, shards: list[str] | None, eval_head: str | None) -> str:
    """--data-source as given, or by what else was asked for: --shards and --eval-head read
    teacher-forced shards. Self-distilled data with either is refused: it would train a fresh
    head and ignore them."""
    reads_shards = shards is not None or eval_head is not None
    if given is None:
        return "teacher-forced" if reads_shards else "self-distilled"
    if given == "self-distilled" and reads_shards:
        raise SystemExit("train-draft: --shards and --eval-head read teacher-forced shards; "
                         "they do not apply to --data-source self-distilled")  # fmt: skip
    return given


def run_teacher_forced(ns: argparse.Namespace) -> int:
    if ns.threads:
        torch.set_num_threads(ns.threads)
    torch.manual_seed(ns.seed)
    if ns.eval_head:
        from eagleserve.train.tf_train import eval_head_on_shards

        return eval_head_on_shards(ns)
    os.makedirs(ns.out, exist_ok=True)
    stats = {}
    if ns.shards is None:
        target, tok = load_target(ns.model, ns.extract_dtype, ns.max_seq_len)
        stats = extract_data(ns, target, tok)
        del target
    if ns.extract_only:
        return 0
    from eagleserve.train.tf_train import train_on_shards

    return train_on_shards(ns, stats)

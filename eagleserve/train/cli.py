"""`eagleserve train-draft`: self-distill an EAGLE / EAGLE3 head for a served Llama-family model."""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from eagleserve.train.data import (
    build_dataset,
    first_human_turns,
    load_sequences,
    save_sequences,
    sharegpt_path,
    split_held_out,
)
from eagleserve.train.features import (
    answer_coverage,
    draft_vocab,
    feature_layers,
    label_map,
    target_features,
)
from eagleserve.train.recipe import add_recipe_args, run_recipe
from eagleserve.train.tf_cli import add_tf_args, resolve_data_source, run_teacher_forced
from eagleserve.train.trainer import (
    Data,
    MemorySource,
    TrainConfig,
    memory_batch,
    train_head,
    train_step,
)
from eagleserve.train.training_log import write_training_log
from eagleserve.train.vocab import DEFAULT_DRAFT_VOCAB


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train-draft",
        help="train an EAGLE/EAGLE3 head for a model",
        description="Three ways to train a head. --recipe gpu (one command, for any device): "
        "every ShareGPT turn, the target's features and top-k computed online "
        "on --device (an accelerator when there is one), then a time-budgeted run and a "
        "held-out score (TRAINING.md of the built-in head). --data-source teacher-forced: the "
        "same targets stored as shards on disk, trained in resumable chunks (the CPU path the "
        "shipped head came from). Default: the engine answers ShareGPT prompts with the target "
        "itself and the head learns its greedy tokens. All write the published EAGLE/EAGLE3 "
        "checkpoint format (plus trainer_state.pt for --resume).",
    )
    p.add_argument("--model", required=True, help="target: HF folder, .gguf, or 'default'")
    p.add_argument("--out", required=True, help="output folder (checkpoints, data cache, log)")
    p.add_argument("--algorithm", default="EAGLE3", choices=["EAGLE", "EAGLE3"])
    p.add_argument("--draft-vocab-size", type=int, default=None, help="EAGLE3 draft vocabulary "
                   "(default 8192; with --init-head the head's own, and a larger size widens "
                   "it)")  # fmt: skip
    p.add_argument("--draft-intermediate-size", type=int, default=None,
                   help="the head's MLP width (default: the target's)")  # fmt: skip
    p.add_argument("--draft-num-hidden-layers", type=int, default=1,
                   help="EAGLE3: decoder layers (the midlayer, then plain ones)")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=1500, help="ShareGPT prompts to answer")
    p.add_argument("--prompt-ids-file", help="JSON list of token-id prompts (no tokenizer)")
    p.add_argument("--data", nargs="*", default=(), help="reuse generated data files (merged)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="answer length")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--gen-batch-size", type=int, default=48)
    p.add_argument(
        "--epochs", type=float, default=2, help="passes over the data (may be fractional)"
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=None,
                   help="default 8 (--recipe gpu on an accelerator: 64)")  # fmt: skip
    p.add_argument("--max-len", type=int, default=384)
    p.add_argument("--ttt-steps", type=int, default=4, help="unrolled draft depths per batch")
    p.add_argument("--max-minutes", type=float, default=60.0, help="training time budget")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--val-fraction", type=float, default=0.03, help="sequences held out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="export")
    p.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (1 avoids OpenMP stalls on a CPU shared with other jobs)",
    )
    add_tf_args(p)
    add_recipe_args(p)
    p.set_defaults(func=run)
    return p


def _data(ns: argparse.Namespace, engine: object) -> tuple[list[list[int]], list[int], str]:
    path = os.path.join(ns.out, "data.pt")
    if os.path.exists(path):
        return load_sequences(path)
    if ns.data:
        parts = [load_sequences(p) for p in ns.data]
        seqs = [s for part in parts for s in part[0]]
        lens = [n for part in parts for n in part[1]]
        source = " + ".join(part[2] for part in parts)
    else:
        if ns.prompt_ids_file:
            with open(ns.prompt_ids_file) as f:
                prompts = json.load(f)
            source = f"token-id prompts from {ns.prompt_ids_file}"
        else:
            prompts = split_held_out(first_human_turns(sharegpt_path()), ns.num_prompts, ns.seed)
            source = f"ShareGPT_V3 first human turns, {len(prompts)} sampled (seed {ns.seed})"
        seqs, lens = build_dataset(
            engine, prompts, ns.max_new_tokens, ns.max_prompt_tokens, ns.gen_batch_size
        )
    save_sequences(seqs, lens, source, path)
    return seqs, lens, source


@torch.no_grad()
def evaluate(head: object, data: Data, idx: list[int], cfg: TrainConfig) -> dict[str, float]:
    """Per-depth top-1 accuracy on held-out sequences (mean over batches)."""
    sums: dict[str, float] = {}
    for i in range(0, len(idx), cfg.batch_size):
        _, m = train_step(head, memory_batch(data, idx[i : i + cfg.batch_size], cfg), cfg, 0)
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + float(v) / max(1, -(-len(idx) // cfg.batch_size))
    return sums


def run(ns: argparse.Namespace) -> int:
    if ns.recipe == "gpu":
        return run_recipe(ns)
    if ns.init_head:
        raise SystemExit("--init-head trains with --recipe gpu (on any --device)")
    ns.batch_size = ns.batch_size or 8
    ns.data_source = resolve_data_source(ns.data_source, ns.shards, ns.eval_head)
    if ns.data_source == "teacher-forced":
        return run_teacher_forced(ns)
    from eagleserve import Engine
    from eagleserve.spec.head_loader import save_eagle_head
    from eagleserve.train.target import fresh_head

    if ns.threads:
        torch.set_num_threads(ns.threads)
    torch.manual_seed(ns.seed)
    os.makedirs(ns.out, exist_ok=True)
    t_start = time.time()
    engine = Engine(
        model=ns.model,
        device="cpu",
        disable_overlap_schedule=True,
        max_running_requests=ns.gen_batch_size,
        max_total_tokens=ns.gen_batch_size * (ns.max_prompt_tokens + ns.max_new_tokens + 8),
    )
    seqs, prompt_lens, source = _data(ns, engine)
    t_data = time.time()
    target = engine.scheduler.worker.runner.model
    for p in target.parameters():
        p.requires_grad_(False)
    order = list(range(len(seqs)))
    random.Random(ns.seed).shuffle(order)
    n_val = int(len(seqs) * ns.val_fraction)
    val_idx, train_idx = order[:n_val], sorted(order[n_val:])
    vocab = target.config.vocab_size
    draft_ids = None
    if ns.algorithm == "EAGLE3":
        tr_seqs = [seqs[i] for i in train_idx]
        tr_lens = [prompt_lens[i] for i in train_idx]
        size = min(ns.draft_vocab_size or DEFAULT_DRAFT_VOCAB, vocab)
        draft_ids = draft_vocab(tr_seqs, tr_lens, size, vocab)
    head = fresh_head(ns, ns.algorithm, target, draft_ids)
    state = None
    ckpt = os.path.join(ns.out, "trainer_state.pt")
    if ns.resume and os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=False)
        head.load_state_dict(state["head"])  # fp32 weights, d2t included
    layers = feature_layers(ns.algorithm, head.aux_layer_ids, target.config.num_hidden_layers)
    feats = target_features(target, seqs, layers, ns.max_len)
    t_feat = time.time()
    data = Data(seqs, prompt_lens, feats, label_map(draft_ids, vocab))
    train = Data(
        [seqs[i] for i in train_idx],
        [prompt_lens[i] for i in train_idx],
        [feats[i] for i in train_idx],
        data.label_map,
    )
    cfg = TrainConfig(
        out_dir=ns.out,
        lr=ns.lr,
        batch_size=ns.batch_size,
        max_len=ns.max_len,
        epochs=ns.epochs,
        max_minutes=ns.max_minutes,
        depths=ns.ttt_steps,
        compute_dtype=ns.compute_dtype,
        save_every=ns.save_every,
        seed=ns.seed,
        max_steps=ns.max_steps,
    )
    head.train()
    metrics = train_head(head, MemorySource(train, cfg), cfg, state)
    head.eval()
    t_train = time.time()
    val = evaluate(head, data, val_idx, cfg) if val_idx else {}
    if ns.dtype == "bfloat16":
        head = head.to(torch.bfloat16)
    save_eagle_head(head, ns.out)
    log = {
        "model": ns.model,
        "algorithm": ns.algorithm,
        "source": source,
        "sequences": len(seqs),
        "tokens": sum(len(s) for s in seqs),
        "answer_tokens": sum(len(s) - p for s, p in zip(seqs, prompt_lens)),
        "train_sequences": len(train_idx),
        "val_sequences": len(val_idx),
        "draft_vocab_size": head.draft_vocab_size,
        "draft_vocab_answer_coverage": (
            answer_coverage(seqs, prompt_lens, draft_ids) if draft_ids is not None else 1.0
        ),
        "minutes": {
            "data": (t_data - t_start) / 60,
            "features": (t_feat - t_data) / 60,
            "train": (t_train - t_feat) / 60,
            "total": (time.time() - t_start) / 60,
        },
        "train_metrics_ema": metrics,
        "val_accuracy_by_depth": val,
    }
    write_training_log(ns, log, ("sequences", "tokens", "val_accuracy_by_depth"))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagleserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    raise SystemExit(main())

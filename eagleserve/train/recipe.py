"""`train-draft --recipe gpu`: one command, one wall-time budget, everything on the device.

Stages: (1) data: every ShareGPT conversation, all assistant turns (MT-bench / HumanEval leaks
and the held-out split kept out), tokenized on all CPU cores; (2) features: the target's EAGLE3
features and top-k distribution of every window, computed in large batches into device memory
(train/online.py); (3) training: bf16 autocast over fp32 master weights, the cosine schedule
sized to end when the budget does; (4) the head saved in shards of at most --max-shard-mb, loaded
back and evaluated teacher-forced on the held-out conversations (accuracy by depth). Tokens/s of
each stage go to OUT/training_log.json beside the head.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import time

import torch

from eagleserve.device import empty_cache, pick_device, synchronize
from eagleserve.models.llama import LlamaForCausalLM
from eagleserve.spec.eagle_head import EagleHead
from eagleserve.train.conversations import sharegpt_split, tokenize_unless_leak
from eagleserve.train.extract import Item
from eagleserve.train.online import (
    StoreSource,
    build_store,
    cut_windows,
    store_bytes_per_token,
)
from eagleserve.train.self_distill import add_self_distill_args
from eagleserve.train.training_log import write_training_log
from eagleserve.train.ttt import TTT_ATTENTION
from eagleserve.train.vocab import (
    DEFAULT_DRAFT_VOCAB,
    answer_counts,
    vocab_from_counts,
    widen_head,
    widened_ids,
)

_WORKER: tuple | None = None  # (tokenizer, probe keys, max tokens), inherited by forked workers


def add_recipe_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("one-command recipe (--recipe gpu)")
    g.add_argument("--recipe", default=None, choices=["gpu"], help="gpu: online features in "
                   "device memory, bf16 training, sharded save and eval in one wall-time budget "
                   "(runs on any --device)")  # fmt: skip
    g.add_argument("--device", default="auto", help="auto (the accelerator when there is one), "
                   "cuda, hip or cpu")  # fmt: skip
    g.add_argument("--time-budget", type=float, default=330.0, help="seconds for the whole "
                   "command; training stops in time to save and evaluate")  # fmt: skip
    g.add_argument("--eval-reserve", type=float, default=20.0, help="seconds kept for the save "
                   "and the evaluation after training")  # fmt: skip
    g.add_argument("--store-gb", type=float, default=None, help="device memory for features "
                   "(default: half the free memory; 4 on CPU)")  # fmt: skip
    g.add_argument("--extract-batch-tokens", type=int, default=None,
                   help="padded rows per target forward (default: 65536 on an accelerator, "
                   "4096 on a CPU, where a forward of that size takes seconds)")  # fmt: skip
    g.add_argument("--extract-seconds", type=float, default=None, help="stop extracting "
                   "after this long (default: a third of --time-budget)")  # fmt: skip
    g.add_argument("--max-shard-mb", type=float, default=16.0, help="largest head file")
    g.add_argument("--ttt-attention", default="merge", choices=list(TTT_ATTENTION),
                   help="depth >= 1 attention: merge (a causal SDPA over the context merged "
                   "with the chain's own keys: the least work), sdpa (one masked SDPA over "
                   "every depth's keys) or dense (the [T, T] scores); all compute the same "
                   "values")  # fmt: skip
    g.add_argument("--enable-torch-compile", action="store_true",
                   help="torch.compile each depth's forward and loss (fuses their pointwise "
                   "ops; the first step pays for the compile)")  # fmt: skip
    g.add_argument("--max-conversations", type=int, default=None,
                   help="use only this many training conversations (default: all)")  # fmt: skip
    g.add_argument("--tokenize-procs", type=int, default=None, help="default: all CPU cores")
    g.add_argument("--work-dir", default=None, help="write the fp32 head and trainer_state.pt "
                   "here at the end (default: none; OUT holds the head and its log)")  # fmt: skip
    g.add_argument("--init-head", default=None, help="train on from this head's weights "
                   "(a folder or builtin:NAME) instead of a fresh head; its width is kept, "
                   "its draft vocabulary too unless --draft-vocab-size widens it")  # fmt: skip
    g.add_argument("--extra-conversations", nargs="*", default=[], choices=["chitchat"],
                   help="more training conversations from a PyPI wheel: chitchat (BYU "
                   "Chit-Chat Challenge, 4 k human-human chats, MIT)")  # fmt: skip
    add_self_distill_args(p)


def device_defaults(ns: argparse.Namespace, dev: torch.device) -> None:
    """Fills what was left unset: --batch-size, 64 on an accelerator (bench/train_step.py
    measured the most token-passes a second there), 8 on a CPU; --extract-batch-tokens, 65536
    on an accelerator, 4096 on a CPU: the extraction's time limit is checked between forwards,
    and a CPU takes minutes over 65536 rows (a 40 s limit ran 140 s)."""
    accelerator = dev.type != "cpu"
    ns.batch_size = ns.batch_size or (64 if accelerator else 8)
    ns.extract_batch_tokens = ns.extract_batch_tokens or (65536 if accelerator else 4096)


def _tokenize(conv: list[dict[str, str]]) -> Item | None:
    tok, keys, max_tokens = _WORKER  # type: ignore[misc]
    return tokenize_unless_leak(tok, conv, keys, max_tokens)


def tokenize_all(
    tok: object, convs: list, keys: list[str], max_tokens: int, procs: int
) -> list[Item]:
    """Tokenized conversations (benchmark leaks and unusable ones dropped), in order; `procs`
    forked workers (they never touch the device)."""
    global _WORKER
    _WORKER = (tok, keys, max_tokens)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if procs <= 1:
        out = [_tokenize(c) for c in convs]
    else:
        with multiprocessing.get_context("fork").Pool(procs) as pool:
            out = pool.map(_tokenize, convs, chunksize=max(1, len(convs) // (procs * 8)))
    return [it for it in out if it is not None]


def store_capacity(dev: torch.device, store_gb: float | None, width: int, k: int) -> int:
    """Rows the feature store may hold: --store-gb, else half the device's free memory."""
    if store_gb is None:
        if dev.type == "cpu":
            store_gb = 4.0
        else:
            store_gb = torch.get_device_module(dev).mem_get_info(dev)[0] / 2**30 / 2
    return int(store_gb * 2**30 / store_bytes_per_token(width, k))


def _device(name: str) -> torch.device:
    # ROCm builds of torch name HIP devices "cuda".
    return pick_device("cuda" if name == "hip" else name)


def distill(
    ns: argparse.Namespace, dev: torch.device, tok: object, convs: list, keys: list[str]
) -> tuple[list[Item], dict]:
    """Self-distilled items of the held-in `convs` (train/self_distill.py), generated on `dev`
    by an engine in the form the features are extracted from; ([], {}) when off."""
    from eagleserve import Engine
    from eagleserve.models.loader import cache_dir, resolve_model_path
    from eagleserve.train.self_distill import (
        cache_key,
        distill_prompts,
        model_identity,
        self_distill_config,
        self_distill_items,
    )

    cfg = self_distill_config(ns)
    if cfg.mode == "off":
        return [], {}
    dtype = "bfloat16" if dev.type != "cpu" else "float32"
    prompts = distill_prompts(tok, convs, keys, cfg)
    kv = cfg.batch_size * (cfg.max_prompt_tokens + cfg.max_new_tokens + 8)

    def make_engine() -> object:  # graphs cover the whole batch by default (up to 256 rows)
        return Engine(model=ns.model, device=dev.type, dtype=dtype, max_total_tokens=kv,
                      max_running_requests=cfg.batch_size)  # fmt: skip

    key = cache_key(model_identity(resolve_model_path(ns.model)), f"{dev.type}/{dtype}", cfg,
                    prompts)  # fmt: skip
    root = cfg.cache_dir or os.path.join(cache_dir(), "self_distill")
    items, stats = self_distill_items(make_engine, prompts, cfg, key, root, ns.max_seq_len)
    empty_cache(dev)  # the engine's KV pool, before features
    print("self_distill", json.dumps(stats), flush=True)
    return items, stats


def warm_head(
    ns: argparse.Namespace, target: LlamaForCausalLM, dev: torch.device, items: list[Item]
) -> EagleHead:
    """--init-head: the saved head to train on, as fp32 master weights on `dev`; widened to
    --draft-vocab-size by the most frequent answer tokens of `items` it lacks, where that is
    larger than its own vocabulary (train/vocab.py)."""
    from eagleserve.spec.head_loader import load_eagle_head
    from eagleserve.train.assets import resolve_head_path

    head = load_eagle_head(resolve_head_path(ns.init_head), "EAGLE3", target, dev, torch.float32)
    own, vocab = head.draft_vocab_size, target.config.vocab_size
    size = own if ns.draft_vocab_size is None else min(ns.draft_vocab_size, vocab)
    if size < own:
        raise SystemExit(f"--draft-vocab-size {size}: --init-head {ns.init_head} drafts "
                         f"{own} tokens: a vocabulary is widened, never narrowed")  # fmt: skip
    if size > own:
        old = head.to_target_ids(torch.arange(own, device=dev)).cpu()
        ids = widened_ids(answer_counts(items), old, size, vocab)
        widen_head(head, target.lm_head_weight, ids)
        print(f"draft vocabulary widened: {own} -> {size} tokens", flush=True)
    width = ns.draft_intermediate_size
    if width is not None and width != head.config.intermediate_size:
        raise SystemExit(f"--draft-intermediate-size {width}: --init-head {ns.init_head} is "
                         f"{head.config.intermediate_size} wide")  # fmt: skip
    layers = ns.draft_num_hidden_layers
    if layers != head.config.num_hidden_layers:
        raise SystemExit(f"--draft-num-hidden-layers {layers}: --init-head {ns.init_head} has "
                         f"{head.config.num_hidden_layers}")  # fmt: skip
    return head


def run_recipe(ns: argparse.Namespace) -> int:
    from eagleserve.models.loader import load_tokenizer, resolve_model_path
    from eagleserve.spec.head_loader import load_eagle_head, save_eagle_head
    from eagleserve.train.data import sharegpt_path
    from eagleserve.train.features import label_map
    from eagleserve.train.target import fresh_head, load_target, target_layer_ids
    from eagleserve.train.tf_train import evaluate_shards
    from eagleserve.train.trainer import TrainConfig, train_head

    t0 = time.time()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    torch.manual_seed(ns.seed)
    dev = _device(ns.device)
    device_defaults(ns, dev)
    os.makedirs(ns.out, exist_ok=True)
    # Tokenizing forks workers: done before the device is touched.
    tok = load_tokenizer(resolve_model_path(ns.model))
    t_load = time.time()

    convs, train_i, val_i, keys = sharegpt_split(sharegpt_path(), ns.seed, ns.val_fraction)
    procs = ns.tokenize_procs or os.cpu_count() or 1
    val_items = tokenize_all(tok, [convs[i] for i in val_i], keys, ns.max_seq_len, procs)
    train_i = train_i[: ns.max_conversations]
    train_convs = [convs[i] for i in train_i]
    if "chitchat" in ns.extra_conversations:
        from eagleserve.train.chitchat import chitchat_conversations, chitchat_path

        train_convs += chitchat_conversations(chitchat_path())[: ns.max_conversations]
    train_items = tokenize_all(tok, train_convs, keys, ns.max_seq_len, procs)
    t_data = time.time()
    n_data_tokens = sum(len(ids) for ids, _ in train_items)  # tokenized human conversations
    sd_items, sd_stats = distill(ns, dev, tok, train_convs, keys)
    if ns.self_distill == "replace":
        train_items = sd_items
    elif ns.self_distill == "add":
        # Both sources' windows go through the one seeded shuffle below: a cap keeps some of each.
        train_items = train_items + sd_items
    t_distill = time.time()
    # Extraction runs the target as bf16 dense weights (de-quantized GGUF) on an accelerator.
    target, _ = load_target(ns.model, "bfloat16" if dev.type != "cpu" else "float32",
                            ns.max_len + 16, dev.type)  # fmt: skip
    t_target = time.time()

    vocab = target.config.vocab_size
    head = warm_head(ns, target, dev, train_items) if ns.init_head else None
    if head is not None:  # the labels follow the head's own draft vocabulary
        draft_ids = head.to_target_ids(torch.arange(head.draft_vocab_size, device=dev)).cpu()
    else:
        size = min(ns.draft_vocab_size or DEFAULT_DRAFT_VOCAB, vocab)
        draft_ids = vocab_from_counts(answer_counts(train_items), size, vocab)
    lmap = label_map(draft_ids, vocab)
    layers = target_layer_ids("EAGLE3", target.config.num_hidden_layers)
    width = len(layers) * target.config.hidden_size
    cap = store_capacity(dev, ns.store_gb, width, ns.top_k)
    extract_s = ns.extract_seconds if ns.extract_seconds is not None else ns.time_budget / 3
    wins = cut_windows(train_items, ns.max_len)
    random.Random(ns.seed).shuffle(wins)  # a token cap keeps a random subset
    vwins = cut_windows(val_items, ns.max_len)
    vstore, _ = build_store(target, vwins, layers, ns.top_k, ns.val_tokens,
                            ns.extract_batch_tokens, "Held-out features")  # fmt: skip
    store, fstats = build_store(target, wins, layers, ns.top_k,
                                min(cap, ns.max_tokens or cap), ns.extract_batch_tokens,
                                max_seconds=extract_s)  # fmt: skip
    t_feat = time.time()
    print("features", json.dumps(fstats), flush=True)

    # The head trains in fp32 (master weights) next to an fp32 target: it reads the target's
    # embeddings; the matmuls run in bf16 under autocast.
    target.float()
    if head is None:
        head = fresh_head(ns, "EAGLE3", target, draft_ids)
    budget = max(1.0, ns.time_budget - (time.time() - t0) - ns.eval_reserve)
    cfg = TrainConfig(
        out_dir=ns.work_dir, lr=ns.lr, batch_size=ns.batch_size, max_len=ns.max_len,
        epochs=ns.epochs, max_minutes=ns.max_minutes, depths=ns.ttt_steps,
        compute_dtype=ns.compute_dtype, save_every=10**9, seed=ns.seed,
        max_steps=ns.max_steps, soft_labels=ns.loss == "soft", budget_s=budget,
        ttt_attention=ns.ttt_attention, enable_torch_compile=ns.enable_torch_compile,
    )  # fmt: skip
    source = StoreSource(store, lmap, ns.batch_size, ns.ttt_steps, ns.seed)
    head.train()
    metrics = train_head(head, source, cfg)
    head.eval()
    synchronize(dev)
    t_train = time.time()

    export = torch.bfloat16 if ns.dtype == "bfloat16" else torch.float32
    save_eagle_head(head.to(export), ns.out, int(ns.max_shard_mb * 2**20))
    # The accuracy reported is the saved (sharded) head's, loaded back as serving does.
    saved = load_eagle_head(ns.out, "EAGLE3", target, dev, torch.float32)
    val = evaluate_shards(saved, StoreSource(vstore, lmap, ns.batch_size, ns.ttt_steps, ns.seed),
                          cfg)  # fmt: skip
    # As many trained-on rows, scored the same way: held-out accuracy well below it means the
    # head memorizes; close to it, that it is short of data or capacity.
    seen = StoreSource(store.sample(vstore.tokens, ns.seed), lmap, ns.batch_size, ns.ttt_steps,
                       ns.seed)  # fmt: skip
    train_acc = evaluate_shards(saved, seen, cfg)
    baseline = None
    if ns.eval_head:
        from eagleserve.train.assets import resolve_head_path

        other = load_eagle_head(resolve_head_path(ns.eval_head), "EAGLE3", target, dev,
                                torch.float32)  # fmt: skip
        other_ids = other.to_target_ids(torch.arange(other.draft_vocab_size, device=dev))
        vsrc = StoreSource(vstore, label_map(other_ids.cpu(), vocab), ns.batch_size,
                           ns.ttt_steps, ns.seed)  # fmt: skip
        baseline = {"head": ns.eval_head, **evaluate_shards(other, vsrc, cfg)}
    synchronize(dev)
    t_end = time.time()

    steps = metrics["steps"]
    token_passes = metrics["token_passes"]  # real rows trained, each over all depths
    log = {
        "model": ns.model,
        "algorithm": "EAGLE3",
        "recipe": "gpu",
        "device": str(dev),
        "source": f"ShareGPT_V3 all turns, windows of {ns.max_len} ({len(train_items)} train / "
        f"{len(val_items)} held-out conversations, seed {ns.seed}), self-distill "
        f"{ns.self_distill}, extra {ns.extra_conversations}, features online",
        "self_distill": sd_stats,
        "data_tokens": n_data_tokens,
        "tokens": store.tokens,
        "answer_tokens": int(store.nxt_answer.sum()),
        "val_tokens": vstore.tokens,
        "draft_vocab_size": head.draft_vocab_size,
        "loss": ns.loss,
        "steps": steps,
        "token_passes": token_passes,
        "epochs": token_passes / max(1, store.tokens),
        "seconds": {
            "tokenizer": t_load - t0,
            "data": t_data - t_load,
            "self_distill": t_distill - t_data,
            "target": t_target - t_distill,
            "features": t_feat - t_target,
            "train": t_train - t_feat,
            "save_eval": t_end - t_train,
            "total": t_end - t0,
        },  # fmt: skip
        "tok_per_s": {
            "data": n_data_tokens / max(1e-9, t_data - t_load),
            "self_distill": sd_stats.get("tok_per_s", 0.0),
            "features": fstats["tok_per_s"],
            "train_token_passes": token_passes / max(1e-9, t_train - t_feat),
            "train_token_depths": metrics["token_depths_per_s"],
        },
        "train_metrics_ema": metrics,
        "val_accuracy_by_depth": val,
        "train_sample_accuracy_by_depth": train_acc,
        "baseline_val_accuracy_by_depth": baseline,
    }
    shown = ("tokens", "token_passes", "seconds", "tok_per_s", "val_accuracy_by_depth",
             "train_sample_accuracy_by_depth")  # fmt: skip
    write_training_log(ns, log, shown)
    # Stopped short by device memory: the head trained so far is saved and scored above.
    return 1 if "out_of_memory_at_step" in metrics else 0

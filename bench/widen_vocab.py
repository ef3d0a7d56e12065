"""Does a trained head's body already know the tokens its draft vocabulary leaves out?

    python bench/widen_vocab.py [--head builtin:smollm2-135m-eagle] [--size 16384]
        [--train-tokens 150000] [--train-seconds 600] [--out-head DIR] [--out widen_vocab.json]

`train-draft --init-head H --draft-vocab-size N` widens a head's vocabulary before training on
(train/vocab.py): a new token's lm_head row starts as the target's row through the linear map
that takes the target's rows of the old tokens to the head's trained ones. This measures, on
held-out ShareGPT windows (the recipe's seed-0 split, never trained on), teacher-forced accuracy
by depth over every answer row (a target argmax outside the vocabulary is a miss): the head as
trained, widened, and widened with only the new rows then trained (`--train-seconds` on
`--train-tokens` of held-in windows, every other weight and old row frozen: what the body's
hidden states already say about the new tokens). The features come from the dense bf16 target
on this machine, as the recipe extracts them. Writes the last head to `--out-head` (served
acceptance: `bench/accept_gap.py --head DIR`) and bench/results/`--out`.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from bench.common import machine, print_table, write_json  # noqa: E402
from eagleserve.spec.head_loader import load_eagle_head, save_eagle_head  # noqa: E402
from eagleserve.train.chitchat import chitchat_conversations, chitchat_path  # noqa: E402
from eagleserve.train.conversations import sharegpt_split  # noqa: E402
from eagleserve.train.data import sharegpt_path  # noqa: E402
from eagleserve.train.features import label_map  # noqa: E402
from eagleserve.train.online import StoreSource, build_store, cut_windows  # noqa: E402
from eagleserve.train.recipe import tokenize_all  # noqa: E402
from eagleserve.train.target import load_target, target_layer_ids  # noqa: E402
from eagleserve.train.tf_train import evaluate_shards  # noqa: E402
from eagleserve.train.trainer import TrainConfig, train_head  # noqa: E402
from eagleserve.train.vocab import answer_counts, widen_head, widened_ids  # noqa: E402

DEPTHS = 3  # the depths run 4 trained, and a chain of 3 drafts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--head", default="builtin:smollm2-135m-eagle")
    ap.add_argument("--size", type=int, default=16384, help="the widened draft vocabulary")
    ap.add_argument("--max-len", type=int, default=512, help="window length")
    ap.add_argument("--train-tokens", type=int, default=150_000)
    ap.add_argument("--val-tokens", type=int, default=30_000)
    ap.add_argument("--train-seconds", type=float, default=600.0)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out-head", default="/tmp/widened_head")
    ap.add_argument("--out", default="widen_vocab.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    target, tok = load_target("default", "bfloat16", args.max_len + 16)
    vocab = target.config.vocab_size
    convs, train_i, val_i, keys = sharegpt_split(sharegpt_path(), seed=0, val_fraction=0.03)
    held_in = [convs[i] for i in train_i] + chitchat_conversations(chitchat_path())
    items = tokenize_all(tok, held_in, keys, 4096, os.cpu_count() or 1)
    counts = answer_counts(items)  # the recipe's vocabulary ranking (run 4's 8,192 among them)
    val_items = tokenize_all(tok, [convs[i] for i in val_i], keys, 4096, os.cpu_count() or 1)
    layers = target_layer_ids("EAGLE3", target.config.num_hidden_layers)
    wins = cut_windows(items, args.max_len)
    random.Random(0).shuffle(wins)
    t0 = time.time()
    vstore, _ = build_store(target, cut_windows(val_items, args.max_len), layers, 32,
                            args.val_tokens, 4096, "Held-out features")  # fmt: skip
    store, stats = build_store(target, wins, layers, 32, args.train_tokens, 4096)
    extract_s = time.time() - t0
    target.float()  # the head reads the target's embeddings in fp32, as in training

    cfg = TrainConfig(out_dir=None, lr=args.lr, batch_size=args.batch_size, max_len=args.max_len,
                      epochs=50, depths=DEPTHS, soft_labels=True, budget_s=args.train_seconds,
                      compute_dtype="float32", save_every=10**9)  # fmt: skip
    cpu = torch.device("cpu")
    head = load_eagle_head(args.head, "EAGLE3", target, cpu, torch.float32).eval()

    def score(name: str, source_store: object) -> dict:
        ids = head.to_target_ids(torch.arange(head.draft_vocab_size))
        src = StoreSource(source_store, label_map(ids, vocab), args.batch_size, DEPTHS, 0)
        return {"head": name, "draft_vocab": head.draft_vocab_size,
                **evaluate_shards(head, src, cfg)}  # fmt: skip

    rows = [score("as trained", vstore)]
    old = head.to_target_ids(torch.arange(head.draft_vocab_size))
    widen_head(head, target.lm_head_weight, widened_ids(counts, old, args.size, vocab))
    rows.append(score("widened (fitted rows)", vstore))

    # Only the new rows train: the body and the old rows stay as they were.
    for p in head.parameters():
        p.requires_grad_(False)
    weight = head.lm_head.weight
    weight.requires_grad_(True)
    frozen = torch.isin(head.to_target_ids(torch.arange(head.draft_vocab_size)), old)
    weight.register_hook(lambda g: g.masked_fill(frozen[:, None], 0.0))
    new_ids = head.to_target_ids(torch.arange(head.draft_vocab_size))
    head.train()
    metrics = train_head(head, StoreSource(store, label_map(new_ids, vocab), args.batch_size,
                                           DEPTHS, 0), cfg)  # fmt: skip
    head.eval()
    rows.append(score("widened, new rows trained", vstore))
    seen = store.sample(vstore.tokens, 0)
    rows.append(score("widened, new rows trained (trained-on sample)", seen))
    save_eagle_head(head.to(torch.bfloat16), args.out_head)

    table = [[r["head"], r["draft_vocab"], *(f"{r[f'acc{d}_all']:.3f}" for d in range(DEPTHS)),
              *(f"{r[f'acc{d}']:.3f}" for d in range(DEPTHS)),
              f"{100 * r['argmax_outside_draft_vocab']:.1f}%"] for r in rows]  # fmt: skip
    mach = machine()
    print(f"machine: {mach}; head {args.head}; held-out {vstore.tokens} tokens, trained on "
          f"{store.tokens} ({metrics['steps']} steps, {metrics['token_passes']:.0f} "
          f"token-passes)")  # fmt: skip
    heads = ["head", "vocab", *(f"all d{d}" for d in range(DEPTHS)),
             *(f"in-vocab d{d}" for d in range(DEPTHS)), "outside"]  # fmt: skip
    print_table(heads, table)
    features = {**stats, "seconds": extract_s}
    out = {
        "machine": mach,
        "args": vars(args),
        "rows": rows,
        "train": metrics,
        "features": features,
    }
    write_json(args.out, out)


if __name__ == "__main__":
    main()

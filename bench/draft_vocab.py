"""How much of what the target says a draft vocabulary of each size can draft.

    python bench/draft_vocab.py [--sizes 8192,16384,24576,32768] [--prompts-per-set 8]
        [--new-tokens 96] [--head HEAD] [--out draft_vocab.json]

An EAGLE-3 head proposes only tokens of its draft vocabulary, so a position whose target token
lies outside it is a rejected first draft whatever the head learnt. The vocabulary is what
`train-draft --recipe gpu` picks: the most frequent answer tokens of its training conversations
(every held-in ShareGPT conversation of the seed-0 split, and the chitchat wheel's as run 4 had
with `--extra-conversations chitchat`; benchmark leaks dropped). For each size, the share of
the target's greedy answer tokens (its argmax at each position: what a first draft must
propose) outside it, on MT-bench, HumanEval and math prompts (`--new-tokens`, EOS ignored), the
served default model; and the same for `--head`'s own vocabulary (a check that the recipe's
choice is reproduced). Writes bench/results/draft_vocab.json.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from bench import data  # noqa: E402
from bench.common import machine, print_table, write_json  # noqa: E402
from eagleserve import Engine, SamplingParams  # noqa: E402
from eagleserve.models.loader import iter_checkpoint  # noqa: E402
from eagleserve.train.assets import resolve_head_path  # noqa: E402
from eagleserve.train.chitchat import chitchat_conversations, chitchat_path  # noqa: E402
from eagleserve.train.conversations import sharegpt_split  # noqa: E402
from eagleserve.train.data import sharegpt_path  # noqa: E402
from eagleserve.train.recipe import tokenize_all  # noqa: E402
from eagleserve.train.vocab import answer_counts, vocab_from_counts  # noqa: E402


def head_vocab(path: str, vocab_size: int) -> set[int]:
    """The target ids of an EAGLE-3 head's draft vocabulary: draft id i is target id
    i + d2t[i] (a head without `d2t` drafts the whole vocabulary, as the loader reads it)."""
    for name, tensor in iter_checkpoint(resolve_head_path(path)):
        if name.removeprefix("model.") == "d2t":
            return set((torch.arange(tensor.numel()) + tensor).tolist())
    return set(range(vocab_size))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="8192,16384,24576,32768")
    ap.add_argument("--prompts-per-set", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--head", default="builtin:smollm2-135m-eagle")
    ap.add_argument("--max-seq-len", type=int, default=4096, help="as train-draft's")
    ap.add_argument("--out", default="draft_vocab.json")
    args = ap.parse_args()

    engine = Engine(model="default", device="cpu", max_total_tokens=16384)
    tok = engine.tokenizer
    vocab_size = engine.scheduler.model_config.vocab_size
    convs, train_i, _, keys = sharegpt_split(sharegpt_path(), seed=0, val_fraction=0.03)
    train = [convs[i] for i in train_i] + chitchat_conversations(chitchat_path())
    items = tokenize_all(tok, train, keys, args.max_seq_len, os.cpu_count() or 1)
    counts = answer_counts(items)
    vocabs = {
        str(size): set(vocab_from_counts(counts, min(size, vocab_size), vocab_size).tolist())
        for size in map(int, args.sizes.split(","))
    }
    vocabs["head"] = head_vocab(args.head, vocab_size)
    recipe_8k = vocabs.get("8192")
    same = None if recipe_8k is None else len(recipe_8k & vocabs["head"]) / len(vocabs["head"])

    greedy = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    rows, table = [], []
    for name in data.DEFAULT_SETS.split(","):
        prompts = data.SETS[name]
        ids = [data.chat_ids(tok, p) for p in prompts(args.prompts_per_set)]
        answers = [o["token_ids"] for o in engine.generate(ids, greedy)]
        tokens = [t for a in answers for t in a]
        outside = {
            v: sum(t not in ids_ for t in tokens) / len(tokens) for v, ids_ in vocabs.items()
        }
        rows.append({"set": name, "answer_tokens": len(tokens), "outside": outside})
        table.append([name, len(tokens), *(f"{outside[v]:.1%}" for v in vocabs)])
    print(f"{machine()}; {len(items)} training conversations; the head's vocabulary shares "
          f"{same:.1%} of the recipe's 8,192" if same is not None else machine())  # fmt: skip
    print_table(["set", "tokens", *(f"outside {v}" for v in vocabs)], table)
    print(write_json(args.out, {"machine": machine(), "head": args.head,
                                "training_conversations": len(items),
                                "head_shares_recipe_8192": same, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()

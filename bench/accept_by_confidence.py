"""Where a head's first draft misses: depth-0 accuracy by how sure the target is of its token.

For each prompt set (bench/data.py's; never trained on) the served target (packed GGUF) answers
greedily (`--new-tokens`, EOS ignored); the target then runs teacher-forced over prompt + answer
(train-draft's extraction, fp32) and the head drafts depth 0 at every answer position (the
measure of `bench/accept_gap.py`'s teacher-forced column, which there matched served first-draft
acceptance). Each position is binned by the target's own probability of its greedy token (its
top-1 probability): where that is low the next token is unsettled, and a head that matches the
target's ranking only roughly misses there first. Per set and bin: the share of positions, the
head's hit rate (a target token outside the draft vocabulary is a miss, as in serving) and the
share of the bin's tokens outside that vocabulary (misses no training of this head can turn).

The same positions binned by the head's own top-1 probability (softmax over its draft
vocabulary) give its calibration: how well its confidence, known before a verify, predicts
that the draft is accepted (what a draft that stops where its head is unsure would act on).

"mix-only" is the accuracy the set would have with every set's pooled hit rate per bin and its
own mix of bins: where it is close to the set's accuracy, the set is harder because its target
is less sure more often (more unsettled positions), not because the head drafts its sure
positions worse.

    python bench/accept_by_confidence.py [--head HEAD] [--sets MT-bench,HumanEval,...]
        [--prompts-per-set 16] [--new-tokens 96] [--out accept_by_confidence.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import data  # noqa: E402
from bench.accept_gap import extract_answers  # noqa: E402
from bench.common import machine, print_table, write_json  # noqa: E402
from bench.spec_cpu import run_engine  # noqa: E402
from eagleserve import Engine  # noqa: E402
from eagleserve.spec.head_loader import load_eagle_head  # noqa: E402
from eagleserve.train.assets import resolve_head_path  # noqa: E402
from eagleserve.train.features import IGNORE, label_map  # noqa: E402
from eagleserve.train.shard_data import ShardSource, shard_entries  # noqa: E402
from eagleserve.train.target import load_target, target_layer_ids  # noqa: E402
from eagleserve.train.ttt import head_step, lm_head_weight  # noqa: E402

# Upper edges of the target top-1 probability bins (the last bin ends at 1).
EDGES = (0.3, 0.5, 0.7, 0.9, 1.0)


def bin_of(p1: torch.Tensor) -> torch.Tensor:
    """The bin index of each top-1 probability: the first edge it lies below (1.0 in the last)."""
    return torch.bucketize(p1, torch.tensor(EDGES[:-1], dtype=p1.dtype), right=True)


def bin_counts(p1: torch.Tensor, flags: torch.Tensor) -> tuple[list[int], list[int]]:
    """(positions, positions flagged) per bin of the answer positions' top-1 probabilities."""
    b = bin_of(p1)
    n = torch.bincount(b, minlength=len(EDGES))
    h = torch.bincount(b, weights=flags.double(), minlength=len(EDGES))
    return [int(v) for v in n], [int(round(float(v))) for v in h]


def mix_only_accuracy(counts: list[int], pooled_rate: list[float]) -> float:
    """The accuracy of a set with its own bin shares and the pooled hit rate of each bin."""
    total = sum(counts)
    return sum(c * r for c, r in zip(counts, pooled_rate)) / max(1, total)


@torch.no_grad()
def depth0_hits(
    head: object, source: ShardSource
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the target's top-1 probability, hit, outside, the head's top-1 probability) of every
    answer position of `source`'s windows: the head's depth-0 argmax against the target's greedy
    token, and whether that token is outside the draft vocabulary (a miss)."""
    w = lm_head_weight(head)
    p1s, hits, outside, q1s = [], [], [], []
    for within in range(source.per_epoch):
        batch = source.batch(0, within)
        t = batch.f.shape[1] - source.depths - 1  # as train_step: depth 0 labels columns 1..t
        hid, _, _ = head_step(head, batch.x[:, 1 : 1 + t], batch.f[:, :t],
                              torch.arange(t).expand(batch.x.shape[0], t), [], "merge")  # fmt: skip
        q1, pred = torch.nn.functional.linear(hid, w).float().softmax(-1).max(-1)
        p = batch.soft_p[:, 1 : 1 + t, 0]
        answer = p > 0  # rows whose next token is an answer token
        lab = batch.y[:, 1 : 1 + t]
        p1s.append(p[answer])
        hits.append(((pred == lab) & (lab != IGNORE))[answer])
        outside.append((lab == IGNORE)[answer])
        q1s.append(q1[answer])
    return torch.cat(p1s), torch.cat(hits), torch.cat(outside), torch.cat(q1s)


def main() -> None:
    ap = argparse.ArgumentParser()
    data.add_head_set_args(ap, prompts_per_set=16,
                           sets="MT-bench,MT-bench-categories,HumanEval,math,ShareGPT")  # fmt: skip
    ap.add_argument("--out", default="accept_by_confidence.json", help="file in bench/results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sets = data.sets_of(args)
    base = Engine(model="default", device="cpu", max_total_tokens=4096, max_running_requests=2)
    sequences = {}
    for name, prompts in sets.items():
        ids = [data.chat_ids(base.tokenizer, p) for p in prompts]
        tokens = run_engine(base, ids, 1, args.new_tokens)["tokens"]
        sequences[name] = ([i + t for i, t in zip(ids, tokens)], [len(i) for i in ids])
    del base
    target, _ = load_target("default", "float32", 2048)
    layers = target_layer_ids("EAGLE3", target.config.num_hidden_layers)
    head = load_eagle_head(resolve_head_path(args.head), "EAGLE3", target, torch.device("cpu"),
                           torch.float32).eval()  # fmt: skip
    lmap = label_map(head.to_target_ids(torch.arange(head.draft_vocab_size)),
                     target.config.vocab_size)  # fmt: skip
    per_set: dict[str, tuple[list[int], list[int], list[int], float]] = {}
    by_head: dict[str, tuple[list[int], list[int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (seqs, lens) in sequences.items():
            shard_dir = os.path.join(tmp, name)
            extract_answers(target, layers, seqs, lens, shard_dir, name)
            source = ShardSource(shard_entries([shard_dir]), lmap, 8, 512, 1, 0)
            p1, hit, outside, q1 = depth0_hits(head, source)
            n, h = bin_counts(p1, hit)
            per_set[name] = (n, h, bin_counts(p1, outside)[1], float(p1.mean()))
            by_head[name] = bin_counts(q1, hit)
    pooled_n = [sum(v[0][b] for v in per_set.values()) for b in range(len(EDGES))]
    pooled_h = [sum(v[1][b] for v in per_set.values()) for b in range(len(EDGES))]
    pooled_rate = [h / max(1, n) for h, n in zip(pooled_h, pooled_n)]
    rows = []
    for name, (n, h, out, mean_p1) in per_set.items():
        total = max(1, sum(n))
        head_n, head_h = by_head[name]
        rows.append(dict(set=name, positions=sum(n), mean_top1_prob=mean_p1,
                         share_by_bin=[c / total for c in n],
                         hit_rate_by_bin=[hh / max(1, c) for hh, c in zip(h, n)],
                         outside_vocab_by_bin=[o / max(1, c) for o, c in zip(out, n)],
                         accuracy=sum(h) / total,
                         share_by_head_bin=[c / total for c in head_n],
                         hit_rate_by_head_bin=[x / max(1, c) for x, c in zip(head_h, head_n)],
                         mix_only_accuracy=mix_only_accuracy(n, pooled_rate)))  # fmt: skip
    bins = [f"<{e}" if e < 1 else ">=0.9" for e in EDGES]
    n, new = args.prompts_per_set, args.new_tokens
    print(f"machine: {machine()}; head {args.head}; depth 0, teacher-forced on the target's "
          f"greedy answers ({new} tokens, {n} prompts a set)")  # fmt: skip
    print("bins of the target's top-1 probability:", " ".join(bins))
    print_table(
        ["set", "positions", "mean p1", "share by bin", "hit rate by bin", "outside vocab",
         "acc", "mix-only"],
        [[r["set"], r["positions"], f"{r['mean_top1_prob']:.3f}",
          " ".join(f"{v:.2f}" for v in r["share_by_bin"]),
          " ".join(f"{v:.2f}" for v in r["hit_rate_by_bin"]),
          " ".join(f"{v:.2f}" for v in r["outside_vocab_by_bin"]), f"{r['accuracy']:.3f}",
          f"{r['mix_only_accuracy']:.3f}"] for r in rows],
    )  # fmt: skip
    print("pooled hit rate by bin:", " ".join(f"{v:.2f}" for v in pooled_rate))
    print("by the head's own top-1 probability, same bins:")
    print_table(
        ["set", "share by head bin", "hit rate by head bin"],
        [[r["set"], " ".join(f"{v:.2f}" for v in r["share_by_head_bin"]),
          " ".join(f"{v:.2f}" for v in r["hit_rate_by_head_bin"])] for r in rows],
    )  # fmt: skip
    write_json(args.out, {"args": vars(args), "machine": machine(), "bins": bins,
                          "pooled_hit_rate_by_bin": pooled_rate, "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()

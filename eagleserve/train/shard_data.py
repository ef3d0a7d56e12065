"""Training batches streamed from teacher-forced shards (train/shards.py).

A training item is a window of at most `max_len` rows of one stored sequence; the target's
features in it carry the whole conversation before it (they were computed over it), the head's
own attention sees the window. An epoch visits the shards in a seeded order and, inside each,
its windows in seeded batches, so only one shard is in memory and step -> batch is a pure
function of (seed, epoch, step): --resume reproduces an uninterrupted run.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from eagleserve.train.batches import Batch, padded_len
from eagleserve.train.features import IGNORE
from eagleserve.train.shards import Seq, load_shard, read_index

Window = tuple[int, int, int]  # sequence index in its shard, start row, length


def shard_entries(dirs: list[str]) -> list[tuple[str, dict]]:
    """(folder, index entry) of every shard in `dirs`, in order."""
    out = []
    for d in dirs:
        index = read_index(d)
        if index is None:
            raise FileNotFoundError(f"no {os.path.join(d, 'index.json')}")
        out += [(d, e) for e in index["shards"]]
    return out


def windows(seq_lens: list[int], max_len: int) -> list[Window]:
    """Consecutive windows of at most `max_len` rows covering every sequence."""
    return [
        (i, a, min(max_len, n - a)) for i, n in enumerate(seq_lens) for a in range(0, n, max_len)
    ]


def answer_token_counts(entries: list[tuple[str, dict]]) -> Counter:
    """Answer-token frequencies over the shards (reads only their `ids`/`answer` tensors)."""
    c: Counter = Counter()
    for d, e in entries:
        with safe_open(os.path.join(d, e["file"]), framework="pt") as f:
            ids, ans = f.get_tensor("ids"), f.get_tensor("answer").bool()
        c.update(ids[ans].tolist())
    return c


def window_batch(
    seqs: list[Seq], wins: list[Window], label_map: torch.Tensor, depths: int, max_len: int
) -> Batch:
    """Row t of a window starting at a: token ids[a+t], features feats[a+t], label = the target's
    top-k at a+t (its argmax as the hard label) where ids[a+t+1] is an answer token and that
    argmax lies in the draft vocabulary (else IGNORE). Its length is `padded_len`'s, up to
    `max_len` (the longest window there can be)."""
    n = padded_len(max(w[2] for w in wins), max_len)
    bsz, w_feat, k = len(wins), seqs[0].feats.shape[-1], seqs[0].top_ids.shape[-1]
    x = torch.zeros(bsz, n + depths, dtype=torch.long)
    f = torch.zeros(bsz, n + depths, w_feat)
    y = torch.full((bsz, n + depths), IGNORE, dtype=torch.long)
    fmask = torch.zeros(bsz, n + depths, dtype=torch.bool)
    sid = torch.full((bsz, n + depths, k), -1, dtype=torch.long)
    sp = torch.zeros(bsz, n + depths, k)
    for b, (i, a, m) in enumerate(wins):
        s = seqs[i]
        x[b, :m] = s.ids[a : a + m].long()
        f[b, :m] = s.feats[a : a + m].float()
        fmask[b, :m] = True
        nxt = s.answer[a + 1 : a + m + 1]  # shorter than m at the sequence's end
        nxt_answer = torch.zeros(m, dtype=torch.bool)
        nxt_answer[: len(nxt)] = nxt
        tid = s.top_ids[a : a + m].long()
        mapped = torch.where(tid >= 0, label_map[tid.clamp(min=0)], IGNORE)
        ok = nxt_answer & (mapped[:, 0] != IGNORE)
        y[b, :m] = torch.where(ok, mapped[:, 0], IGNORE)
        sid[b, :m] = torch.where(mapped != IGNORE, mapped, -1)
        sp[b, :m] = s.top_p[a : a + m].float()
    return Batch(x, f, y, fmask, sid, sp)


@dataclass
class ShardSource:
    """BatchSource over shards; holds one shard's sequences in memory at a time."""

    entries: list[tuple[str, dict]]
    label_map: torch.Tensor
    batch_size: int
    max_len: int
    depths: int
    seed: int
    _plans: dict[int, list[tuple[int, list[Window]]]] = field(default_factory=dict)
    _loaded: tuple[int, list[Seq]] | None = None

    def __post_init__(self) -> None:
        self.per_epoch = len(self.plan(0))

    def plan(self, epoch: int) -> list[tuple[int, list[Window]]]:
        """(shard number, windows) per batch of `epoch`: shards in a seeded order, windows of
        a shard shuffled then length-sorted in chunks of 16 batches (less padding)."""
        if epoch not in self._plans:
            rng = random.Random(self.seed * 1000 + epoch)
            order = list(range(len(self.entries)))
            rng.shuffle(order)
            out = []
            for sh in order:
                wins = windows(self.entries[sh][1]["seq_lens"], self.max_len)
                rng.shuffle(wins)
                chunk = self.batch_size * 16
                batches = []
                for c in range(0, len(wins), chunk):
                    part = sorted(wins[c : c + chunk], key=lambda w: w[2])
                    batches += [
                        part[i : i + self.batch_size] for i in range(0, len(part), self.batch_size)
                    ]
                rng.shuffle(batches)
                out += [(sh, b) for b in batches]
            self._plans = {epoch: out}  # keep one epoch's plan
        return self._plans[epoch]

    def batch(self, epoch: int, within: int) -> Batch:
        sh, wins = self.plan(epoch)[within]
        if self._loaded is None or self._loaded[0] != sh:
            self._loaded = (sh, load_shard(*self.entries[sh]))
        return window_batch(self._loaded[1], wins, self.label_map, self.depths, self.max_len)

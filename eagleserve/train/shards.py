"""Teacher-forced training data on disk, in safetensors shards of about `shard_tokens` tokens.

A shard holds whole sequences, concatenated: `ids` int32 [N], `answer` uint8 [N] (1 on assistant
tokens), `offsets` int64 [S+1] (sequence s is rows offsets[s]:offsets[s+1]), `feats` bf16 [N, W],
`top_ids` int32 [N, k] (target vocabulary), `top_p` fp16 [N, k]. `index.json` lists the shards
and the source cursor; it is rewritten atomically after each shard, so an interrupted extraction
leaves a usable data set and resumes from the cursor (the unflushed tail is redone).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file, save_file

INDEX = "index.json"


@dataclass
class Seq:
    ids: torch.Tensor  # int32 [T]
    answer: torch.Tensor  # bool [T]
    feats: torch.Tensor  # bf16 [T, W]
    top_ids: torch.Tensor  # int32 [T, k]
    top_p: torch.Tensor  # fp16 [T, k]


@dataclass
class ShardWriter:
    out_dir: str
    shard_tokens: int
    meta: dict
    pending: list[Seq] = field(default_factory=list)

    def __post_init__(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        self.index = read_index(self.out_dir) or {**self.meta, "shards": [], "cursor": 0}

    @property
    def cursor(self) -> int:
        """Source items already stored in flushed shards (where a resumed run starts)."""
        return int(self.index["cursor"])

    def add(self, seq: Seq, cursor: int) -> None:
        """Queues one sequence; `cursor` = source items consumed once it is stored."""
        self.pending.append(seq)
        if sum(len(s.ids) for s in self.pending) >= self.shard_tokens:
            self.flush(cursor)

    def flush(self, cursor: int) -> None:
        if not self.pending:
            return
        name = f"shard_{len(self.index['shards']):05d}.safetensors"
        lens = [len(s.ids) for s in self.pending]
        tensors = {
            "ids": torch.cat([s.ids for s in self.pending]),
            "answer": torch.cat([s.answer for s in self.pending]).to(torch.uint8),
            "offsets": torch.tensor([0, *lens]).cumsum(0),
            "feats": torch.cat([s.feats for s in self.pending]),
            "top_ids": torch.cat([s.top_ids for s in self.pending]),
            "top_p": torch.cat([s.top_p for s in self.pending]),
        }
        save_file(tensors, os.path.join(self.out_dir, name))
        self.index["shards"].append(
            {"file": name, "seq_lens": lens, "answer_tokens": int(tensors["answer"].sum())}
        )
        self.index["cursor"] = cursor
        _write_json(self.index, os.path.join(self.out_dir, INDEX))
        self.pending.clear()


def _write_json(obj: dict, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)  # atomic: readers never see a half-written index


def read_index(shard_dir: str) -> dict | None:
    path = os.path.join(shard_dir, INDEX)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def load_shard(shard_dir: str, entry: dict) -> list[Seq]:
    """The shard's sequences, in order (views into one loaded buffer per tensor)."""
    t = load_file(os.path.join(shard_dir, entry["file"]))
    off = t["offsets"].tolist()
    return [
        Seq(
            ids=t["ids"][a:b],
            answer=t["answer"][a:b].bool(),
            feats=t["feats"][a:b],
            top_ids=t["top_ids"][a:b],
            top_p=t["top_p"][a:b],
        )
        for a, b in zip(off[:-1], off[1:])
    ]

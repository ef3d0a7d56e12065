"""The teacher-forced extraction loop: source items -> target forwards -> shards on disk.

An item is a token sequence with per-token answer flags: a templated ShareGPT conversation or a
self-distilled sequence (prompt + the target's own answer). Items are visited in a fixed order,
so the shard index's cursor is enough to resume.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

import torch
from tqdm import tqdm

from eagleserve.models.llama import LlamaForCausalLM
from eagleserve.train.shards import Seq, ShardWriter
from eagleserve.train.teacher import teacher_targets

Item = tuple[list[int], list[bool]]  # ids, answer flags
Source = Callable[[], Item | None]  # a deferred item (tokenized lazily, None = skip)


def self_distilled_items(seqs: list[list[int]], prompt_lens: list[int]) -> list[Source]:
    """Self-distilled sequences: every token after the prompt is an answer token."""
    return [
        (lambda s=s, p=p: (s, [i >= p for i in range(len(s))])) for s, p in zip(seqs, prompt_lens)
    ]


def mixed_order(sources: Sequence[list[Source]], seed: int) -> list[Source]:
    """All sources' items in one seeded shuffle (so every shard mixes the sources)."""
    items = [it for src in sources for it in src]
    random.Random(seed).shuffle(items)
    return items


def extract(
    model: LlamaForCausalLM,
    items: list[Source],
    writer: ShardWriter,
    layer_ids: tuple[int, ...],
    k: int,
    max_tokens: int,
    max_minutes: float,
    desc: str = "Teacher-forced targets",
) -> dict[str, float]:
    """Runs the target over items[writer.cursor:] until `max_tokens` tokens are stored in all
    (counting earlier runs) or `max_minutes` pass; returns tokens, seconds, tokens/s."""
    done = sum(sum(e["seq_lens"]) for e in writer.index["shards"])
    bar = tqdm(total=max_tokens, initial=min(done, max_tokens), desc=desc, unit="tok")
    t0, new = time.time(), 0
    i = writer.cursor
    while i < len(items) and done + new < max_tokens:
        if (time.time() - t0) / 60 > max_minutes:
            break
        item = items[i]()
        i += 1
        if item is None:
            continue
        ids, flags = item
        answer = torch.tensor(flags)
        need = torch.zeros_like(answer)
        need[:-1] = answer[1:]  # row t predicts token t+1: labels only where it is an answer
        feats, top_ids, top_p = teacher_targets(model, ids, layer_ids, k, need)
        seq = Seq(torch.tensor(ids, dtype=torch.int32), answer, feats, top_ids, top_p)
        writer.add(seq, cursor=i)
        new += len(ids)
        bar.update(len(ids))
    writer.flush(cursor=i)
    bar.close()
    secs = time.time() - t0
    return {"tokens": done + new, "new_tokens": new, "seconds": secs, "tok_per_s": new / secs}

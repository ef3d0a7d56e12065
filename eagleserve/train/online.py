"""Teacher-forced targets held in device memory: the GPU form of train/extract.py + shard_data.py.

Each conversation is cut into windows of at most `max_len` tokens; the target runs over every
window on its own (large padded batches, one forward per batch) and its features and top-k
next-token distribution go into flat device tensors (target ids: any head's draft vocabulary
can read them, e.g. a baseline head's on the same held-out store). The head
then trains on batches of those windows, gathered on the device: no shard files, no host copy.

Row alignment as in train/batches.py: row t of a window holds token ids[t], the target's
feature of position t and its distribution of token t+1; the row is labelled only where token
t+1 is an answer token (`nxt_answer`).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from eagleserve.device import host_to
from eagleserve.models.llama import LlamaForCausalLM
from eagleserve.train.batches import Batch, padded_len
from eagleserve.train.dense_backend import padded_features_and_final
from eagleserve.train.extract import Item
from eagleserve.train.features import IGNORE
from eagleserve.train.teacher import top_k_distribution

Window = tuple[int, int]  # start row in the store, length
LOGIT_ROWS_DEVICE = 8192  # rows per lm_head chunk: a [rows, vocab] fp32 buffer (1.6 GB at 49 k)


def cut_windows(items: list[Item], max_len: int) -> list[Item]:
    """Every item cut into consecutive windows of at most `max_len` tokens; each window keeps
    the flag of the token after it (so its last row knows whether it is labelled). Windows
    with no labelled row are dropped."""
    out: list[Item] = []
    for ids, flags in items:
        for a in range(0, len(ids), max_len):
            w_ids, w_flags = ids[a : a + max_len], flags[a : a + max_len + 1]
            if any(w_flags[1:]):
                out.append((w_ids, w_flags))
    return out


def store_bytes_per_token(width: int, k: int) -> int:
    """Device bytes per stored row: bf16 features, int32 ids and fp16 probabilities of the
    top k, int32 token id, bool flag."""
    return 2 * width + 6 * k + 5


@dataclass
class FeatureStore:
    ids: torch.Tensor  # int32 [N]
    nxt_answer: torch.Tensor  # bool [N]: row t is labelled (token t+1 is an answer token)
    feats: torch.Tensor  # bf16 [N, W]
    top_ids: torch.Tensor  # int32 [N, k]: the target's top-k (target ids), -1 unlabelled
    top_p: torch.Tensor  # fp16 [N, k]: their probabilities, 0 where the row is unlabelled
    windows: list[Window] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.windows)

    def sample(self, tokens: int, seed: int) -> FeatureStore:
        """A view of a seeded random subset of the windows, of at least `tokens` rows (or all):
        training windows scored as the held-out ones are, over as many rows."""
        wins = list(self.windows)
        random.Random(seed).shuffle(wins)
        keep: list[Window] = []
        rows = 0
        for w in wins:
            if rows >= tokens:
                break
            keep.append(w)
            rows += w[1]
        return FeatureStore(self.ids, self.nxt_answer, self.feats, self.top_ids, self.top_p, keep)


@torch.inference_mode()
def build_store(
    model: LlamaForCausalLM,
    items: list[Item],
    layer_ids: tuple[int, ...],
    k: int,
    max_tokens: int,
    batch_tokens: int,
    desc: str = "Target features",
    max_seconds: float = float("inf"),
) -> tuple[FeatureStore, dict[str, float]]:
    """Runs the target over `items` (windows, see `cut_windows`) in their order until
    `max_tokens` rows are stored; forwards batch windows of similar length up to
    `batch_tokens` padded rows. It stops before a forward that would end past `max_seconds`
    (at the padded rows a second of the forwards so far; the first always runs) and the store
    keeps only the windows done. Returns the store and {tokens, windows, seconds, tok_per_s}."""
    dev = model.model.embed_tokens.weight.device
    take, total = [], 0
    for it in items:
        if total + len(it[0]) > max_tokens:
            break
        take.append(it)
        total += len(it[0])
    width = len(layer_ids) * model.config.hidden_size
    store = FeatureStore(
        torch.zeros(total, dtype=torch.int32, device=dev),
        torch.zeros(total, dtype=torch.bool, device=dev),
        torch.zeros(total, width, dtype=torch.bfloat16, device=dev),
        torch.full((total, k), -1, dtype=torch.int32, device=dev),
        torch.zeros(total, k, dtype=torch.float16, device=dev),
    )
    starts = [0]
    for ids, _ in take:
        starts.append(starts[-1] + len(ids))
    store.windows = [(starts[i], len(take[i][0])) for i in range(len(take))]
    # Similar lengths batched (less padding), sorted within blocks of the given order, so a
    # time cut keeps a sample of every length.
    order: list[int] = []
    block = 32 * batch_tokens
    a = used = 0
    for e in range(len(take) + 1):
        if e == len(take) or used >= block:
            order += sorted(range(a, e), key=lambda i: len(take[i][0]))
            a, used = e, 0
        if e < len(take):
            used += len(take[e][0])
    bar = tqdm(total=total, desc=desc, unit="tok", unit_scale=True)
    t0 = time.time()
    i = padded = 0
    while i < len(order):
        j, n = i + 1, len(take[order[i]][0])  # a group pads to its longest window
        while j < len(order) and (j + 1 - i) * max(n, len(take[order[j]][0])) <= batch_tokens:
            n = max(n, len(take[order[j]][0]))
            j += 1
        spent = time.time() - t0
        if spent >= max_seconds or (padded and spent * (1 + (j - i) * n / padded) > max_seconds):
            break  # out of time, or this forward would end past it
        group = order[i:j]
        _store_group(model, store, [take[g] for g in group], [starts[g] for g in group], n,
                     layer_ids, k)  # fmt: skip
        bar.update(sum(len(take[g][0]) for g in group))
        padded += (j - i) * n
        i = j
    if dev.type != "cpu":
        torch.get_device_module(dev).synchronize()
    bar.close()
    store.windows = [store.windows[g] for g in sorted(order[:i])]
    secs = time.time() - t0
    done = store.tokens
    return store, {"tokens": done, "windows": len(store.windows), "seconds": secs,
                   "tok_per_s": done / max(secs, 1e-9)}  # fmt: skip


def _store_group(
    model: LlamaForCausalLM,
    store: FeatureStore,
    group: list[Item],
    starts: list[int],
    n: int,
    layer_ids: tuple[int, ...],
    k: int,
) -> None:
    dev = store.ids.device
    ids = torch.zeros(len(group), n, dtype=torch.long)
    nxt = torch.zeros(len(group), n, dtype=torch.bool)
    for b, (w_ids, w_flags) in enumerate(group):
        ids[b, : len(w_ids)] = torch.tensor(w_ids)
        f = torch.tensor(w_flags[1:], dtype=torch.bool)
        nxt[b, : len(f)] = f
    ids, nxt = ids.to(dev), nxt.to(dev)
    feats, final = padded_features_and_final(model, ids, layer_ids)
    lens = torch.tensor([len(w) for w, _ in group])
    real = (torch.arange(n)[None, :] < lens[:, None]).reshape(-1).to(dev)  # row b*n + t
    rows = torch.cat([torch.arange(s, s + m) for s, m in zip(starts, lens.tolist())]).to(dev)
    store.ids[rows] = ids.reshape(-1)[real].to(torch.int32)
    need = nxt.reshape(-1) & real
    store.nxt_answer[rows] = need[real]
    store.feats[rows] = feats[real].to(torch.bfloat16)
    if need.any():
        top_ids, top_p = top_k_distribution(model, final[need], k, LOGIT_ROWS_DEVICE)
        dst = rows[need[real]]
        store.top_ids[dst] = top_ids
        store.top_p[dst] = top_p


def store_batch(
    store: FeatureStore, wins: list[Window], label_map: torch.Tensor, depths: int, max_len: int
) -> Batch:
    """The `window_batch` of stored windows, gathered on the store's device: padded rows are
    ignored; soft labels are the top-k mapped by `label_map` (target id -> draft id or
    IGNORE; -1 outside the draft vocabulary), the hard label the target's argmax where it lies
    in the draft vocabulary. Its length is `padded_len`'s, up to `max_len`."""
    dev = store.ids.device
    n = padded_len(max(m for _, m in wins), max_len)
    start = host_to(torch.tensor([a for a, _ in wins]), dev)
    lens = host_to(torch.tensor([m for _, m in wins]), dev)
    col = torch.arange(n + depths, device=dev)
    fmask = col[None, :] < lens[:, None]
    idx = torch.where(fmask, start[:, None] + col[None, :], 0)
    x = torch.where(fmask, store.ids[idx].long(), 0)
    f = torch.where(fmask[..., None], store.feats[idx], 0).float()
    tid = torch.where(fmask[..., None], store.top_ids[idx].long(), -1)
    mapped = torch.where(tid >= 0, label_map[tid.clamp(min=0)], IGNORE)
    sid = torch.where(mapped == IGNORE, -1, mapped)
    sp = torch.where(fmask[..., None], store.top_p[idx], 0).float()
    labelled = fmask & store.nxt_answer[idx] & (sid[..., 0] >= 0)
    y = torch.where(labelled, sid[..., 0], IGNORE)
    return Batch(x, f, y, fmask, sid, sp)


@dataclass
class StoreSource:
    """BatchSource over a FeatureStore: each epoch shuffles the windows, sorts them by length
    in chunks of 16 batches (less padding) and shuffles the batches; a pure function of
    (seed, epoch, index), as ShardSource."""

    store: FeatureStore
    label_map: torch.Tensor  # [target vocab] -> draft id or IGNORE
    batch_size: int
    depths: int
    seed: int
    _plan: tuple[int, list[list[Window]]] | None = None

    def __post_init__(self) -> None:
        self.label_map = self.label_map.to(self.store.ids.device)
        self.longest = max((m for _, m in self.store.windows), default=0)  # pad no further
        self.per_epoch = len(self.plan(0))

    def plan(self, epoch: int) -> list[list[Window]]:
        if self._plan is None or self._plan[0] != epoch:
            rng = random.Random(self.seed * 1000 + epoch)
            wins = list(self.store.windows)
            rng.shuffle(wins)
            chunk = self.batch_size * 16
            batches: list[list[Window]] = []
            for c in range(0, len(wins), chunk):
                part = sorted(wins[c : c + chunk], key=lambda w: w[1])
                batches += [
                    part[i : i + self.batch_size] for i in range(0, len(part), self.batch_size)
                ]
            rng.shuffle(batches)
            self._plan = (epoch, batches)
        return self._plan[1]

    def batch(self, epoch: int, within: int) -> Batch:
        wins = self.plan(epoch)[within]
        return store_batch(self.store, wins, self.label_map, self.depths, self.longest)

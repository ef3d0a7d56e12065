"""Padded training batches and the two label losses.

Row alignment (both sources): row t holds input token x[t], the target's feature of position t,
and the label of position t, i.e. what the target predicts for x[t+1]; rows whose next token
is not an answer token, and padding, are IGNORE. Soft labels, where present, are the target's
top-k at the same rows, mapped into the draft vocabulary (-1 = outside it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagleserve.train.features import IGNORE


@dataclass
class Batch:
    x: torch.Tensor  # long [B, N + depths] input ids (0-padded)
    f: torch.Tensor  # fp32 [B, N + depths, W] target features (0-padded)
    y: torch.Tensor  # long [B, N + depths] hard label: draft id or IGNORE
    fmask: torch.Tensor  # bool [B, N + depths] rows holding a real token
    soft_ids: torch.Tensor | None = None  # long [B, N + depths, k] draft ids, -1 = none
    soft_p: torch.Tensor | None = None  # fp32 [B, N + depths, k] target probabilities


def soft_cross_entropy(
    logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor
) -> torch.Tensor:
    """Mean over rows of -sum_i q_i log softmax(logits)[ids_i], q = probs renormalized over the
    entries with ids >= 0 (the support the draft vocabulary keeps). Each row needs one kept
    entry. With a one-hot q this is exactly F.cross_entropy against that id."""
    keep = ids >= 0
    q = torch.where(keep, probs, torch.zeros_like(probs))
    q = q / q.sum(-1, keepdim=True)
    logp = logits.log_softmax(-1).gather(-1, ids.clamp(min=0))
    return -(q * torch.where(keep, logp, torch.zeros_like(logp))).sum(-1).mean()


# Batch lengths are rounded up to a multiple of this, so a trainer sees a few dozen shapes and not
# one per window length: on a CPU each new shape grew the process by megabytes a step (oneDNN's
# per-shape kernels, the allocator's fragmentation) without bound. Padded rows are masked.
LENGTH_BUCKET = 64


def padded_len(n: int, max_len: int) -> int:
    """A batch's length for its longest row n: rounded up to LENGTH_BUCKET, never past max_len
    (the positions the rotary tables hold are sized by it) unless n itself is."""
    return max(n, min(max_len, -(-n // LENGTH_BUCKET) * LENGTH_BUCKET))


def label_loss(
    logits: torch.Tensor,
    batch: Batch,
    at: tuple[torch.Tensor, torch.Tensor],
    lab: torch.Tensor,
    soft: bool,
) -> torch.Tensor:
    """CE of `logits` (the positions `at`: batch rows and columns) against the soft labels
    when `soft` and the batch has them, else against the hard labels `lab`."""
    if logits.shape[0] == 0:  # a host-known shape: no device sync
        return logits.sum()  # zero, keeps the graph
    if soft and batch.soft_ids is not None:
        assert batch.soft_p is not None
        return soft_cross_entropy(logits, batch.soft_ids[at], batch.soft_p[at])
    return F.cross_entropy(logits, lab)


def sequence_batch(
    seqs: list[list[int]],
    prompt_lens: list[int],
    feats: list[torch.Tensor],
    label_map: torch.Tensor,
    idx: list[int],
    max_len: int,
    depths: int,
) -> Batch:
    """Hard-label batch of in-memory sequences: the label of row t is x[t+1] itself (the
    target's own greedy token on self-distilled answers)."""
    n = padded_len(min(max(len(seqs[i]) for i in idx), max_len), max_len)
    bsz, w = len(idx), feats[idx[0]].shape[-1]
    x = torch.zeros(bsz, n + depths, dtype=torch.long)
    f = torch.zeros(bsz, n + depths, w)
    y = torch.full((bsz, n + depths), IGNORE, dtype=torch.long)
    fmask = torch.zeros(bsz, n + depths, dtype=torch.bool)
    for b, i in enumerate(idx):
        s = torch.tensor(seqs[i][:n])
        m, p = len(s), prompt_lens[i]
        x[b, :m] = s
        f[b, :m] = feats[i][:m].float()
        lab = label_map[s[1:]]
        lab[: max(0, p - 1)] = IGNORE
        y[b, : m - 1] = lab
        fmask[b, :m] = True
    return Batch(x, f, y, fmask)

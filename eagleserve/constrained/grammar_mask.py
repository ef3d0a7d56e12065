"""Mask math for grammar-constrained decoding: pure tensor and list functions.

A grammar backend fills one bitmask row per distribution (int32 words, bit b of word w = token
32 * w + b allowed). These functions unpack rows to bool masks, mask logits, map a mask onto a
draft head's reduced vocabulary, and name the draft-tree nodes on each node's path (a verify
node's mask is the grammar state after its own path, as target-only decoding would have it).
"""

from __future__ import annotations

import torch

BITS = 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [..., W] int32 -> allowed [..., vocab_size] bool (W * 32 >= vocab_size)."""
    shifts = torch.arange(BITS, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # sign-extended shifts: & 1 keeps one bit
    return bits.reshape(*bitmask.shape[:-1], -1)[..., :vocab_size].bool()


def allow_all_where_empty(bitmask: torch.Tensor) -> torch.Tensor:
    """Rows of bitmask [n, W] that allow no token allow every token instead (in place; returned).
    Such a row belongs to a path the target never accepts (a draft token the grammar rejects) or
    to a request that already finished, so its values reach no output; masked, it would be all
    -inf and NaN in a softmax."""
    bitmask[~bitmask.ne(0).any(dim=-1)] = -1
    return bitmask


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens get -inf (rows of `allowed` must allow some token)."""
    return torch.where(allowed, logits, float("-inf"))  # a scalar: no device tensor to copy


def to_draft_vocab(allowed: torch.Tensor, draft_to_target: torch.Tensor) -> torch.Tensor:
    """allowed [..., V] in target ids -> [..., Vd] for a head whose draft id d is target id
    draft_to_target[d]."""
    return allowed.index_select(-1, draft_to_target)


def node_paths(parents: list[int]) -> list[list[int]]:
    """For each node of a verify tree (parents[0] = -1, parents[i] < i), the nodes on its path
    from the root, the root excluded (its token is already committed), in path order."""
    paths: list[list[int]] = []
    for i, p in enumerate(parents):
        paths.append([] if p < 0 else paths[p] + [i])
    return paths

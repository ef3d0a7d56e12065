"""An EAGLE-3 head's draft vocabulary: the answer tokens it may propose, and widening a trained
head's vocabulary so that training goes on with more of them (`train-draft --init-head H
--draft-vocab-size N`).

A head drafts only tokens of its vocabulary: a position whose target argmax lies outside is a
rejected first draft whatever the head learnt. Widening keeps every trained weight and every
old token's lm_head row; a new token's row is the target's lm_head row mapped by the linear map
that best takes the target's rows of the old tokens to the head's trained ones (least squares:
the trained rows stay close to the target's they started from), so the new rows start on the
scale and in the space the head's hidden states have learnt, not as random vectors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from eagleserve.spec.eagle_head import EagleHead

DEFAULT_DRAFT_VOCAB = 8192  # --draft-vocab-size of a fresh head


def answer_counts(items: Iterable[tuple[list[int], list[bool]]]) -> Counter:
    """How often each token is an answer token (flagged) in tokenized conversations."""
    return Counter(t for ids, flags in items for t, a in zip(ids, flags) if a)


def vocab_from_counts(counts: Counter, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent answer tokens, topped up with the lowest unused ids; sorted."""
    return widened_ids(counts, torch.empty(0, dtype=torch.long), size, vocab_size)


def widened_ids(counts: Counter, kept: torch.Tensor, size: int, vocab_size: int) -> torch.Tensor:
    """Sorted target ids [size]: every id of `kept`, then the most frequent answer tokens not in
    it, topped up with the lowest unused ids."""
    chosen = kept.tolist()
    seen = set(chosen)
    if len(seen) != len(chosen) or len(chosen) > size or size > vocab_size:
        raise ValueError(f"cannot widen {len(chosen)} distinct ids to {size} of {vocab_size}")
    for t, _ in counts.most_common():
        if len(chosen) == size:
            break
        if t not in seen:
            chosen.append(t)
            seen.add(t)
    chosen += [t for t in range(vocab_size) if t not in seen][: size - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


@torch.no_grad()
def widen_head(head: EagleHead, target_lm_head: torch.Tensor, draft_ids: torch.Tensor) -> EagleHead:
    """`head` with draft vocabulary `draft_ids` (sorted target ids, a superset of its own): the
    same module, its `lm_head` and `d2t` replaced. Old tokens keep their trained rows; a new
    token's row is its `target_lm_head` row [vocab, h] through the least-squares map fitted on
    the old tokens."""
    old = head.to_target_ids(torch.arange(head.draft_vocab_size, device=head.d2t.device))
    ids = draft_ids.to(old.device)
    if not bool(torch.isin(old, ids).all()) or not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("draft_ids must be sorted, distinct, and hold the head's own vocabulary")
    trained = head.lm_head.weight
    ref = target_lm_head.to(trained.device, torch.float32)
    fit = torch.linalg.lstsq(ref[old], trained.float()).solution  # [h, h]
    fresh = ~torch.isin(ids, old)
    rows = torch.empty(ids.numel(), trained.shape[1], device=trained.device)
    rows[torch.searchsorted(ids, old)] = trained.float()
    rows[fresh] = ref[ids[fresh]] @ fit
    head.lm_head = torch.nn.Linear(trained.shape[1], ids.numel(), bias=False,
                                   device=trained.device, dtype=trained.dtype)  # fmt: skip
    head.lm_head.weight.copy_(rows)
    head.draft_vocab_size = ids.numel()
    head.d2t = ids - torch.arange(ids.numel(), device=ids.device)  # a registered buffer
    head.target_ids = None
    return head

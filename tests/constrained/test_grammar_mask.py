"""Mask math of grammar-constrained decoding (constrained/grammar_mask.py) on tiny random inputs,
against element-by-element references."""

from __future__ import annotations

import pytest
import torch

from eagleserve.constrained.grammar_mask import (
    allow_all_where_empty,
    mask_logits,
    node_paths,
    to_draft_vocab,
    unpack_bitmask,
)


@pytest.mark.parametrize("seed", range(5))
def test_unpack_bitmask_reads_every_bit(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    rows, vocab = 3, int(torch.randint(1, 100, (1,), generator=g))
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31, (rows, words), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    got = unpack_bitmask(bitmask, vocab)
    assert got.shape == (rows, vocab) and got.dtype == torch.bool
    for r in range(rows):
        for t in range(vocab):
            word = int(bitmask[r, t // 32]) & 0xFFFFFFFF
            assert bool(got[r, t]) == bool((word >> (t % 32)) & 1)


@pytest.mark.parametrize("seed", range(5))
def test_mask_logits_forbids_exactly_the_disallowed(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 11, generator=g)
    allowed = torch.rand(6, 11, generator=g) < 0.3
    allowed[:, 0] = True
    out = mask_logits(logits, allowed)
    for r in range(6):
        for t in range(11):
            assert out[r, t] == (logits[r, t] if allowed[r, t] else float("-inf"))


def test_empty_rows_allow_everything() -> None:
    """A row that allows nothing (a rejected draft path, a finished request) is left unmasked,
    never all -inf (NaN in a softmax); other rows are untouched."""
    g = torch.Generator().manual_seed(0)
    bm = torch.randint(-(2**31), 2**31, (5, 3), generator=g, dtype=torch.int64).to(torch.int32)
    bm[1] = 0
    bm[3, :2] = 0
    before = bm.clone()
    allow_all_where_empty(bm)
    assert (bm[1] == -1).all() and torch.equal(bm[[0, 2, 3, 4]], before[[0, 2, 3, 4]])
    allowed = unpack_bitmask(bm, 70)
    assert not torch.softmax(mask_logits(torch.randn(5, 70), allowed), -1).isnan().any()


def test_to_draft_vocab_follows_the_mapping() -> None:
    g = torch.Generator().manual_seed(0)
    allowed = torch.rand(4, 20, generator=g) < 0.5
    d2t = torch.randperm(20, generator=g)[:7]
    got = to_draft_vocab(allowed, d2t)
    for r in range(4):
        assert got[r].tolist() == [bool(allowed[r, int(t)]) for t in d2t]


@pytest.mark.parametrize("seed", range(5))
def test_node_paths_walk_up_to_the_root(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n = 9
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    for i, path in enumerate(node_paths(parents)):
        up, node = [], i
        while node > 0:
            up.append(node)
            node = parents[node]
        assert path == up[::-1]

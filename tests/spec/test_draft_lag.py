"""DraftLag: head inputs held by reference while requests do not draft, taken back in order."""

from __future__ import annotations

import random

import pytest
import torch

from eagleserve.spec.draft_lag import DraftLag

FEATURES = 5


def test_take_returns_every_held_pair_in_order_across_changing_batches() -> None:
    """Requests join and leave between iterations (their rows move); each request's pairs
    come back in the order held, request after request, and only the ones asked for."""
    rng = random.Random()
    slots = 6
    lag = DraftLag(slots, max_lag=8)
    expected: dict[int, list[tuple[int, torch.Tensor]]] = {s: [] for s in range(slots)}
    for _ in range(rng.randint(4, 7)):
        batch = rng.sample(range(slots), rng.randint(1, slots))  # this iteration's rows
        ids = torch.randint(0, 1000, (len(batch),))
        feats = torch.randn(len(batch), FEATURES)
        lag.hold(batch, [len(expected[s]) for s in batch], ids, feats)
        for row, s in enumerate(batch):
            expected[s].append((int(ids[row]), feats[row].clone()))
    asked = [s for s in range(slots) if expected[s] and rng.random() < 0.7] or [
        next(s for s in range(slots) if expected[s])
    ]
    counts = [len(expected[s]) for s in asked]
    ids, feats = lag.take(asked, counts)
    want = [pair for s in asked for pair in expected[s]]
    assert ids.tolist() == [i for i, _ in want]
    torch.testing.assert_close(feats, torch.stack([f for _, f in want]), atol=0, rtol=0)
    assert all(not lag.held[s] for s in asked)  # taken pairs are released
    assert all(len(lag.held[s]) == len(expected[s]) for s in range(slots) if s not in asked)


def test_hold_at_zero_drops_what_an_earlier_request_left_in_the_slot() -> None:
    lag = DraftLag(2, max_lag=4)
    for m in range(3):
        lag.hold([1], [m], torch.randint(0, 9, (1,)), torch.randn(1, FEATURES))
    ids, feats = torch.randint(0, 9, (2,)), torch.randn(2, FEATURES)
    lag.hold([1, 0], [0, 0], ids, feats)  # a new request in slot 1 starts over
    got_ids, got = lag.take([1], [1])
    assert got_ids.tolist() == [int(ids[0])]
    torch.testing.assert_close(got, feats[:1], atol=0, rtol=0)


def test_hold_refuses_a_count_past_the_ring_or_pairs_it_never_had() -> None:
    lag = DraftLag(1, max_lag=2)
    with pytest.raises(AssertionError):
        lag.hold([0], [2], torch.zeros(1, dtype=torch.long), torch.randn(1, FEATURES))
    with pytest.raises(AssertionError):
        lag.hold([0], [1], torch.zeros(1, dtype=torch.long), torch.randn(1, FEATURES))


def test_hold_copies_nothing() -> None:
    """A held pair is a row of the caller's tensors, not a copy (the caller hands in tensors
    no later forward writes to)."""
    lag = DraftLag(3, max_lag=4)
    ids, feats = torch.randint(0, 9, (3,)), torch.randn(3, FEATURES)
    lag.hold([2, 0, 1], [0, 0, 0], ids, feats, rows=[1, 2, 0])
    assert all(lag.held[s][0][1] is feats for s in range(3))
    got_ids, got = lag.take([0, 1, 2], [1, 1, 1])
    assert got_ids.tolist() == [int(ids[2]), int(ids[0]), int(ids[1])]
    torch.testing.assert_close(got, feats[[2, 0, 1]], atol=0, rtol=0)

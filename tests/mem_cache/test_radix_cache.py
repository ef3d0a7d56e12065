"""The radix tree on its own: match, insert, lock and evict against a plain reference (the list of
inserted keys), on small random keys so that shared prefixes, splits and divergences are common."""

from __future__ import annotations

import random

import pytest
import torch

from eagleserve.mem_cache.radix_cache import RadixCache


class Slots:
    """Hands out fresh slot numbers and records what the tree frees (each slot once)."""

    def __init__(self) -> None:
        self.next = 1
        self.freed: list[int] = []

    def take(self, n: int) -> torch.Tensor:
        out = torch.arange(self.next, self.next + n, dtype=torch.int64)
        self.next += n
        return out

    def free(self, slots: torch.Tensor) -> None:
        self.freed += slots.tolist()


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def tree_slots(tree: RadixCache) -> list[int]:
    out, stack = [], list(tree.root.children.values())
    while stack:
        node = stack.pop()
        out += node.value.tolist()
        stack.extend(node.children.values())
    return out


@pytest.mark.parametrize("seed", range(6))
def test_match_and_insert_agree_with_a_reference(seed: int) -> None:
    rng = random.Random(seed * 7919 + random.randrange(1 << 20))
    slots = Slots()
    tree = RadixCache(slots.free)
    inserted: list[tuple[list[int], list[int]]] = []  # key, its slot per position (the tree's)
    for _ in range(60):
        base = rng.choice(inserted)[0] if inserted and rng.random() < 0.7 else []
        tail = [rng.randrange(4) for _ in range(rng.randint(0, 8))]
        key = base[: rng.randint(0, len(base))] + tail
        # The reference: the longest prefix shared with any inserted key, and its slots.
        best, best_slots = 0, []
        for k, s in inserted:
            n = common(k, key)
            if n > best:
                best, best_slots = n, s[:n]
        got, node = tree.match_prefix(key)
        assert got.tolist() == best_slots
        if best:
            assert node is not tree.root
        new = slots.take(len(key))
        present = tree.insert(key, new)
        assert present == best
        slots.free(new[:present])  # the caller's duplicates
        inserted.append((key, best_slots + new[present:].tolist()))
        assert tree.evictable_size == len(tree_slots(tree))
        assert tree.protected_size == 0
    # Every key is found whole, with the slots it was given.
    for key, s in inserted:
        got, _ = tree.match_prefix(key)
        assert got.tolist() == s
    assert sorted(tree_slots(tree) + slots.freed) == list(range(1, slots.next))


def test_locked_paths_survive_eviction_and_lru_order_holds() -> None:
    rng = random.Random(random.randrange(1 << 20))
    slots = Slots()
    tree = RadixCache(slots.free)
    keys = []
    for i in range(6):  # disjoint first keys: one leaf each, inserted (used) in order i
        key = [i * 10 + 1] + [rng.randrange(100) for _ in range(rng.randint(2, 6))]
        tree.insert(key, slots.take(len(key)))
        keys.append(key)
    tree.match_prefix(keys[0])  # key 0 becomes the most recently used
    _, locked = tree.match_prefix(keys[2][:2])  # splits key 2; its upper part gets locked
    tree.lock(locked)
    assert tree.protected_size == 2
    total = tree.evictable_size + tree.protected_size

    # Slots were handed out in order: key i's are the next len(key) numbers.
    starts = [1 + sum(len(k) for k in keys[:i]) for i in range(len(keys))]
    assert tree.evict(1) == 1  # the least recently used leaf, key 1, loses its last position
    assert slots.freed == [starts[1] + len(keys[1]) - 1]
    # Key 1's rest, then the next least recently used leaf (key 2's unlocked part) loses one.
    assert tree.evict(len(keys[1])) == len(keys[1])
    assert sorted(slots.freed) == [*range(starts[1], starts[2]), starts[3] - 1]
    assert tree.match_prefix(keys[1])[0].numel() == 0
    assert tree.match_prefix(keys[2])[0].numel() == len(keys[2]) - 1
    # Evicting everything leaves the locked path (the lower part of key 2 is an unlocked leaf).
    tree.evict(10**6)
    assert tree.evictable_size == 0 and tree.protected_size == 2
    assert tree.match_prefix(keys[2])[0].numel() == 2
    assert len(slots.freed) == total - 2
    tree.unlock(locked)
    assert tree.evictable_size == 2 and tree.protected_size == 0
    assert tree.evict(3) == 2
    assert sorted(slots.freed) == list(range(1, slots.next))


def test_evicting_a_leaf_frees_a_childless_parent_in_turn() -> None:
    slots = Slots()
    tree = RadixCache(slots.free)
    tree.insert([1, 2, 3, 4], slots.take(4))
    tree.insert([1, 2, 7], slots.take(3))  # splits: [1, 2] -> [3, 4] and [7]
    slots.free(torch.arange(5, 7))  # that insert's duplicates of [1, 2]
    assert tree.insert([1, 2, 7], slots.take(3)) == 3
    slots.free(torch.arange(8, 11))
    # [3, 4] (least recent) then [7] go: 3 < 4 slots, so the now childless [1, 2] loses its
    # last position too.
    assert tree.evict(4) == 4
    assert tree.match_prefix([1, 2, 7])[0].tolist() == [1]
    assert tree.evictable_size == 1
    assert tree.evict(4) == 1
    assert tree.evictable_size == 0 and not tree.root.children
    assert sorted(slots.freed) == list(range(1, 11))


@pytest.mark.parametrize("seed", range(4))
def test_eviction_frees_what_is_asked_and_keeps_prefixes(seed: int) -> None:
    """Evicting n slots frees exactly n (or all that is unlocked); what stays of a key is a
    prefix of it, with its own slots; locked paths stay whole."""
    rng = random.Random(seed * 104729 + random.randrange(1 << 20))
    slots = Slots()
    tree = RadixCache(slots.free)
    keys = []
    slot_of: dict[tuple[int, ...], int] = {}  # a prefix -> the slot its last position got
    locked = []
    for _ in range(40):
        key = [rng.randrange(3) for _ in range(rng.randint(1, 10))]
        new = slots.take(len(key))
        present = tree.insert(key, new)
        slots.free(new[:present])
        keys.append(key)
        slot_of.update({tuple(key[: i + 1]): int(new[i]) for i in range(present, len(key))})
        if rng.random() < 0.2:
            _, node = tree.match_prefix(key[: rng.randint(1, len(key))])
            tree.lock(node)
            locked.append((key, node))
        if rng.random() < 0.4:
            before = tree.evictable_size
            ask = rng.randint(1, 12)
            assert tree.evict(ask) == min(ask, before)
            assert tree.evictable_size == before - min(ask, before)
        for key in keys:  # what is cached of a key is a prefix, with the slots it was given
            got = tree.match_prefix(key)[0].tolist()
            assert got == [slot_of[tuple(key[: i + 1])] for i in range(len(got))]
        for key, node in locked:
            path = []
            while node is not tree.root:
                path, node = node.key + path, node.parent
            assert key[: len(path)] == path  # the locked node still spells a prefix of key
        assert tree.evictable_size + tree.protected_size == len(tree_slots(tree))
    assert sorted(tree_slots(tree) + slots.freed) == list(range(1, slots.next))

"""A radix tree from cache keys to KV slots (page size 1), after SGLang's RadixCache.

Each node holds a run of keys and the KV slot of each: the path from the root to a node spells a
key prefix, and position p of that prefix has its KV at the p-th slot along the path. Keys are
plain ints here; what a key stands for is the caller's business (mem_cache/prefix_cache.py).

Invariants:
- A slot is owned either by the tree (exactly one node) or by whoever inserted it; the tree
  frees slots only in `evict`, through the callback it was built with, a whole leaf or the tail
  of one.
- `lock_ref` counts the requests reading a node; locking a node locks its whole path to the
  root, so a locked node's ancestors are locked too and only unlocked leaves are evicted.
- `evictable_size + protected_size` is the number of slots in the tree: unlocked nodes count in
  the first, locked ones in the second (the root holds no slot).
- Access times come from a counter, not the wall clock: LRU order is deterministic.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

import torch


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, parent: TreeNode | None, key: list[int], value: torch.Tensor) -> None:
        self.children: dict[int, TreeNode] = {}  # by the first key of the child
        self.parent = parent
        self.key = key
        self.value = value  # [len(key)] int64 KV slots, on the host
        self.lock_ref = 0
        self.last_access = 0


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RadixCache:
    def __init__(self, free_slots: Callable[[torch.Tensor], None]) -> None:
        self.free_slots = free_slots
        self.root = TreeNode(None, [], torch.empty(0, dtype=torch.int64))
        self.root.lock_ref = 1  # never evicted, never counted
        self.evictable_size = 0
        self.protected_size = 0
        self._clock = itertools.count(1)

    # ---- lookups ---------------------------------------------------------------------------
    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """The slots of the longest cached prefix of `key`, and the node where it ends (split so
        that it ends exactly there). Marks the path as just used."""
        now = next(self._clock)
        node, pos, values = self.root, 0, []
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_len(child.key, key[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            values.append(child.value)
            node, pos = child, pos + n
        slots = torch.cat(values) if values else self.root.value
        return slots, node

    def insert(self, key: list[int], slots: torch.Tensor) -> int:
        """Adds `key` with `slots` [len(key)]. Returns how many leading keys were already in the
        tree: their slots in `slots` are duplicates the caller still owns (and must free); the
        tree takes ownership of the rest."""
        assert len(key) == slots.numel()
        now = next(self._clock)
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = TreeNode(node, key[pos:], slots[pos:].to("cpu", torch.int64).clone())
                leaf.last_access = now
                node.children[key[pos]] = leaf
                self.evictable_size += len(leaf.key)
                return pos
            n = _common_len(child.key, key[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, pos = child, pos + n
        return pos

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cuts `child` after its first n keys; returns the new upper part (same lock count, so
        the size accounting is unchanged)."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = TreeNode(parent, child.key[:n], child.value[:n])
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        return upper

    # ---- reference counts ------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        """A request reads the path root..node: none of it may be evicted until `unlock`."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "radix cache: unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            assert node.parent is not None
            node = node.parent

    # ---- eviction --------------------------------------------------------------------------
    def evict(self, num_slots: int) -> int:
        """Frees `num_slots` slots (fewer if the tree has fewer unlocked) from the least recently
        used unlocked leaves; a parent left childless becomes a candidate in turn. The last leaf
        it reaches loses only the tail it must (a prefix of a cached run is a cached run), so a
        request's cached positions outlast a shortage smaller than them. Returns how many were
        freed."""
        order = itertools.count()  # tie-break: nodes do not compare
        heap = [(n.last_access, next(order), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_slots and heap:
            _, _, node = heapq.heappop(heap)
            keep = len(node.key) - (num_slots - freed)
            if keep > 0:
                self.free_slots(node.value[keep:])
                freed += len(node.key) - keep
                self.evictable_size -= len(node.key) - keep
                node.key, node.value = node.key[:keep], node.value[:keep]
                break
            parent = node.parent
            assert parent is not None
            self.free_slots(node.value)
            freed += len(node.key)
            self.evictable_size -= len(node.key)
            del parent.children[node.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return freed

    def _leaves(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out

"""PrefixCache.make_room on a pool full of cached prefixes: decode steps that each need a slot
get it, and the tree is walked (an eviction) once per many steps, not on every one."""

from __future__ import annotations

import random

import torch

from eagleserve.mem_cache.kv_cache import ReqToTokenPool, TokenToKVPool
from eagleserve.mem_cache.prefix_cache import EVICT_STEPS, PrefixCache


def test_a_full_cache_is_evicted_in_steps_not_slot_by_slot() -> None:
    rng = random.Random(random.randrange(1 << 20))
    size = 1024
    kv = TokenToKVPool(size, 1, 1, 1, torch.float32, torch.device("cpu"))
    cache = PrefixCache(ReqToTokenPool(4, 64, torch.device("cpu")), kv, 256, enabled=True)
    tree = cache.tree
    assert tree is not None
    first = 0
    while kv.available_size() > 8:  # finished requests' prefixes, a few slots each
        n = min(rng.randint(2, 6), kv.available_size() - 8)
        slots = kv.alloc_host(n)
        assert tree.insert([first + i for i in range(n)], slots) == 0
        first += 1000
    walks = 0
    evict = tree.evict

    def counted(num_slots: int) -> int:
        nonlocal walks
        walks += 1
        return evict(num_slots)

    tree.evict = counted  # type: ignore[method-assign]
    steps = 300
    for _ in range(steps):
        assert cache.make_room(1)
        assert kv.alloc_host(1) is not None
    step = size // EVICT_STEPS
    assert walks <= steps // step + 1, walks
    # What was evicted is about what the steps took: the cache is not wiped.
    assert cache.evicted_tokens <= steps + step
    assert tree.evictable_size >= size - steps - step - 8

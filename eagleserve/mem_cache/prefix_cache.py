"""Prefix caching for the scheduler: which of a request's KV slots enter the radix tree, and what
a match gives a new request.

The key of position p is the token pair (t[p], t[p+1]) (`pair_keys`). The target's KV at p
depends on t[0..p]; the EAGLE head's KV at p (same slot number, the head's own buffers) was
written by an extend that paired token t[p+1] with the target feature of position p, so it
depends on t[0..p+1]. Keying p by both tokens makes every matched slot hold exactly the target
and head KV a full prefill of the new request would write, even where the new request goes on
differently from the one that inserted it (a plain token key would hand over head KV paired
with the old request's next token). A match of m keys covers positions 0..m-1 and needs token
t[m]: at least the last token of a request is always computed, which the first sampled token
needs anyway.

Which positions are inserted (`cacheable_len`): committed ones only (never verify slots that
were not accepted), less the newest `draft_lag` ones, whose head KV adaptive speculation has
not written yet (spec/draft_lag.py). A request with vLLM's `cache_salt` keys its positions in
its salt's own range (`salt_offset`): it shares KV only with requests of the same salt, as in
vLLM, so no other tenant can learn from timing what its prompts held.
"""

from __future__ import annotations

import hashlib

from eagleserve.core import FinishReason, Req
from eagleserve.mem_cache.kv_cache import ReqToTokenPool, TokenToKVPool
from eagleserve.mem_cache.radix_cache import RadixCache, TreeNode

EVICT_STEPS = 64


def pair_keys(token_ids: list[int], vocab_size: int, salt: str | None = None) -> list[int]:
    """Key of position p: t[p] * vocab + t[p+1], moved into the salt's own range of keys
    (`salt_offset`); one key fewer than tokens."""
    offset = salt_offset(salt, vocab_size)
    return [offset + a * vocab_size + b for a, b in zip(token_ids, token_ids[1:])]


def salt_offset(salt: str | None, vocab_size: int) -> int:
    """0 without a salt; else (1 + a 64-bit hash of it) * vocab^2: the keys of each salt fill
    a range of their own, so requests share cached KV only with requests of the same salt."""
    if salt is None:
        return 0
    digest = hashlib.blake2b(salt.encode(), digest_size=8).digest()
    return (1 + int.from_bytes(digest, "big")) * vocab_size * vocab_size


def cacheable_len(req: Req) -> int:
    """Leading positions of `req` whose target and head KV are final, as pair keys allow."""
    if req.finish_reason == FinishReason.ERROR:
        return 0  # the forward that failed may have written part of them
    return max(0, min(req.kv_committed_len - req.draft_lag, req.seq_len - 1))


class PrefixCache:
    """Request slots, their cached prefixes, and the radix tree (None: caching off)."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: TokenToKVPool,
        vocab_size: int,
        enabled: bool,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.vocab_size = vocab_size
        self.tree = RadixCache(kv_pool.free) if enabled else None
        # Per request slot: the tree node it locked and how many leading slots are the tree's.
        self._held: dict[int, tuple[TreeNode | None, int]] = {}
        self.hit_tokens = 0
        self.queried_tokens = 0
        self.evicted_tokens = 0

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def evictable_size(self) -> int:
        return self.tree.evictable_size if self.tree is not None else 0

    @property
    def cached_size(self) -> int:
        """Slots the tree holds (locked or not)."""
        tree = self.tree
        return tree.evictable_size + tree.protected_size if tree is not None else 0

    def available_size(self) -> int:
        """Slots an allocation can get: free ones plus those eviction can free."""
        return self.kv_pool.available_size() + self.evictable_size

    def make_room(self, num_slots: int) -> bool:
        """Evicts least recently used cached prefixes until `num_slots` slots are free. An
        eviction walks the whole tree, so it frees at least 1/EVICT_STEPS of the pool: a full
        pool of cached prefixes costs a walk every so many decode steps, not every step."""
        short = num_slots - self.kv_pool.available_size()
        if short > 0 and self.tree is not None:
            step = self.kv_pool.size // EVICT_STEPS
            self.evicted_tokens += self.tree.evict(max(short, step))
        return self.kv_pool.available_size() >= num_slots

    def flush(self) -> int:
        """Frees every cached prefix no request holds (with none running: all of them); not
        counted as evictions, which are for new requests. Returns the slots freed."""
        return self.tree.evict(self.tree.evictable_size) if self.tree is not None else 0

    # ---- a request's slots -----------------------------------------------------------------
    def admit(self, req: Req) -> int | None:
        """Gives `req` a request slot whose first positions are the longest cached prefix of its
        tokens (locked against eviction); returns the prefix length, or None without a free
        request slot. The rest of its positions get slots in `prepare_for_extend`."""
        idx = self.req_to_token_pool.alloc()
        if idx is None:
            return None
        fill = req.fill_ids
        node, prefix_len = None, 0
        if self.tree is not None:
            # Prompt logprobs need every prompt position computed: such a request matches
            # nothing (it still caches its positions when it finishes).
            p = req.sampling_params
            keys = pair_keys(fill, self.vocab_size, p.cache_salt)
            slots, node = self.tree.match_prefix([] if p.prompt_logprobs is not None else keys)
            prefix_len = slots.numel()
            self.tree.lock(node)
            if prefix_len:
                self.req_to_token_pool.write_spans([(idx, 0, prefix_len)], slots)
        self._held[idx] = (node, prefix_len)
        req.req_pool_idx = idx
        req.kv_committed_len = req.kv_allocated_len = prefix_len
        return prefix_len

    def count_admitted(self, prefix_len: int, num_tokens: int) -> None:
        """Hit statistics of one admission that went ahead (`admit` may be undone)."""
        self.hit_tokens += prefix_len
        self.queried_tokens += num_tokens

    def release(self, req: Req, cache: bool) -> None:
        """Frees `req`'s request slot and every KV slot it owns; with `cache`, its cacheable
        positions go into the tree first (slots the tree already has are freed as duplicates)."""
        idx = req.req_pool_idx
        assert idx is not None
        node, prefix_len = self._held.pop(idx)
        slots = self.req_to_token_pool.row_slots(idx, req.kv_allocated_len)
        valid = cacheable_len(req) if cache and self.tree is not None else 0
        if self.tree is not None and valid > prefix_len:
            keys = pair_keys(
                req.fill_ids[: valid + 1], self.vocab_size, req.sampling_params.cache_salt
            )
            present = self.tree.insert(keys, slots[:valid])
            # The locked path is in the tree, so at least the prefix was already there.
            assert present >= prefix_len, (present, prefix_len)
            self.kv_pool.free(slots[prefix_len:present])
            self.kv_pool.free(slots[valid:])
        else:
            self.kv_pool.free(slots[prefix_len:])
        if self.tree is not None and node is not None:
            self.tree.unlock(node)
        self.req_to_token_pool.free(idx)
        req.req_pool_idx = None
        req.kv_allocated_len = 0
        req.kv_committed_len = 0

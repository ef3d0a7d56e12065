"""Choosing the next prefill: which waiting requests join it, and how many tokens of each.

A prefill computes at most `token_budget` tokens. With chunking on, a request whose remaining
tokens exceed what is left of the budget takes what is left (a chunk) and goes on in later
prefills as the scheduler's chunked request; at most one request is part-way at a time, and it
comes first in the next prefill. With chunking off, a request larger than the budget runs alone.

Memory: a request picked gets KV slots for all its remaining positions at once (in
`prepare_for_extend`), so a chunked prefill never waits for memory half-way; one decode step of
slots stays reserved for every request that is or will be running, so admission never forces a
retraction. Cached prefixes are evicted (least recently used first) before a request is left
waiting for memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagleserve.core import Req
from eagleserve.mem_cache.prefix_cache import PrefixCache
from eagleserve.scheduler.waiting_queue import WaitingQueue


@dataclass
class PrefillPlan:
    reqs: list[Req]
    extend_lens: list[int]  # tokens each request computes in this prefill
    chunked_req: Req | None  # the request whose prefill goes on after this one


def plan_prefill(
    waiting: WaitingQueue,
    chunked_req: Req | None,
    num_running: int,
    max_running: int,
    token_budget: int,
    chunking: bool,
    decode_slots_per_req: int,
    cache: PrefixCache,
) -> PrefillPlan | None:
    """Pops the requests it admits off `waiting`; None when nothing can run."""
    reqs: list[Req] = []
    lens: list[int] = []
    budget = token_budget
    reserve = num_running * decode_slots_per_req
    to_alloc = 0
    next_chunked: Req | None = None
    if chunked_req is not None:  # already holds slots for all its positions
        remaining = len(chunked_req.fill_ids) - chunked_req.kv_committed_len
        n = min(remaining, budget)
        reqs.append(chunked_req)
        lens.append(n)
        budget -= n
        reserve += decode_slots_per_req
        next_chunked = chunked_req if n < remaining else None
    while waiting and budget > 0 and next_chunked is None and num_running + len(reqs) < max_running:
        req = waiting[0]
        prefix_len = cache.admit(req)
        if prefix_len is None:
            break
        remaining = len(req.fill_ids) - prefix_len
        # Prompt logprobs are scored in one prefill: such a request is never chunked.
        whole = not chunking or req.sampling_params.prompt_logprobs is not None
        too_big = whole and bool(reqs) and remaining > budget
        if too_big or not cache.make_room(to_alloc + remaining + reserve + decode_slots_per_req):
            cache.release(req, cache=False)
            break
        waiting.popleft()
        cache.count_admitted(prefix_len, len(req.fill_ids))
        if not req.retract_count:  # a first admission: a retracted request's own KV is no hit
            req.cached_tokens = prefix_len
        n = remaining if whole else min(remaining, budget)
        reqs.append(req)
        lens.append(n)
        budget -= n
        to_alloc += remaining
        reserve += decode_slots_per_req
        next_chunked = req if n < remaining else None
    if not reqs:
        return None
    return PrefillPlan(reqs, lens, next_chunked)

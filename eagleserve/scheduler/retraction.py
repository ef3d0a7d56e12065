"""Retraction: running requests sent back to the waiting queue, to free the KV slots the next
decode step needs, or (priority scheduling) for a waiting request that outranks them.

A retracted request's computed positions go into the prefix cache, whose eviction takes only the
tail a shortage needs: back in the queue, it recomputes what was evicted and goes on with the
same tokens. Retraction needs exact host state, so an in-flight batch lands first.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from eagleserve.core import Req, ScheduleBatch
from eagleserve.scheduler.waiting_queue import preemption_victim, retraction_victim

if TYPE_CHECKING:
    from eagleserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def retract(sched: Scheduler, req: Req) -> None:
    """Sends `req`, which holds slots and is in no batch now, back to the queue."""
    sched.release(req)
    req.retract_count += 1
    sched.num_retracted += 1
    sched.waiting.push(req)


def retract_for_decode(sched: Scheduler) -> ScheduleBatch | None:
    """Makes room for the running batch's next decode step: cached prefixes are evicted first,
    then requests retracted. The running batch after that (None when none is left)."""
    batch = sched.running_batch
    assert batch is not None
    per_req = sched.worker.decode_slots_per_req
    if not sched.prefix_cache.make_room(batch.batch_size * per_req) and sched.inflight:
        sched.finish_inflight()
        batch = sched.running_batch
        if batch is None:
            return None
    while not sched.prefix_cache.make_room(batch.batch_size * per_req):
        # A prefill part-way holds slots for its whole prompt and has produced nothing: it goes
        # back first, else the running request ranked last (the newest, by priority where
        # priority scheduling is on). One request alone fits (max_context_len).
        if sched.chunked_req is not None:
            req, sched.chunked_req = sched.chunked_req, None
        elif batch.batch_size > 1:
            req = retraction_victim(batch.reqs, sched.waiting.policy)
            batch.filter_batch([i for i, r in enumerate(batch.reqs) if r is not req])
        else:
            break
        logger.info("KV pool full: retracting request %s", req.rid)
        retract(sched, req)
    return batch


def preempt_for_waiting(sched: Scheduler) -> bool:
    """The head of the queue could not start (no request slot or KV memory): retracts the
    running request it outranks, where priority scheduling allows one. True when the next plan
    may differ: a request was retracted, or the in-flight batch landed first (the requests it
    finished may have made room)."""
    batch, waiting = sched.running_batch, sched.waiting
    if batch is None or not waiting or sched.chunked_req is not None:
        return False
    victim = preemption_victim(batch.reqs, waiting[0], waiting.policy)
    if victim is None:
        return False
    if sched.inflight:
        sched.finish_inflight()
        return True
    logger.info("request %s (priority %d) preempts request %s (priority %d)",
                waiting[0].rid, waiting[0].priority, victim.rid, victim.priority)  # fmt: skip
    batch.filter_batch([i for i, r in enumerate(batch.reqs) if r is not victim])
    sched.drop_finished_from_running()  # a batch left empty is no running batch
    retract(sched, victim)
    return True

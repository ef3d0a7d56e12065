"""Start-up warm-up (SGLang's server warm-up; `--skip-server-warmup` leaves it out).

On an accelerator Triton compiles a kernel on its first launch with each new specialisation (a
block size chosen from the batch's shape, an integer argument equal to 1 or divisible by 16),
about a second each. Device graphs and the adaptive cost table compile what they replay, but the
eager paths a served request also takes (its prefill, the head's prompt write, the adaptive
draft lag's flush and probe, the output copies) would compile during the first request alone
and the first full batch, stalling their streams. So before the engine reports ready it
generates once for one request alone and once for a batch of 16, as a user's requests would run,
then leaves the scheduler as it found it: nothing cached, every slot free, its statistics as
before (a warm-up's acceptance must not move the adaptive controller's prior)."""

from __future__ import annotations

import copy
import logging
import time
from typing import TYPE_CHECKING

import torch

from eagleserve.messages import GenerateReqInput
from eagleserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from eagleserve.config import ServerArgs
    from eagleserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

WARM_BATCHES = (1, 16)  # alone, and a batch size divisible by 16
PROMPT_TOKENS = 48
# Past one adaptive probe interval, so the draft lag's flush and a probe's catch-up run too;
# a longer interval (where probes are rare anyway) is not waited for at start-up.
EXTRA_TOKENS = 8
MAX_NEW_TOKENS = 128


def warm_up_needed(args: ServerArgs, device: torch.device) -> bool:
    """A CPU compiles nothing at run time; tensor-parallel ranks would each need the same
    warm-up in lockstep, so they are left out."""
    return device.type != "cpu" and not args.skip_server_warmup and args.tp_size == 1


def warm_up(sched: Scheduler) -> float:
    """Runs the warm-up generations to completion; returns their wall time in seconds."""
    spec = sched.spec_config
    new_tokens = spec.adaptive_probe_interval + EXTRA_TOKENS if spec and spec.adaptive else 16
    new_tokens = min(new_tokens, MAX_NEW_TOKENS, sched.max_context_len // 2)
    prompt_len = max(1, min(PROMPT_TOKENS, sched.max_context_len - new_tokens))
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = sched.model_config.vocab_size
    spec_stats = copy.deepcopy(sched.spec_stats)
    cache = sched.prefix_cache
    counters = (cache.hit_tokens, cache.queried_tokens, cache.evicted_tokens)
    generated = sched.generation_tokens
    controller = getattr(sched.worker, "controller", None)  # adaptive: its probe rhythm
    probe_state = None if controller is None else (controller.since_draft, controller.backoff)
    t0 = time.perf_counter()
    for bs in WARM_BATCHES:
        rids = {f"warm-up-{bs}-{i}" for i in range(min(bs, sched.args.max_running_requests))}
        for rid in sorted(rids):
            ids = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
            sched.add_request(GenerateReqInput(rid, ids, params))
        while rids:
            for out in sched.step():
                if out.error is not None:
                    raise RuntimeError(f"start-up warm-up failed: {out.error}")
                if out.finished:
                    rids.discard(out.rid)
        while sched.has_work():  # a forward still in flight: its slots come back after it
            sched.step()
    cache.flush()  # the warm-up's prompts leave the prefix cache
    cache.hit_tokens, cache.queried_tokens, cache.evicted_tokens = counters
    sched.generation_tokens = generated
    sched.spec_stats = spec_stats
    if controller is not None:
        controller.since_draft, controller.backoff = probe_state
    seconds = time.perf_counter() - t0
    logger.info("start-up: warm-up generations in %.2f s", seconds)
    return seconds

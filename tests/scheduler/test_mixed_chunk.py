"""Mixed chunks (--enable-mixed-chunk): a prefill chunk and the running requests' decode step in
one forward give the tokens one-shot prefills and plain decodes give (greedy, seeded, with
penalties; overlap on and off), prompt logprobs stay those of the prompt, the pools are whole
afterwards, and speculation refuses the flag."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import assert_kv_accounted, random_prompts

from eagleserve.cli import check_values
from eagleserve.config import ServerArgs
from eagleserve.core import Req, ScheduleBatch
from eagleserve.messages import GenerateReqInput
from eagleserve.sampling.prompt_logprobs import wants_prompt_logprobs
from eagleserve.sampling_params import SamplingParams
from eagleserve.scheduler.scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("torch_threads")

CHUNK = 16


def record_batches(sched: Scheduler) -> list[tuple[str, int, bool]]:
    """(mode, decode rows, a prefill is part-way) of every batch the scheduler runs."""
    seen: list[tuple[str, int, bool]] = []
    pick = sched.get_next_batch_to_run

    def recording() -> ScheduleBatch | None:
        batch = pick()
        if batch is not None:
            seen.append((batch.mode, batch.decode_rows, sched.chunked_req is not None))
        return batch

    sched.get_next_batch_to_run = recording  # type: ignore[method-assign]
    return seen


def run_staggered(
    sched: Scheduler, prompts: list[list[int]], params: list[SamplingParams]
) -> dict[str, Any]:
    """Adds two requests every third step while others decode; tokens and prompt logprobs."""
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    scored: dict[str, Any] = {}
    pending = list(enumerate(zip(prompts, params)))
    steps = 0
    while pending or sched.has_work():
        for _ in range(2 if steps % 3 == 0 else 0):
            if pending:
                i, (p, sp) = pending.pop(0)
                sched.add_request(GenerateReqInput(f"r{i}", p, sp))
        for out in sched.step():
            assert out.error is None, out.error
            tokens[out.rid].extend(out.new_token_ids)
            if out.prompt_logprobs is not None:
                scored[out.rid] = out.prompt_logprobs.logprobs
        steps += 1
        assert steps < 5000
    assert_kv_accounted(sched)
    return {"tokens": tokens, "prompt_logprobs": scored}


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded", "penalties"])
def test_mixed_chunks_give_one_shot_tokens(
    tiny_model_dir: str,
    make_scheduler: Callable[..., Scheduler],
    overlap: bool,
    sampling: str,
) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    # Pairs of a short prompt (prefilled whole) and a long one (chunked): the short one
    # decodes in the next forward, beside the long one's chunk.
    lens = [n for _ in range(5) for n in (rng.randrange(3, 12), rng.randrange(40, 90))]
    prompts = random_prompts(len(lens), lens, seed=seed)
    params = []
    for i in range(len(prompts)):
        kw: dict[str, Any] = dict(max_new_tokens=rng.randrange(6, 20), ignore_eos=True)
        if sampling == "greedy":
            # The short prompts' (a prompt scored for logprobs is prefilled whole).
            kw.update(temperature=0.0, prompt_logprobs=None if i % 2 else 2)
        elif sampling == "seeded":
            kw.update(temperature=0.9, seed=seed + i)
        else:  # a decode row's counts go on across a mixed step (overlap: its host tokens lag)
            kw.update(
                temperature=0.0,
                max_new_tokens=rng.randrange(20, 40),
                frequency_penalty=2.0,
                presence_penalty=1.0,
                repetition_penalty=1.5,
            )
        params.append(SamplingParams(**kw))
    got = {}
    for mixed in (False, True):
        sched = make_scheduler(
            tiny_model_dir,
            disable_overlap_schedule=not overlap,
            chunked_prefill_size=CHUNK if mixed else 0,
            enable_mixed_chunk=mixed,
            disable_radix_cache=True,
            # Exact tokens need kernels whose rows do not depend on the batch beside them, as
            # the packed default model's are: the tiny model's dense fp32 GEMMs round
            # differently for a mixed batch's shapes and flip a near-tie about once in 300 runs.
            enable_deterministic_inference=True,
        )
        seen = record_batches(sched)
        got[mixed] = run_staggered(sched, prompts, params)
        # With mixing, chunks of a part-way prefill ran inside the decode step's forward, and
        # no decode ran alone while a prefill was part-way.
        mixed_chunks = [s for s in seen if s[0] == "extend" and s[1] > 0 and s[2]]
        assert bool(mixed_chunks) == mixed, seen
        if mixed:
            assert not any(s[0] == "decode" and s[2] for s in seen), seen
    assert got[True]["tokens"] == got[False]["tokens"], seed
    on, off = got[True]["prompt_logprobs"], got[False]["prompt_logprobs"]
    assert on.keys() == off.keys()
    for rid in on:  # the same rows scored, once (logits of other shapes: a tolerance)
        assert len(on[rid]) == len(off[rid])
        assert on[rid][0] is None and off[rid][0] is None
        assert on[rid][1:] == pytest.approx(off[rid][1:], abs=1e-4)


def test_mixed_chunk_refuses_speculation(tiny_model_dir: str) -> None:
    args = ServerArgs(model=tiny_model_dir, speculative_algorithm="EAGLE",
                      speculative_draft_model_path="unused", enable_mixed_chunk=True)  # fmt: skip
    msg = check_values(args)
    assert msg is not None and "--enable-mixed-chunk" in msg
    with pytest.raises(ValueError, match="--enable-mixed-chunk"):
        Scheduler(args)


def test_decode_rows_are_not_scored_for_prompt_logprobs() -> None:
    """Under overlap a request whose first token is still in flight has no output on the host
    yet; as a mixed batch's decode row it must not be scored as a prompt again."""
    params = SamplingParams(max_new_tokens=4, prompt_logprobs=2)
    rng = random.Random()
    reqs = [Req(f"r{i}", [rng.randrange(3, 200) for _ in range(5)], params) for i in range(4)]
    n_decode = rng.randrange(1, 4)
    batch = ScheduleBatch(reqs=reqs, mode="extend", device=torch.device("cpu"),
                          decode_rows=n_decode)  # fmt: skip
    assert wants_prompt_logprobs(batch) == list(range(4 - n_decode))

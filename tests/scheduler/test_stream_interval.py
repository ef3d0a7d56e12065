"""--stream-interval: a request's output goes out once that many tokens are unsent (its first
token and its end at once), with the same tokens as one output an iteration, target-only and
under speculation, with the overlap scheduler and without."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from random_llama import head_dir, model_dir  # noqa: F401  (the fixtures)

from eagleserve.core import SamplingParams
from eagleserve.messages import GenerateReqInput, TokenOutput
from eagleserve.scheduler.scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("torch_threads")


def outputs_by_request(sched: Scheduler, prompts: list[list[int]], lengths: list[int]) -> dict:
    for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
        params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        sched.add_request(GenerateReqInput(f"r{i}", prompt, params))
    outs: dict[str, list[TokenOutput]] = {}
    for _ in range(10_000):
        if not sched.has_work():
            return outs
        for out in sched.step():
            assert out.error is None, out.error
            outs.setdefault(out.rid, []).append(out)
    raise AssertionError("the scheduler did not drain")


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
@pytest.mark.parametrize("spec", [False, True], ids=["target-only", "eagle-chain3"])
def test_outputs_gather_stream_interval_tokens(
    model_dir: str,  # noqa: F811
    head_dir: str,  # noqa: F811
    make_scheduler: Callable[..., Scheduler],
    spec: bool,
    overlap: bool,
) -> None:
    rng = random.Random()
    chain = dict(speculative_algorithm="EAGLE", speculative_draft_model_path=head_dir,
                 speculative_num_steps=3, speculative_eagle_topk=1,
                 speculative_num_draft_tokens=4)  # fmt: skip
    prompts = [torch.randint(1, 63, (rng.randint(3, 12),)).tolist() for _ in range(4)]
    lengths = [rng.randint(8, 30) for _ in prompts]
    interval = rng.randint(2, 6)
    runs = {}
    for k in (1, interval):
        sched = make_scheduler(model_dir, max_total_tokens=1024, max_running_requests=8,
                               disable_overlap_schedule=not overlap, stream_interval=k,
                               **(chain if spec else {}))  # fmt: skip
        runs[k] = outputs_by_request(sched, prompts, lengths)
    for i, n in enumerate(lengths):
        every, gathered = runs[1][f"r{i}"], runs[interval][f"r{i}"]
        tokens = [t for o in every for t in o.new_token_ids]
        assert len(tokens) == n and [t for o in gathered for t in o.new_token_ids] == tokens
        assert gathered[-1].finished and not any(o.finished for o in gathered[:-1])
        assert len(gathered[0].new_token_ids) == 1  # the prefill's token, at once
        # Between the first and the last, each output waited for `interval` tokens (a verify
        # step may bring more at once); one an iteration without it.
        assert all(len(o.new_token_ids) >= interval for o in gathered[1:-1])
        if not spec:
            assert all(len(o.new_token_ids) == 1 for o in every)
        assert len(gathered) < len(every) or len(every) <= 2

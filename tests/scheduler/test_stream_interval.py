"""--stream-interval: a streamed request's output goes out once that many tokens are unsent (its
first token and its end at once), with the same tokens as one output an iteration, target-only
and under speculation, with the overlap scheduler and without; a request that is not streamed
sends its output every NON_STREAM_INTERVAL tokens at most often."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from random_llama import head_dir, model_dir  # noqa: F401  (the fixtures)

from eagleserve.core import Req, SamplingParams
from eagleserve.messages import GenerateReqInput, TokenOutput
from eagleserve.scheduler import output_processor
from eagleserve.scheduler.output_processor import NON_STREAM_INTERVAL, output_due
from eagleserve.scheduler.scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("torch_threads")


def outputs_by_request(
    sched: Scheduler, prompts: list[list[int]], lengths: list[int], stream: list[bool]
) -> dict:
    for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
        params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        sched.add_request(GenerateReqInput(f"r{i}", prompt, params, stream=stream[i]))
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
        runs[k] = outputs_by_request(sched, prompts, lengths, [True] * len(prompts))
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


@pytest.mark.parametrize("stream_interval", [1, NON_STREAM_INTERVAL + 14])
def test_a_request_not_streamed_gets_few_outputs(
    model_dir: str,  # noqa: F811
    make_scheduler: Callable[..., Scheduler],
    stream_interval: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Beside a streamed request, one that is not streamed sends its first token at once, then
    at most one output per max(stream_interval, NON_STREAM_INTERVAL) tokens: the same tokens
    in far fewer messages for the server to take in."""
    monkeypatch.setattr(output_processor, "NON_STREAM_MAX_WAIT_S", 1e9)  # a slow machine's
    rng = random.Random()
    prompts = [torch.randint(1, 63, (rng.randint(3, 12),)).tolist() for _ in range(2)]
    n = rng.randint(2 * NON_STREAM_INTERVAL + 30, 3 * NON_STREAM_INTERVAL)
    sched = make_scheduler(model_dir, max_total_tokens=1024, max_running_requests=8,
                           stream_interval=stream_interval)  # fmt: skip
    outs = outputs_by_request(sched, prompts, [n, n], [True, False])
    streamed, whole = outs["r0"], outs["r1"]
    # The engine's count (its stats log's generation throughput) has every token, sent or not.
    assert sched.stats().generation_tokens_total == 2 * n
    interval = max(stream_interval, NON_STREAM_INTERVAL)
    assert sum(len(o.new_token_ids) for o in whole) == n and whole[-1].finished
    assert len(whole[0].new_token_ids) == 1  # the first token at once
    assert all(len(o.new_token_ids) == interval for o in whole[1:-1])
    assert len(whole) == 2 + (n - 1) // interval - ((n - 1) % interval == 0)
    assert len(streamed) == 1 + -(-(n - 1) // stream_interval)
    # The same tokens as when both are streamed.
    both = outputs_by_request(
        make_scheduler(model_dir, max_total_tokens=1024, max_running_requests=8),
        prompts, [n, n], [True, True],
    )  # fmt: skip
    for rid, got in (("r0", streamed), ("r1", whole)):
        assert [t for o in got for t in o.new_token_ids] == [
            t for o in both[rid] for t in o.new_token_ids
        ]


def test_a_request_not_streamed_sends_what_waited_a_second() -> None:
    """Tokens of a request that is not streamed wait for NON_STREAM_INTERVAL of them or
    NON_STREAM_MAX_WAIT_S since its last output (/health_generate reads tokens sent in the last
    5 s as the engine's proof of work); a stream's wait for `stream_interval` has no clock."""
    rng = random.Random()
    wait = output_processor.NON_STREAM_MAX_WAIT_S
    for _ in range(100):
        interval = rng.randint(1, 8)
        req = Req("r", [1, 2, 3], SamplingParams(), stream=rng.random() < 0.5)
        req.output_ids = [
            rng.randrange(100) for _ in range(rng.randint(1, 3 * NON_STREAM_INTERVAL))
        ]
        sent_at = rng.uniform(0, 100)
        req.num_sent_tokens = rng.randint(1, len(req.output_ids))
        req.output_sent_time = sent_at
        unsent = len(req.output_ids) - req.num_sent_tokens
        soon, late = sent_at + rng.uniform(0, 0.99) * wait, sent_at + rng.uniform(1, 10) * wait
        if req.stream:
            assert (
                output_due(req, interval, soon)
                == output_due(req, interval, late)
                == (unsent >= interval)
            )
        else:
            bound = max(interval, NON_STREAM_INTERVAL)
            assert output_due(req, interval, soon) == (unsent >= bound)
            assert output_due(req, interval, late) == (unsent > 0)
        req.num_sent_tokens = 0  # the first token goes at once
        assert output_due(req, interval, soon)

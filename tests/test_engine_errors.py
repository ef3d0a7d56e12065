"""The offline `Engine` rejects an invalid request with a ValueError naming the parameter (the
same check the HTTP server answers with a 400), alone or in a batch, and keeps serving after it.
Every engine is checked after each test for leaked KV / request slots (conftest
`check_pools_free`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import random_prompts
from engine_fixtures import greedy, sampled, tiny_engine_fixture, tiny_fixture  # noqa: F401

from eagleserve import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("torch_threads")

# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_len", "params", "message"),
    [
        (300, greedy(4), "maximum context length"),
        (100, greedy(200), "maximum context length"),
        (0, greedy(4), "empty"),
        (10, greedy(-1), "max_tokens"),  # 0 is valid: the prompt is prefilled (scored) only
        (10, SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (10, SamplingParams(frequency_penalty=-3), "frequency_penalty"),
        (10, SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (10, SamplingParams(max_new_tokens=4, min_tokens=5), "min_tokens"),
        (10, SamplingParams(logit_bias={256: 1.0}), "logit_bias"),  # the tiny vocab is 256
        (10, SamplingParams(logit_bias={5: -101.0}), "logit_bias"),
        (10, SamplingParams(temperature=-0.5), "temperature"),
        (10, SamplingParams(top_p=0.0), "top_p"),
        (10, SamplingParams(top_p=1.5), "top_p"),
        (10, SamplingParams(top_k=0), "top_k"),
        (10, SamplingParams(top_k=-3), "top_k"),
        (10, SamplingParams(min_p=1.5), "min_p"),
        (10, SamplingParams(logprobs=99), "logprobs"),
        (10, SamplingParams(seed=2**64 - 1), "seed"),
        (10, SamplingParams(seed=2**70), "seed"),
        (10, SamplingParams(seed=-1), "seed"),
    ],
)
def test_bad_requests_raise_and_engine_keeps_working(
    tiny_model_dir: str,
    make_engine: Callable[..., Engine],
    prompt_len: int,
    params: SamplingParams,
    message: str,
) -> None:
    engine = make_engine(tiny_model_dir, max_running_requests=4, max_total_tokens=256)
    assert engine.scheduler.max_context_len == 256
    good = random_prompts(2, [6, 13], seed=11)
    before = [o["token_ids"] for o in engine.generate(good, greedy(12, ignore_eos=True))]
    bad = random_prompts(1, [prompt_len], seed=12)[0] if prompt_len else []
    with pytest.raises(ValueError, match=message):
        engine.generate([bad], params)
    after = [o["token_ids"] for o in engine.generate(good, greedy(12, ignore_eos=True))]
    assert after == before


def test_largest_seed_samples(tiny: Engine) -> None:
    """The top of the seed range reaches the sampling noise without overflowing, reproducibly."""
    prompt = random_prompts(1, [7], seed=int(torch.randint(0, 2**31, ()).item()))
    runs = [tiny.generate(prompt, sampled(8, seed=2**63 - 1))[0]["token_ids"] for _ in range(2)]
    assert len(runs[0]) == 8 and runs[0] == runs[1]


def test_out_of_vocab_token_raises(tiny: Engine) -> None:
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\)"):
        tiny.generate([[5, 6, 256]], greedy(4))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\)"):
        tiny.generate([[5, -1, 7]], greedy(4))


def test_bad_request_in_a_batch_leaves_engine_usable(
    tiny_model_dir: str, make_engine: Callable[..., Engine]
) -> None:
    """One invalid request among valid ones: ValueError, and afterwards the engine is clean."""
    tiny = make_engine(tiny_model_dir, max_running_requests=4, max_total_tokens=256)
    good = random_prompts(2, [6, 13], seed=13)
    want = [o["token_ids"] for o in tiny.generate(good, greedy(12, ignore_eos=True))]
    with pytest.raises(ValueError, match="top_p"):
        tiny.generate([good[0], good[1]], [greedy(12, ignore_eos=True), SamplingParams(top_p=2)])
    got = [o["token_ids"] for o in tiny.generate(good, greedy(12, ignore_eos=True))]
    assert got == want


def test_server_and_engine_share_one_request_validation() -> None:
    """The checks the HTTP server answers as 400s are the ones the scheduler runs (core.py)."""
    from eagleserve.sampling_params import check_request

    ok = SamplingParams(max_new_tokens=8)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (int(torch.randint(1, 20, (1,), generator=gen)),), generator=gen)
    prompt = ids.tolist()
    assert check_request(prompt, ok, 64, 50) is None
    assert check_request([], ok, 64, 50).message == "the prompt is empty"
    too_long = check_request(prompt, SamplingParams(max_new_tokens=64), 64, 50)
    assert too_long.param == "max_tokens" and too_long.code == "context_length_exceeded"
    assert check_request(prompt + [50], ok, 64, 50).message == "token ids must be in [0, 50)"
    assert check_request(prompt, SamplingParams(seed=-1), 64, 50).message.startswith("seed")

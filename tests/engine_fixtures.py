"""The shared tiny-model `Engine` of tests/test_engine*.py and the SamplingParams they build."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import track

from eagleserve import Engine, SamplingParams


@pytest.fixture(scope="module", name="_tiny_engine")
def tiny_engine_fixture(tiny_model_dir: str) -> Iterator[Engine]:
    yield Engine(
        model=tiny_model_dir,
        device="cpu",
        dtype="float32",
        max_running_requests=16,
        max_total_tokens=2048,
    )


@pytest.fixture(name="tiny")
def tiny_fixture(_tiny_engine: Engine) -> Engine:
    """A shared tiny-model engine (overlap on), pool-checked after each test that uses it."""
    return track(_tiny_engine)  # type: ignore[return-value]


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)  # type: ignore[arg-type]


def sampled(n: int, seed: int | None, **kw: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=1.0, seed=seed, ignore_eos=True, **kw)  # type: ignore[arg-type]

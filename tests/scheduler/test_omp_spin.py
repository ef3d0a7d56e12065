"""The OpenMP spin-wait settings a CPU overlap engine process is born with."""

from __future__ import annotations

import multiprocessing as mp
import os
import random

import pytest

from eagleserve.scheduler.omp_spin import OVERLAP_SPIN_ENV, overlap_spin_env, process_env


@pytest.fixture
def no_spin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OVERLAP_SPIN_ENV:
        monkeypatch.delenv(name, raising=False)


def test_only_a_cpu_with_overlap_gets_the_spin_settings(no_spin_env: None) -> None:
    assert overlap_spin_env("cpu", overlap=True) == OVERLAP_SPIN_ENV
    assert overlap_spin_env("cpu", overlap=False) == {}
    assert overlap_spin_env("cuda", overlap=True) == {}


@pytest.mark.parametrize("name", sorted(OVERLAP_SPIN_ENV))
def test_the_users_own_setting_wins(
    no_spin_env: None, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setenv(name, "PASSIVE" if name == "OMP_WAIT_POLICY" else "0")
    assert overlap_spin_env("cpu", overlap=True) == {}


def _report_env(names: list[str], queue: mp.Queue) -> None:
    queue.put({name: os.environ.get(name) for name in names})


def test_a_child_started_inside_sees_the_env_and_the_parent_is_restored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tag = f"{random.randrange(10**9)}"
    absent, present = f"EAGLESERVE_TEST_ABSENT_{tag}", f"EAGLESERVE_TEST_PRESENT_{tag}"
    monkeypatch.setenv(present, "before")
    env = {absent: f"a{tag}", present: f"p{tag}"}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with process_env(env):
        child = ctx.Process(target=_report_env, args=([absent, present], queue))
        child.start()
    seen = queue.get(timeout=60)
    child.join(60)
    assert seen == env
    assert absent not in os.environ
    assert os.environ[present] == "before"

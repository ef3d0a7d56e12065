"""The OpenMP spin-wait settings a CPU overlap engine process is born with."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random

import pytest

from eagleserve.config import ServerArgs
from eagleserve.scheduler.omp_spin import (
    OVERLAP_SPIN_ENV,
    overlap_spin_env,
    process_env,
    use_overlap_spin,
)
from eagleserve.server.engine_client import EngineClient


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


def test_a_script_sets_them_for_itself_unless_the_user_did(
    no_spin_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_overlap_spin()
    assert {name: os.environ[name] for name in OVERLAP_SPIN_ENV} == OVERLAP_SPIN_ENV
    for name in OVERLAP_SPIN_ENV:
        monkeypatch.delenv(name)
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    use_overlap_spin()
    assert os.environ["GOMP_SPINCOUNT"] == "0" and "OMP_WAIT_POLICY" not in os.environ


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


def _environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.decode().partition("=") for item in f.read().split(b"\0") if item]
    return {name: value for name, _, value in pairs}


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads /proc (Linux)")
@pytest.mark.parametrize("overlap", [True, False])
def test_the_cpu_engine_process_is_born_with_them_only_for_overlap(
    no_spin_env: None, tiny_model_dir: str, overlap: bool
) -> None:
    """The server's engine process (EngineClient.start) on a CPU: with overlap its environment
    holds the settings though the server's has neither; without, it holds none."""
    args = ServerArgs(
        model=tiny_model_dir,
        device="cpu",
        max_total_tokens=256,
        max_running_requests=2,
        disable_overlap_schedule=not overlap,
    )
    client = EngineClient(args)

    async def start_read_stop() -> dict[str, str]:
        await client.start()
        try:
            return _environ_of(client._proc.pid)
        finally:
            await client.shutdown()

    env = asyncio.run(start_read_stop())
    seen = {name: env.get(name) for name in OVERLAP_SPIN_ENV}
    assert seen == (OVERLAP_SPIN_ENV if overlap else dict.fromkeys(OVERLAP_SPIN_ENV))
    assert not any(name in os.environ for name in OVERLAP_SPIN_ENV)

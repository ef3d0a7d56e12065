"""libgomp's spin-wait, for a CPU engine with the overlap scheduler.

After a parallel region an OpenMP worker spins GOMP_SPINCOUNT times (libgomp's default is
300,000) before it sleeps on a futex. Once the process holds more OpenMP threads than CPUs,
libgomp cuts that spin to 1,000, unless OMP_WAIT_POLICY is ACTIVE. A thread's team stays in
libgomp's pool, and in its count, for as long as the thread lives. The overlap scheduler on a CPU
holds two teams: the scheduler thread's, from start-up, and the forward thread's. On N cores that
makes 2N - 1 threads, so the cut applies. Every one of a forward's many parallel regions then
wakes its workers from the futex, and a decode takes about twice as long (bench/overlap_cpu.py).
ACTIVE with the default count restores the default spin. Without overlap there is one team and
nothing changes.

libgomp reads both variables once, when it loads. An engine process must therefore be born with
them (`process_env` around its start); an in-process Engine has them only when they were set
before torch was imported. This module imports no torch, so a script can set them first.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

OVERLAP_SPIN_ENV = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}


def user_set_spin() -> bool:
    """Whether this process's environment names either variable (then the user's values hold)."""
    return any(name in os.environ for name in OVERLAP_SPIN_ENV)


def use_overlap_spin() -> None:
    """Sets OVERLAP_SPIN_ENV in this process's environment unless the user set either variable:
    for a script that runs overlap engines in-process, before it imports torch."""
    if not user_set_spin():
        os.environ.update(OVERLAP_SPIN_ENV)


def overlap_spin_env(device_type: str, overlap: bool) -> dict[str, str]:
    """What an engine process on `device_type` should start with: OVERLAP_SPIN_ENV for a CPU
    with the overlap scheduler, unless the user set either variable; otherwise nothing."""
    if device_type != "cpu" or not overlap or user_set_spin():
        return {}
    return dict(OVERLAP_SPIN_ENV)


@contextmanager
def process_env(env: dict[str, str]) -> Iterator[None]:
    """`os.environ` with `env` added while child processes start (each copies it then), and as
    it was again afterwards: this process's own libgomp read its settings long ago."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

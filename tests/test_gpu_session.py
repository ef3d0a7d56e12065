"""bench/gpu_session.py: what a GPU session sends in pieces arrives whole, a lost piece is
refused, a job's output comes back even when the job is stopped at its limit, and a later job
finds eagleserve's cache where an earlier one left it."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

from bench import gpu_session


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_session, "STAGE_DIR", str(tmp_path / "stage"))
    monkeypatch.setattr(gpu_session, "DEVICE_DIR", str(tmp_path / "device"))
    monkeypatch.setenv("OUT", str(tmp_path / "returned"))
    os.makedirs(tmp_path / "stage")
    return tmp_path


def _receive(folder: str, job: list[str] | None = None, timeout_s: float = 60.0) -> int:
    args = argparse.Namespace(folder=folder, job=job or [], timeout_s=timeout_s)
    return gpu_session.receive(args)


def test_pieces_join_into_the_files_sent(dirs):
    payload = os.urandom(300_000)
    (dirs / "model.gguf").write_bytes(payload)
    folders = gpu_session.split_payload("base", {"model.gguf": str(dirs / "model.gguf")}, 70_000)
    assert len(folders) > 3
    root = gpu_session.ROOT
    for folder in folders:
        assert _receive(os.path.join(root, folder)) == 0
    assert (dirs / "device" / "model.gguf").read_bytes() == payload


def test_a_piece_after_a_lost_one_is_refused(dirs):
    (dirs / "data.bin").write_bytes(os.urandom(50_000))
    folders = gpu_session.split_payload("data", {"data/x.bin": str(dirs / "data.bin")}, 20_000)
    root = gpu_session.ROOT
    assert _receive(os.path.join(root, folders[0])) == 0
    # the machine was given back between calls: its /tmp is gone
    for name in os.listdir(dirs / "device"):
        os.remove(dirs / "device" / name)
    assert _receive(os.path.join(root, folders[1])) == 2
    assert not (dirs / "device" / "data").exists()


def test_a_stopped_job_still_returns_its_output(dirs, tmp_path):
    script = (
        "import sys, time; open(sys.argv[1] + '/partial.txt', 'w').write('kept');"
        "print('started', flush=True); time.sleep(60)"
    )
    rc = gpu_session.run_job([sys.executable, "-c", script, "{out}"], timeout_s=3.0)
    assert rc == 124
    dest = tmp_path / "here"
    gpu_session.unpack(argparse.Namespace(files_at=str(dirs / "returned"), dest=str(dest)))
    assert (dest / "out" / "partial.txt").read_text() == "kept"
    assert "started" in (dest / "out" / "job.log").read_text()


def test_a_later_job_reuses_the_cache_an_earlier_one_built(dirs, monkeypatch):
    """Jobs of one warm machine share eagleserve's cache under DEVICE_DIR (what the machine
    keeps between calls), not the home folder: the GGUF is converted once a session."""
    monkeypatch.delenv("EAGLESERVE_CACHE", raising=False)
    token = os.urandom(8).hex()
    write = ("import os, sys; d = os.environ['EAGLESERVE_CACHE']; os.makedirs(d, exist_ok=True);"
             f"open(os.path.join(d, 'converted'), 'w').write('{token}')")  # fmt: skip
    assert gpu_session.run_job([sys.executable, "-c", write], timeout_s=30.0) == 0
    read = ("import os; d = os.environ['EAGLESERVE_CACHE'];"
            "print('found', open(os.path.join(d, 'converted')).read())")  # fmt: skip
    assert gpu_session.run_job([sys.executable, "-c", read], timeout_s=30.0) == 0
    log = (dirs / "device" / "out" / "job.log").read_text()
    assert f"found {token}" in log
    assert (dirs / "device" / "cache" / "converted").read_text() == token

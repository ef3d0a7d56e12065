"""An engine process that cannot start reports why and then exits by itself (the server waits
for it before reporting the failure: an engine that hung on its way out cost every failed start
the server's whole join timeout)."""

from __future__ import annotations

import multiprocessing
import pathlib
import secrets

import zmq

from eagleserve.config import ServerArgs
from eagleserve.messages import EngineStartupError
from eagleserve.scheduler.engine_loop import run_engine


def test_a_failed_start_reports_then_exits_nonzero(tmp_path: pathlib.Path) -> None:
    model = tmp_path / f"broken-{secrets.token_hex(4)}"
    model.mkdir()
    (model / "config.json").write_text("{}")  # passes the path check, fails to load
    ctx = zmq.Context()
    to_engine, from_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    in_addr, out_addr = (f"ipc://{tmp_path}/{name}" for name in ("in", "out"))
    to_engine.bind(in_addr)
    from_engine.bind(out_addr)
    args = ServerArgs(model=str(model), device="cpu")
    proc = multiprocessing.get_context("spawn").Process(
        target=run_engine, args=(args, in_addr, out_addr), daemon=True
    )
    proc.start()
    try:
        assert from_engine.poll(120_000), "the engine reported nothing"
        msg = from_engine.recv_pyobj()
        assert isinstance(msg, EngineStartupError) and "num_attention_heads" in msg.message
        proc.join(30)  # it is exiting already: a hang here is the defect
        assert proc.exitcode == 1
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        to_engine.close(linger=0)
        from_engine.close(linger=0)
        ctx.term()

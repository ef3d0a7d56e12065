"""Helpers of the tensor-parallel tests: a group of gloo ranks on this machine, each running a
function, and the forwards whose logits the tests compare (rank 0's come back)."""

from __future__ import annotations

import io
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as tmp

from eagleserve.config import ModelConfig
from eagleserve.distributed.parallel import destroy_tensor_parallel, init_tensor_parallel
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.models.llama import ModelOutput

CPU = torch.device("cpu")
RANK_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, size: int, port: int, fn: Callable[[], Any], out: Any) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    init_tensor_parallel(rank, size, port, CPU)
    try:
        result = fn()
    finally:
        destroy_tensor_parallel()
    if rank == 0:  # as bytes: a shared tensor would need this process alive to be read
        buf = io.BytesIO()
        torch.save(result, buf)
        out.put(buf.getvalue())


def run_ranks(size: int, fn: Callable[[], Any]) -> Any:
    """`fn()` on `size` gloo ranks at once (fresh processes); rank 0's result."""
    ctx = tmp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, size, port, fn, out), daemon=True)
        for r in range(size)
    ]
    for p in procs:
        p.start()
    try:  # read first: rank 0 cannot exit before its result has left the pipe
        result = torch.load(io.BytesIO(out.get(timeout=RANK_TIMEOUT_S)))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    codes = [p.exitcode for p in procs]
    assert codes == [0] * size, f"rank exit codes {codes}"
    return result


def make_runner(model_dir: str, gguf_path: str | None = None) -> ModelRunner:
    return ModelRunner(
        ModelConfig.from_dir(model_dir), model_dir, CPU, torch.float32, 512, 2, 512,
        gguf_path=gguf_path,
    )  # fmt: skip


def prefill_then_decode(runner: ModelRunner, prompt: list[int], next_token: int) -> torch.Tensor:
    """Logits of every prompt position, then of one decode step reading the cached KV:
    [len(prompt) + 1, vocab]."""
    from conftest import forward_tokens

    n = len(prompt)
    row = runner.req_to_token_pool.alloc()
    loc = runner.token_to_kv_pool.alloc(n + 1)
    assert row is not None and loc is not None
    runner.req_to_token_pool.req_to_token[row, : n + 1] = loc
    rows = torch.tensor([row])
    out: ModelOutput = forward_tokens(
        runner, "extend", torch.tensor(prompt), torch.arange(n), loc[:n], rows,
        torch.tensor([0]), torch.tensor([n]),
    )  # fmt: skip
    step = forward_tokens(
        runner, "decode", torch.tensor([next_token]), torch.tensor([n]), loc[n:], rows,
        torch.tensor([n]), torch.tensor([1]),
    )  # fmt: skip
    return torch.cat([out.logits, step.logits])


def logits_of(cases: list[tuple[str, str | None, list[int], int]]) -> list[torch.Tensor]:
    """prefill_then_decode logits of each (model dir, gguf, prompt, next token), in this
    process's tensor-parallel group (size 1 when none)."""
    return [prefill_then_decode(make_runner(d, g), p, t) for d, g, p, t in cases]


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

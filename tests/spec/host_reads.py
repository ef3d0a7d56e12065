"""The no-host-read guard: `HostReadError`, `no_host_reads()` (a forward that reads a device
value on the host, by `.item()`-like reads or `Tensor.tolist`, raises it) and `guarded`; and
`head_dir`, the random EAGLE3 head on the tiny model whose engines the guard watches.
test_no_host_sync.py's, shared with test_decode_work.py and graph_standin.py."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eagleserve.config import ModelConfig
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.spec.head_loader import init_eagle_head, save_eagle_head


class HostReadError(AssertionError):
    pass


class _NoScalarReads(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            raise HostReadError("a forward read a device value on the host")
        return func(*args, **(kwargs or {}))


_guard = threading.local()  # per thread: the overlap scheduler reads results on another one


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    tolist = torch.Tensor.tolist

    def refuse(self: torch.Tensor) -> Any:
        if getattr(_guard, "active", False):
            raise HostReadError("a forward called Tensor.tolist")
        return tolist(self)

    torch.Tensor.tolist = refuse  # type: ignore[method-assign]
    _guard.active = True
    try:
        with _NoScalarReads():
            yield
    finally:
        _guard.active = False
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with no_host_reads():
            return fn(*args, **kwargs)

    return run


@pytest.fixture(scope="module")
def head_dir(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    runner = ModelRunner(
        ModelConfig.from_dir(tiny_model_dir), tiny_model_dir, torch.device("cpu"),
        torch.float32, 64, 1, 512,
    )  # fmt: skip
    head = init_eagle_head("EAGLE3", runner.model, draft_vocab_size=64, seed=3)
    out = str(tmp_path_factory.mktemp("head"))
    save_eagle_head(head, out)
    return out

"""No forward reads a device value on the host: lengths flow down from the scheduler.

On an accelerator such a read (`.item()`, `.tolist()`, `int(t)`, `bool(t)`) waits for the device
and stalls the overlap scheduler every step. On the CPU the same reads are visible as
`aten._local_scalar_dense` calls and `Tensor.tolist`, so a dispatch mode around every target
forward, head extend and draft step catches them while real requests run.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eagleserve import Engine, SamplingParams
from eagleserve.config import ModelConfig
from eagleserve.model.runner import ModelRunner
from eagleserve.spec.draft_worker import EagleDraftWorker
from eagleserve.spec.head_loader import init_eagle_head, save_eagle_head

pytestmark = pytest.mark.usefixtures("torch_threads")


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


def test_the_guard_catches_host_reads() -> None:
    lens = torch.tensor([3, 5])
    for read in (lambda: int(lens.max()), lambda: lens.tolist(), lambda: bool((lens > 1).all())):
        with pytest.raises(HostReadError), no_host_reads():
            read()


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


@pytest.mark.parametrize(
    "spec",
    [
        {},
        dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4),
        dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=5),
    ],
    ids=["target", "chain", "tree"],
)
@pytest.mark.parametrize("overlap", [False, True])
def test_forwards_read_no_device_values(
    tiny_model_dir: str,
    head_dir: str,
    make_engine: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
    spec: dict[str, Any],
    overlap: bool,
) -> None:
    if spec:
        spec = dict(spec, speculative_algorithm="EAGLE3", speculative_draft_model_path=head_dir)
    engine = make_engine(
        tiny_model_dir, max_running_requests=4, disable_overlap_schedule=not overlap, **spec
    )
    monkeypatch.setattr(ModelRunner, "forward", guarded(ModelRunner.forward))
    monkeypatch.setattr(EagleDraftWorker, "extend", guarded(EagleDraftWorker.extend))
    monkeypatch.setattr(EagleDraftWorker, "_step", guarded(EagleDraftWorker._step))
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 256, (int(n),), generator=gen).tolist() for n in (5, 17, 9)]
    params = [SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)] * 3
    out = engine.generate(prompts, params)
    assert [len(o["token_ids"]) for o in out] == [12, 12, 12]

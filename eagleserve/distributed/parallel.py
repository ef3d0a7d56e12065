"""Tensor-parallel process state: this process's rank in its group, and the collectives the
model and the workers call.

One group per process, set once at start-up (`init_tensor_parallel`); until then the size is 1
and every collective returns its input untouched, so single-process code pays nothing.

Two process groups, because two threads issue collectives: with the overlap scheduler the
forward runs on a worker thread (the device group: NCCL on CUDA and ROCm, gloo on CPU) while the
scheduler thread replicates scheduler calls (the control group, always gloo: host objects).
Collectives on one group must be issued in the same order on every rank; each group is only
ever used from one thread, which keeps that order.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Idle followers wait in a control broadcast until the next request: the wait must not time
# out. A dead peer is noticed at once anyway (its sockets close).
GROUP_TIMEOUT = datetime.timedelta(days=7)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    device_group: Any = None  # tensors on the model's device
    control_group: Any = None  # gloo: pickled host objects

    @property
    def enabled(self) -> bool:
        return self.size > 1


_STATE = TensorParallel()


def get_tp() -> TensorParallel:
    return _STATE


def dist_backend(device: torch.device) -> str:
    """NCCL on CUDA (RCCL answers to "nccl" on ROCm builds of torch), gloo on CPU."""
    return "gloo" if device.type == "cpu" else "nccl"


def check_backend(device: torch.device) -> None:
    """Raises with one line when this build of torch cannot run tensor parallelism here."""
    if not dist.is_available():
        raise RuntimeError("--tp-size > 1 needs torch.distributed, missing from this torch build")
    backend = dist_backend(device)
    available = dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available()
    if not available:
        raise RuntimeError(f"--tp-size > 1 on {device.type} needs the {backend} backend of "
                           "torch.distributed, missing from this torch build")  # fmt: skip


def init_tensor_parallel(
    rank: int, size: int, port: int, device: torch.device, store: dist.Store | None = None
) -> TensorParallel:
    """Joins the group of `size` ranks rendezvousing on 127.0.0.1:`port` (a TCP store, as
    torchrun's static rendezvous; or `store`, already connected) and makes it this process's
    tensor-parallel group."""
    global _STATE
    check_backend(device)
    if device.type != "cpu":
        torch.get_device_module(device).set_device(device)
    dist.init_process_group(
        dist_backend(device),
        init_method=None if store is not None else f"tcp://127.0.0.1:{port}",
        store=store,
        rank=rank,
        world_size=size,
        timeout=GROUP_TIMEOUT,
    )
    control = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
    _STATE = TensorParallel(rank, size, dist.group.WORLD, control)
    return _STATE


def destroy_tensor_parallel() -> None:
    global _STATE
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE = TensorParallel()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of `x` (row-parallel partial sums), in place. Every rank gets the
    same bits: NCCL and gloo reduce each element once and distribute that result."""
    tp = _STATE
    if tp.enabled:
        dist.all_reduce(x, group=tp.device_group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., n] per rank -> [..., size * n], rank r's slice at [r*n, (r+1)*n)."""
    tp = _STATE
    if not tp.enabled:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.device_group)
    return torch.cat(parts, dim=-1)


def broadcast_from_first(*tensors: torch.Tensor) -> None:
    """Overwrites `tensors` on every rank with rank 0's, in place: decisions (sampled and
    accepted tokens) are made once, so every rank commits the same ones."""
    tp = _STATE
    if not tp.enabled:
        return
    for t in tensors:
        dist.broadcast(t, src=0, group=tp.device_group)


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (pickled over the control group)."""
    tp = _STATE
    if not tp.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=tp.control_group)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (control group)."""
    tp = _STATE
    if not tp.enabled:
        return [obj]
    out: list[Any] = [None] * tp.size
    dist.all_gather_object(out, obj, group=tp.control_group)
    return out

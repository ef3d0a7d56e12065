"""The one module that talks to a device runtime (CUDA, ROCm/HIP or CPU) by name.

Everything else asks here, so the same code runs on CUDA and HIP builds of torch and on CPU.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        if torch.accelerator.is_available():
            return torch.accelerator.current_accelerator()
        return torch.device("cpu")
    dev = torch.device(name)
    if dev.type != "cpu" and not torch.accelerator.is_available():
        raise RuntimeError(f"--device {name} was asked for, but no accelerator is available")
    return dev


def device_module(device: torch.device) -> Any:
    """torch.cuda for CUDA and HIP builds, torch.cpu for CPU."""
    return torch.get_device_module(device)


def device_name(device: torch.device) -> str:
    """The accelerator's product name, or the CPU's model name and logical core count."""
    if device.type != "cpu":
        return str(device_module(device).get_device_name(device))
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    return f"{model or 'cpu'} x{os.cpu_count()}"


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        device_module(device).synchronize()


def empty_cache(device: torch.device) -> None:
    """Hands an accelerator's cached free blocks back to the device (nothing on a CPU)."""
    if device.type != "cpu":
        device_module(device).empty_cache()


def host_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` on `device`, queued without waiting for the work queued there: from
    pageable memory a copy waits for its stream to drain (on the overlap scheduler's forward
    thread, the previous batch's forward; in training, the previous step); from pinned memory
    it is queued behind that work."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def tensor_to(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` without its wait: made on an
    accelerator, that tensor is a synchronous copy (the host waits for everything queued on
    the stream); this one is `host_to`'s pinned copy, queued behind that work."""
    return host_to(torch.tensor(values, dtype=dtype), device)

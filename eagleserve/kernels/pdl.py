"""Programmatic dependent launch (PDL; NVIDIA Hopper and later) of the Triton kernels.

A kernel launched with PDL may start while the kernel before it on the stream still runs. Each
of ours begins with `wait_previous` (kernels/triton_common.py): it lets the next kernel launch too
(`griddepcontrol.launch_dependents`), then waits until the previous kernel has completed and its
writes are visible (`griddepcontrol.wait`), before it reads or writes global memory that a
kernel writes (a GEMV kernel whose K is one tile loads its weight tile first: no kernel writes
a weight, and that load then overlaps the previous kernel too). What
overlaps is a kernel's launch and scheduling with the tail of the one before: the gaps between
the many small kernels of a small-batch decode, inside a device graph too (CUDA 12.3 and later
capture the programmatic edges). Only kernels that wait are launched with PDL, so none starts
early without waiting, and completion stays transitive: a kernel that completed implies every
kernel before it did. A kernel that follows one of cuBLAS's or torch's starts after it
completes, as without PDL.

Off unless the server asks for it (`--enable-pdl`) on a device that supports it; launches read
the switch when they are made (a captured graph keeps what its capture saw). The Triton
interpreter never runs it. (This module imports no Triton: the server sets the switch before
any kernel module is imported, and the interpreter must be chosen before a kernel is defined.)
"""

from __future__ import annotations

import logging
import os

import torch

from eagleserve.device import device_module

logger = logging.getLogger(__name__)

_enabled = False


def supported(device: torch.device) -> bool:
    """An NVIDIA GPU of compute capability 9.0 or later, compiled for (not interpreted)."""
    return (
        device.type == "cuda"
        and torch.version.hip is None
        and os.environ.get("TRITON_INTERPRET") != "1"
        and device_module(device).get_device_capability(device)[0] >= 9
    )


def configure(requested: bool, device: torch.device) -> bool:
    """PDL for the launches made from now on, where requested and `device` supports it;
    whether it is on."""
    global _enabled
    _enabled = requested and supported(device)
    if requested and not _enabled:
        logger.warning("--enable-pdl: %s cannot launch kernels with programmatic dependencies "
                       "(an NVIDIA GPU of compute capability 9.0 or later can); launching "
                       "without them", device)  # fmt: skip
    return _enabled


def launch_options(device: torch.device) -> dict[str, bool]:
    """The keywords of a launch of a kernel that takes `PDL: tl.constexpr` and begins with
    `wait_previous(PDL)`."""
    on = _enabled and device.type == "cuda"
    return {"PDL": on, "launch_pdl": on}

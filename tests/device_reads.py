"""Which dispatched ops make the host wait for the device on an accelerator: a host read of a
device value, or an op whose output shape depends on values (nonzero, masked_select, boolean
indexing, repeat_interleave by a tensor of counts without its output size). Shared by the
tests that refuse such reads and those that count them."""

from __future__ import annotations

from typing import Any

import torch

_INDEX_OPS = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default)
_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
          torch.ops.aten.masked_select.default)  # fmt: skip
# repeat_interleave by a tensor of counts (`.Tensor` where autograd decomposes the call,
# `.self_Tensor` under inference mode).
_REPEAT_BY_TENSOR = (torch.ops.aten.repeat_interleave.Tensor,
                     torch.ops.aten.repeat_interleave.self_Tensor)  # fmt: skip


def device_read(func: Any, args: Any, kwargs: Any = None) -> str | None:
    """What `func(*args, **kwargs)` reads from the device, or None where it reads nothing."""
    if func in _READS:
        return f"{func} reads a device value on the host"
    if func in _INDEX_OPS and any(t is not None and t.dtype == torch.bool for t in args[1]):
        return f"{func} with a boolean mask: its shape depends on values"
    if func in _REPEAT_BY_TENSOR and (kwargs or {}).get("output_size") is None:
        return f"{func} without output_size: its shape is the sum of the counts"
    return None

"""The Triton attention kernels called as attention_refs.py's references are: every tensor
moved to DEVICE and the result back to the CPU (on a GPU host the kernels run for real), and
the per-forward index tensors the backend builds (each request's first query row, its KV
length) built here from prefix and extend lengths."""

from __future__ import annotations

from typing import Any

import torch
from triton_mode import DEVICE  # before triton is imported: picks the interpreter without a GPU

from eagleserve.kernels import triton_attention as _tri


class _OnDevice:
    """The kernels' module with every tensor argument moved to DEVICE and tensor results back
    to the CPU, where the references run."""

    def __getattr__(self, name: str) -> Any:
        fn = getattr(_tri, name)

        def call(*args: Any) -> Any:
            moved = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
            out = fn(*moved)
            return out.cpu() if isinstance(out, torch.Tensor) else out

        return call


tri = _OnDevice()


def extend_attention(*args: Any) -> torch.Tensor:
    """`attention_refs.extend_attention_ref`'s arguments, then max_extend (the grid's bound)."""
    q, k_buffer, v_buffer, req_to_token, rpi, prefix_lens, extend_lens, sm_scale, max_ext = args
    q_start = torch.cumsum(extend_lens, 0) - extend_lens
    return tri.prefill_attention(q, k_buffer, v_buffer, req_to_token, rpi, q_start, extend_lens,
                                 prefix_lens + extend_lens, max_ext, sm_scale)  # fmt: skip


def tree_verify_attention(*args: Any) -> torch.Tensor:
    """`attention_refs.tree_verify_attention_ref`'s arguments (q [bs * n, H, D], tree_mask
    [bs, n, n])."""
    q, k_buffer, v_buffer, req_to_token, rpi, prefix_lens, tree_mask, sm_scale = args
    bs, n = prefix_lens.shape[0], tree_mask.shape[1]
    extend_lens = torch.full_like(prefix_lens, n)
    q_start = torch.arange(bs, dtype=torch.int64) * n
    return tri.prefill_attention(q, k_buffer, v_buffer, req_to_token, rpi, q_start, extend_lens,
                                 prefix_lens + n, n, sm_scale, prefix_lens, tree_mask)  # fmt: skip

"""Paged KV cache: request slots map positions to KV slots; KV slots hold per-layer K/V."""

from __future__ import annotations

import torch

from eagleserve.device import host_to, tensor_to


class ReqToTokenPool:
    """`req_to_token[req_pool_idx, pos]` is the KV slot of position `pos` of that request."""

    def __init__(self, size: int, max_context_len: int, device: torch.device) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self._free: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop(0) if self._free else None

    def free(self, idx: int) -> None:
        assert idx not in self._free, f"request slot {idx} freed twice"
        self._free.append(idx)

    def write_spans(self, spans: list[tuple[int, int, int]], loc: torch.Tensor) -> None:
        """req_to_token[row, start:end] for each (row, start, end) in order = the next slots of
        `loc`, in one write: a slice for one span, else one flat index built on the host and
        copied without waiting (`tensor_to`)."""
        r2t = self.req_to_token
        if len(spans) == 1:
            row, start, end = spans[0]
            r2t[row, start:end] = loc
            return
        width = r2t.shape[1]
        flat = [row * width + col for row, start, end in spans for col in range(start, end)]
        index = tensor_to(flat, torch.long, r2t.device)
        r2t.view(-1)[index] = loc


class TokenToKVPool:
    """K/V buffers indexed by KV slot. Slot 0 is never handed out: padded rows write there."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.size = size
        self.device = device
        self.dtype = dtype
        shape = (size + 1, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # Host-side free list; a slot is either here or owned by exactly one request.
        self._free = torch.arange(1, size + 1, dtype=torch.int64)
        self._num_free = size

    def available_size(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """Returns `n` free slots on the pool's device, or None when fewer are free."""
        if n > self._num_free:
            return None
        out = self._free[self._num_free - n : self._num_free].clone()
        self._num_free -= n
        return host_to(out, self.device)

    def free(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        if n == 0:
            return
        assert self._num_free + n <= self.size, "KV slots freed twice"
        self._free[self._num_free : self._num_free + n] = slots.to("cpu", torch.int64)
        self._num_free += n

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffer[layer][loc] = k.to(self.k_buffer[layer].dtype)
        self.v_buffer[layer][loc] = v.to(self.v_buffer[layer].dtype)

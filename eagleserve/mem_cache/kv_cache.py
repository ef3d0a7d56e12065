"""Paged KV cache: request slots map positions to KV slots; KV slots hold per-layer K/V."""

from __future__ import annotations

import torch

from eagleserve.device import host_to


class ReqToTokenPool:
    """`req_to_token[req_pool_idx, pos]` is the KV slot of position `pos` of that request."""

    def __init__(self, size: int, max_context_len: int, device: torch.device) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        # The host's copy, written with the device rows by `write_spans`, so that building a
        # prefill's slots or freeing a finished request reads no device value (on an
        # accelerator such a read waits for the forward in flight). A tree verify's accepted
        # path reorders a row on the device (spec/accept.py::commit_tree_path) and the
        # scheduler reorders the host's row alike when it reads that verify's result; a row
        # whose request finished before then keeps its slots in the order before, which changes
        # neither the set a release frees nor the committed prefix it caches.
        self.req_to_token_host = torch.zeros((size, max_context_len), dtype=torch.int64)
        self._free: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop(0) if self._free else None

    def free(self, idx: int) -> None:
        assert idx not in self._free, f"request slot {idx} freed twice"
        self._free.append(idx)

    def write_spans(self, spans: list[tuple[int, int, int]], slots: torch.Tensor) -> torch.Tensor:
        """req_to_token[row, start:end] for each (row, start, end) in order = the next of the
        host `slots`, on the host and the device; returns `slots` on the device. One copy to the
        device (without waiting) and one write: a slice for one span, else a flat index built
        on the host and copied with the slots."""
        assert slots.device.type == "cpu", "write_spans takes host slots (alloc_host)"
        r2t, host = self.req_to_token, self.req_to_token_host
        if len(spans) == 1:
            row, start, end = spans[0]
            host[row, start:end] = slots
            loc = host_to(slots, r2t.device)
            r2t[row, start:end] = loc
            return loc
        width = r2t.shape[1]
        flat = [row * width + col for row, start, end in spans for col in range(start, end)]
        index = torch.tensor(flat, dtype=torch.long)
        host.view(-1)[index] = slots
        index_loc = host_to(torch.stack([index, slots]), r2t.device)
        r2t.view(-1)[index_loc[0]] = index_loc[1]
        return index_loc[1]

    def row_slots(self, idx: int, n: int) -> torch.Tensor:
        """The first `n` slots of request slot `idx`, from the host's copy."""
        return self.req_to_token_host[idx, :n].clone()


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

    def alloc_host(self, n: int) -> torch.Tensor | None:
        """Returns `n` free slots on the host, or None when fewer are free."""
        if n > self._num_free:
            return None
        out = self._free[self._num_free - n : self._num_free].clone()
        self._num_free -= n
        return out

    def alloc(self, n: int) -> torch.Tensor | None:
        """Returns `n` free slots on the pool's device, or None when fewer are free."""
        out = self.alloc_host(n)
        return None if out is None else host_to(out, self.device)

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

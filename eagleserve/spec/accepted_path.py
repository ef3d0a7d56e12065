"""A verify's accepted paths: their positions and KV slots, the verify row of each path node,
and the head's extend over them (the draft KV pool catches up with what the target committed).
"""

from __future__ import annotations

import torch

from eagleserve.core import ScheduleBatch
from eagleserve.layers.forward_batch import ForwardBatch, HostLens
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.spec.accept import AcceptResult

PathSlots = tuple[torch.Tensor, torch.Tensor]  # positions, KV slots [bs, width]


class AcceptedPaths:
    def __init__(self, runner: ModelRunner, iota_len: int) -> None:
        self.req_to_token = runner.req_to_token_pool.req_to_token
        self.kv_pool = runner.token_to_kv_pool
        self.attn_backend = runner.attn_backend
        self.device = runner.device
        # The head extend after a verify keeps a fixed shape (`extend`) off the CPU.
        self.fixed_shape = self.device.type != "cpu"
        # 0, 1, 2, ... on the device, sliced by the verify instead of built every iteration.
        self._iota = torch.arange(iota_len, device=self.device)

    def iota(self, n: int) -> torch.Tensor:
        """[0, n) on the device (a view of a tensor built once when long enough)."""
        return self._iota[:n] if n <= self._iota.shape[0] else torch.arange(n, device=self.device)

    def slots(self, L: torch.Tensor, rpi: torch.Tensor, width: int) -> PathSlots:
        """Positions L + j and their KV slots, [bs, width] each."""
        cols = L[:, None] + self.iota(width)
        return cols, self.req_to_token[rpi[:, None], cols]

    def verify_rows(self, acc: AcceptResult, n: int) -> torch.Tensor:
        """[bs, width]: the verify row of each accepted path node (row 0's where none)."""
        bs = acc.accept_index.shape[0]
        return acc.accept_index.clamp(min=0) + (self.iota(bs) * n)[:, None]

    def extend(
        self, batch: ScheduleBatch, acc: AcceptResult, max_len: int, path: PathSlots | None = None
    ) -> tuple[ForwardBatch, torch.Tensor | slice, torch.Tensor | None]:
        """The head extend over each request's accepted path (token after node k with the
        feature of node k): its ForwardBatch, which of the [bs * width] path rows it holds, and
        each request's last row in it. On an accelerator every request keeps all `width` rows
        (a fixed shape: selecting the accepted ones would give a shape that depends on values,
        a device->host sync), as the verify left them: a row past a request's accept length
        still holds its rejected node (token -1, its slot). `mask_path_rows`
        (spec/draft_extend.py) sends those to token 0 and slot 0 (never handed out), inside the
        extend graph or before an eager extend, and finds the last rows (None here). On a CPU,
        where selecting costs no sync, only the accepted rows run. `path`: the positions and
        slots, if known."""
        L, rpi, a = batch.seq_lens, batch.req_pool_indices, acc.accept_lens
        bs, width = acc.accept_index.shape
        cols, slots = path or self.slots(L, rpi, width)
        last_rows: torch.Tensor | None = None
        if self.fixed_shape:
            keep: torch.Tensor | slice = slice(None)
            ids, positions = acc.output_tokens.reshape(-1), cols.reshape(-1)
            locs = slots.reshape(-1)
        else:
            valid = acc.accept_index >= 0  # [bs, width]
            keep = valid.reshape(-1)
            ids, positions, locs = acc.output_tokens[valid], cols[valid], slots[valid]
            last_rows = torch.cumsum(a, 0) - 1
        fb = ForwardBatch(
            mode="extend",
            input_ids=ids,
            positions=positions,
            out_cache_loc=locs,
            req_pool_indices=rpi,
            prefix_lens=L,
            extend_lens=a,
            # Accept lengths are not on the host: bound them by the path width.
            host=HostLens(width, max_len + width, width == 1),
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
        )
        return fb, keep, last_rows

"""The constrained rows of one forward and the masks they need (grammar.py has the invariant,
output_constraint.py the constraints).

Built on the host at launch (the scheduler knows which request's prefill goes on in a later
chunk: its sampled token is thrown away, so its matcher must not advance). Rows without a
constraint get all-allowed masks. Every method that reads device tokens is a host sync; the
workers call them only when a batch holds a constrained row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagleserve.constrained.grammar_mask import (
    BITS,
    allow_all_where_empty,
    node_paths,
    unpack_bitmask,
)
from eagleserve.constrained.output_constraint import OutputConstraint
from eagleserve.core import Req
from eagleserve.device import host_to, tensor_to


@dataclass
class BatchConstraint:
    rows: list[int]  # batch rows with a constraint
    constraints: list[OutputConstraint]
    batch_size: int
    vocab_size: int

    @classmethod
    def of_reqs(
        cls, reqs: list[Req], vocab_size: int, skip: Req | None = None
    ) -> BatchConstraint | None:
        rows = [i for i, r in enumerate(reqs) if r.constraint is not None and r is not skip]
        if not rows:
            return None
        return cls(rows, [reqs[i].constraint for i in rows], len(reqs), vocab_size)

    @property
    def reads_tokens(self) -> bool:
        """Whether a row's masks depend on its tokens (a grammar, bad words); only such a batch
        reads them to the host (allowed_token_ids alone is the same mask everywhere)."""
        return any(c.stateful for c in self.constraints)

    def _bitmask(self, n: int) -> torch.Tensor:
        return torch.full((n, (self.vocab_size + BITS - 1) // BITS), -1, dtype=torch.int32)

    def _unpack(self, bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
        return unpack_bitmask(host_to(allow_all_where_empty(bitmask), device), self.vocab_size)

    def next_allowed(self, device: torch.device) -> torch.Tensor:
        """[bs, V] bool: each row's next-token mask at its committed state."""
        bm = self._bitmask(self.batch_size)
        for row, g in zip(self.rows, self.constraints):
            g.fill(bm, row)
        return self._unpack(bm, device)

    def advance(self, tokens: torch.Tensor, lens: torch.Tensor | None = None) -> None:
        """Commits tokens [bs] (one per row) or [bs, w] with lens [bs] valid per row."""
        if not self.reads_tokens:
            return
        host = tokens.tolist()
        counts = [1] * len(host) if lens is None else lens.tolist()
        for row, g in zip(self.rows, self.constraints):
            toks = host[row] if isinstance(host[row], list) else [host[row]]
            g.accept(toks[: counts[row]])

    def tree_allowed(
        self, tokens: torch.Tensor, parents: torch.Tensor, device: torch.device
    ) -> torch.Tensor:
        """[bs, n, V]: node i's mask after the tokens on its own path (tokens, parents [bs, n];
        node 0 is the committed root)."""
        bs, n = tokens.shape
        bm = self._bitmask(bs * n)
        if not self.reads_tokens:
            return self._fill_fixed(bm, n, device).view(bs, n, -1)
        idx = tensor_to(self.rows, torch.long, tokens.device)
        toks, pars = tokens[idx].tolist(), parents[idx].tolist()
        for k, (row, g) in enumerate(zip(self.rows, self.constraints)):
            paths = [[toks[k][j] for j in p] for p in node_paths(pars[k])]
            g.fill_paths(paths, bm, row * n)
        return self._unpack(bm, device).view(bs, n, -1)

    def branch_allowed(self, paths: torch.Tensor, device: torch.device) -> torch.Tensor:
        """paths [bs, b, d]: draft tokens of each branch -> [bs * b, V] masks after them."""
        bs, b, _ = paths.shape
        bm = self._bitmask(bs * b)
        if not self.reads_tokens:
            return self._fill_fixed(bm, b, device)
        idx = tensor_to(self.rows, torch.long, paths.device)
        host = paths[idx].tolist()
        for k, (row, g) in enumerate(zip(self.rows, self.constraints)):
            g.fill_paths(host[k], bm, row * b)
        return self._unpack(bm, device)

    def _fill_fixed(
        self, bitmask: torch.Tensor, per_row: int, device: torch.device
    ) -> torch.Tensor:
        """Masks that depend on no token: each row's `per_row` entries all get its mask."""
        for row, g in zip(self.rows, self.constraints):
            g.fill_paths([[]] * per_row, bitmask, row * per_row)
        return self._unpack(bitmask, device)

"""One target forward through the serving path, outside the scheduler: a request row with
scratch slots in the runner's pools, and the batch a decode or a verify of some tokens after
some context in it builds. What bench/cpu_vs_llamacpp.py's verify costs, bench/kv_cache_accept.py
and bench/forward_phases_cpu.py run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def scratch_request(runner: Any, tokens: int) -> Iterator[int]:
    """A request row of `runner`'s pools whose first `tokens` positions hold fresh K/V slots
    (their contents whatever the pool had), freed after."""
    r2t, kv_pool = runner.req_to_token_pool, runner.token_to_kv_pool
    row, loc = r2t.alloc(), kv_pool.alloc(tokens)
    if row is None or loc is None:
        raise RuntimeError(f"no room for a scratch request of {tokens} tokens in the KV pool")
    r2t.req_to_token[row, :tokens] = loc
    try:
        yield row
    finally:
        kv_pool.free(loc)
        r2t.free(row)


def scratch_batch(runner: Any, row: int, input_ids: torch.Tensor, context: int) -> Any:
    """The ForwardBatch of `input_ids` at positions context.. of request `row` (its slots from
    `scratch_request`): a decode for one token, else a verify of them all (causal, every row's
    logits), the first `context` positions' K/V as the pool holds them."""
    from eagleserve.layers.forward_batch import ForwardBatch, HostLens

    n = input_ids.numel()
    cols = context + torch.arange(n)
    return ForwardBatch(
        mode="decode" if n == 1 else "verify",
        input_ids=input_ids,
        positions=cols,
        out_cache_loc=runner.req_to_token_pool.req_to_token[row, cols],
        req_pool_indices=torch.tensor([row]),
        prefix_lens=torch.tensor([context]),
        extend_lens=torch.tensor([n]),
        host=HostLens.per_request(n, context, 1),
        kv_pool=runner.token_to_kv_pool,
        attn_backend=runner.attn_backend,
    )

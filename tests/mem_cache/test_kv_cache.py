"""mem_cache/kv_cache.py: a decode's slot reservation writes each request's new slots into its
req_to_token row, in order, and touches nothing else (one span or many); the host's copy of the
rows follows."""

from __future__ import annotations

import pytest
import torch

from eagleserve.mem_cache.kv_cache import ReqToTokenPool


@pytest.mark.parametrize("num_spans", [1, 2, 5])
def test_write_spans_fills_each_span_with_the_next_slots(num_spans: int) -> None:
    pool = ReqToTokenPool(8, 32, torch.device("cpu"))
    before = torch.randint(1, 1000, pool.req_to_token.shape)
    pool.req_to_token.copy_(before)
    rows = torch.randperm(8)[:num_spans].tolist()
    spans = []
    for row in rows:
        start = int(torch.randint(0, 28, ()))
        spans.append((row, start, start + int(torch.randint(1, 32 - start + 1, ()))))
    total = sum(end - start for _, start, end in spans)
    pool.req_to_token_host.copy_(before)
    loc = torch.randperm(5000)[:total] + 1000  # slots no row held before
    assert torch.equal(pool.write_spans(spans, loc), loc)
    want, off = before.clone(), 0
    for row, start, end in spans:
        want[row, start:end] = loc[off : off + end - start]
        off += end - start
    assert torch.equal(pool.req_to_token, want)
    assert torch.equal(pool.req_to_token_host, want)
    for row in rows:
        assert torch.equal(pool.row_slots(row, 32), want[row])

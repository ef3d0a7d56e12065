"""The greedy acceptance walk of a verify in one launch: spec/accept.py's `packed_greedy` (a
chain's leading run of matches, a tree's depth-by-depth walk) for a verify graph's epilogue,
where the torch ops launch a kernel each: a dozen for a chain, several a depth for a tree.

One program per request walks its n <= BLOCK_N nodes in registers: node i matches when its
token is the target's argmax after its parent; the path's node at depth d is the lowest-index
matching child of the node at depth d - 1. A tree's parents are read off its ancestor mask (the
largest strict ancestor: indices grow along every root path), so the graph holds the mask only.
The output row is `packed_greedy`'s: accept_index [D], output_tokens [D], accept_len, bonus.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagleserve.kernels import pdl
from eagleserve.kernels.triton_common import wait_previous


@triton.jit
def _greedy_accept_kernel(
    Tokens,  # [bs, n] int64: the verify tree's tokens, node 0 the root
    Predict,  # [bs, n] int64: the target's argmax after each node
    Mask,  # [bs, n, n] bool ancestor-or-self mask (unused for a chain)
    Out,  # [bs, 2 * DEPTH + 4] int64
    stride_t, stride_p, stride_mb, stride_mi, stride_o, N,
    DEPTH: tl.constexpr,  # the deepest path: width D = DEPTH + 1
    CHAIN: tl.constexpr,  # parents are i - 1 (no mask)
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    node = tl.arange(0, BLOCK_N)
    valid = node < N
    tokens = tl.load(Tokens + b * stride_t + node, mask=valid, other=-1)
    if CHAIN:
        parents = node - 1
    else:
        col = tl.arange(0, BLOCK_N)
        anc = tl.load(
            Mask + b * stride_mb + node[:, None] * stride_mi + col[None, :],
            mask=valid[:, None] & (col[None, :] < N),
            other=0,
        )
        strict = (anc != 0) & (col[None, :] < node[:, None])
        parents = tl.max(tl.where(strict, col[None, :], -1), axis=1)
    after_parent = tl.load(Predict + b * stride_p + tl.maximum(parents, 0), mask=valid, other=-1)
    match = valid & (parents >= 0) & (tokens == after_parent)
    slot = tl.arange(0, BLOCK_D)
    accept_index = tl.where(slot == 0, 0, -1)
    output_tokens = tl.full([BLOCK_D], -1, tl.int64)
    cur = tl.zeros([], tl.int32)
    length = tl.full([], 1, tl.int32)
    for d in tl.static_range(1, DEPTH + 1):
        child = match & (parents == cur)
        found = tl.max(child.to(tl.int32), axis=0) > 0
        first = tl.min(tl.where(child, node, BLOCK_N), axis=0)
        token = tl.sum(tl.where(node == first, tokens, 0), axis=0)
        cur = tl.where(found, first, cur)
        accept_index = tl.where(slot == d, tl.where(found, first, -1), accept_index)
        output_tokens = tl.where(slot == d - 1, tl.where(found, token, -1), output_tokens)
        length += found.to(tl.int32)
    bonus = tl.load(Predict + b * stride_p + cur)
    output_tokens = tl.where(slot == length - 1, bonus, output_tokens)
    width = DEPTH + 1
    row = Out + b * stride_o
    tl.store(row + slot, accept_index.to(tl.int64), mask=slot < width)
    tl.store(row + width + slot, output_tokens, mask=slot < width)
    tl.store(row + 2 * width, length.to(tl.int64))
    tl.store(row + 2 * width + 1, bonus)


def greedy_accept(
    tokens: torch.Tensor,
    predict: torch.Tensor,
    tree_mask: torch.Tensor | None = None,
    max_depth: int | None = None,
) -> torch.Tensor:
    """[bs, 2D + 2] int64 packed acceptance (`packed_greedy`'s layout, D = max_depth + 1) of
    the verify tree `tokens` [bs, n] against the target's argmax `predict` [bs, n]; a chain
    when `tree_mask` [bs, n, n] is None (then max_depth is n - 1)."""
    bs, n = tokens.shape
    assert predict.shape == (bs, n) and tokens.dtype == predict.dtype == torch.int64
    depth = n - 1 if max_depth is None or tree_mask is None else max_depth
    assert 0 <= depth < max(n, 1), (depth, n)
    out = torch.empty(bs, 2 * depth + 4, dtype=torch.int64, device=tokens.device)
    if bs == 0:
        return out
    chain = tree_mask is None
    mask = tokens if chain else tree_mask  # any pointer: a chain never reads it
    assert chain or (mask.shape == (bs, n, n) and mask.stride(2) == 1)
    assert tokens.stride(1) == 1 and predict.stride(1) == 1
    _greedy_accept_kernel[(bs,)](
        tokens, predict, mask, out,
        tokens.stride(0), predict.stride(0), mask.stride(0), 0 if chain else mask.stride(1),
        out.stride(0), n,
        DEPTH=depth, CHAIN=chain, BLOCK_N=triton.next_power_of_2(max(n, 2)),
        BLOCK_D=triton.next_power_of_2(depth + 1), num_warps=1,
        **pdl.launch_options(tokens.device),
    )  # fmt: skip
    return out

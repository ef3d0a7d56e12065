"""A top-k draft's verify tree in one launch: spec/tree.py's `build_tree` (each selected
candidate's parent node, its depth, the tokens and the ancestor mask), where the torch ops
launch a kernel each, several a tree depth, inside a tree's draft-loop graph.

One program per request, nodes in registers: node i >= 1 is selected candidate i - 1 (flat
index f = top_scores_index[i - 1], sorted); its parent candidate is parent_list[f // topk] and
its parent node one plus that candidate's rank among the selected (a count of smaller flat
indices: the searchsorted of the torch path); the root's children have none. The ancestor mask
follows the parents up the tree, read back from the row just stored, at most num_steps times.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagleserve.kernels import pdl
from eagleserve.kernels.triton_common import wait_previous


@triton.jit
def _build_tree_kernel(
    Verified,  # [bs] int64: the roots' tokens
    ParentList,  # [bs, W] int64: the parent candidate (flat index) of each step's candidates
    Selected,  # [bs, M] int64: the selected candidates' flat indices, increasing
    DraftTokens,  # [bs, M] int64
    Tokens, Parents, Depths,  # [bs, N] int64 each, N = M + 1
    Mask,  # [bs, N, N] bool
    stride_pl, stride_sel, stride_dt, stride_t, stride_p, stride_d, stride_mb, stride_mi,
    M,
    TOPK: tl.constexpr,
    HAS_PARENTS: tl.constexpr,  # W > 0 (more than one step)
    NUM_STEPS: tl.constexpr,  # the tree's depth bound
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    node = tl.arange(0, BLOCK_N)
    valid = node < M + 1
    drafted = (node >= 1) & valid
    flat = tl.load(Selected + b * stride_sel + node - 1, mask=drafted, other=0)
    if HAS_PARENTS:
        parent_flat = tl.load(ParentList + b * stride_pl + flat // TOPK, mask=drafted, other=-1)
    else:
        parent_flat = tl.full([BLOCK_N], -1, tl.int64)
    # The parent candidate's rank among the selected: how many selected flat indices are
    # smaller (the selection is ancestor-closed and sorted, so it is there).
    col = tl.arange(0, BLOCK_N)
    sel = tl.load(Selected + b * stride_sel + col, mask=col < M, other=0)
    smaller = (sel[None, :] < tl.maximum(parent_flat, 0)[:, None]) & (col < M)[None, :]
    rank = tl.minimum(tl.sum(smaller.to(tl.int32), axis=1), M - 1)
    parent = tl.where(parent_flat < 0, 0, rank + 1)
    parent = tl.where(node == 0, -1, parent)
    step = tl.where(flat < TOPK, 0, 1 + (flat - TOPK) // (TOPK * TOPK))
    depth = tl.where(node == 0, 0, step + 1)
    token = tl.load(DraftTokens + b * stride_dt + node - 1, mask=drafted, other=0)
    token = tl.where(node == 0, tl.load(Verified + b), token)
    tl.store(Tokens + b * stride_t + node, token, mask=valid)
    tl.store(Parents + b * stride_p + node, parent.to(tl.int64), mask=valid)
    tl.store(Depths + b * stride_d + node, depth.to(tl.int64), mask=valid)
    tl.debug_barrier()  # the parents row is read back below
    anc = col[None, :] == node[:, None]
    cur = parent
    for _ in tl.static_range(NUM_STEPS):
        up = cur >= 0
        anc = anc | ((col[None, :] == cur[:, None]) & up[:, None])
        nxt = tl.load(Parents + b * stride_p + tl.maximum(cur, 0), mask=valid & up, other=-1)
        cur = tl.where(up, nxt, -1)
    out = Mask + b * stride_mb + node[:, None] * stride_mi + col[None, :]
    tl.store(out, anc, mask=valid[:, None] & (col < M + 1)[None, :])


def build_tree_kernel(
    verified_id: torch.Tensor,
    parent_list: torch.Tensor,
    top_scores_index: torch.Tensor,
    draft_tokens: torch.Tensor,
    topk: int,
    num_draft_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(draft_tokens, parents, depths, tree_mask) of `build_tree` for the same inputs."""
    bs, n = verified_id.shape[0], num_draft_tokens
    m = n - 1
    dev = verified_id.device
    tokens, parents, depths = (torch.empty(bs, n, dtype=torch.long, device=dev) for _ in range(3))
    mask = torch.empty(bs, n, n, dtype=torch.bool, device=dev)
    if bs == 0:
        return tokens, parents, depths, mask
    assert m >= 1 and top_scores_index.shape == draft_tokens.shape == (bs, m)
    w = parent_list.shape[1]
    num_steps = 1 if w == 0 else (w - 1) // topk + 1
    sel, dt = top_scores_index.long(), draft_tokens.long()
    pl = parent_list.long() if w else sel  # any pointer without parents
    assert sel.stride(1) == 1 and dt.stride(1) == 1 and pl.stride(1) == 1
    _build_tree_kernel[(bs,)](
        verified_id.long(), pl, sel, dt, tokens, parents, depths, mask,
        pl.stride(0), sel.stride(0), dt.stride(0), tokens.stride(0), parents.stride(0),
        depths.stride(0), mask.stride(0), mask.stride(1), m,
        TOPK=topk, HAS_PARENTS=w > 0, NUM_STEPS=min(num_steps, m),
        BLOCK_N=triton.next_power_of_2(n), num_warps=1,
        **pdl.launch_options(dev),
    )  # fmt: skip
    return tokens, parents, depths, mask

"""A chain draft's candidate in one launch: each row's most likely id of the head's logits, its
softmax probability, and its id mapped through a table (the draft-to-target vocabulary map),
where a softmax, a max and a gather take three (spec/draft_extend.py's `top_candidates`).

One program per row streams the row in blocks with a running max, the sum of exp(x - max) and
the lowest index of the max, in fp32: the probability of the max is 1 / that sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagleserve.kernels import pdl
from eagleserve.kernels.triton_common import wait_previous


@triton.jit
def _top1_kernel(
    Logits,  # [T, V], any float dtype
    IdMap,  # [V] int64 (HAS_MAP only)
    Prob,  # [T] fp32
    Ids,  # [T] int64
    stride_l, V,
    HAS_MAP: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    top = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    best = tl.zeros([], tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = tl.load(Logits + row * stride_l + cols, mask=cols < V, other=float("-inf"))
        x = x.to(tl.float32)
        block_top = tl.max(x, axis=0)
        block_best = tl.min(tl.where(x == block_top, cols, V), axis=0)
        new_top = tl.maximum(top, block_top)
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), axis=0)
        best = tl.where(block_top > top, block_best, best)  # ties: the earlier block's id
        top = new_top
    if HAS_MAP:
        ids = tl.load(IdMap + best)
    else:
        ids = best.to(tl.int64)
    tl.store(Prob + row, 1.0 / total)
    tl.store(Ids + row, ids)


def top1(
    logits: torch.Tensor, id_map: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probability [T, 1] fp32, id [T, 1] int64) of each row's most likely column of logits
    [T, V] (the softmax's max, the lowest id on a tie), the id as `id_map` [V] maps it."""
    assert logits.dim() == 2 and logits.stride(1) == 1
    t, v = logits.shape
    prob = torch.empty(t, 1, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, 1, dtype=torch.long, device=logits.device)
    if t == 0:
        return prob, ids
    assert id_map is None or (id_map.shape == (v,) and id_map.dtype == torch.int64)
    _top1_kernel[(t,)](
        logits, logits if id_map is None else id_map, prob, ids, logits.stride(0), v,
        HAS_MAP=id_map is not None, BLOCK=min(4096, triton.next_power_of_2(v)), num_warps=4,
        **pdl.launch_options(logits.device),
    )  # fmt: skip
    return prob, ids

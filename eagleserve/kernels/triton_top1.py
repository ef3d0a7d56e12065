"""A chain draft's candidate in one launch: each row's most likely id of the head's logits, its
softmax probability, and its id mapped through a table (the draft-to-target vocabulary map),
where a softmax, a max and a gather take three (spec/draft_extend.py's `top_candidates`).

One program per row streams the row in blocks with a running max, the sum of exp(x - max) and
the lowest index of the max, in fp32: the probability of the max is 1 / that sum.

`drawn_top1` does the same for a chain whose sampled rows draw their drafts (draft_extend.py
`GraphDraftDraw`, unfiltered: temperature and min-p), where the torch ops around the draw
launch about twenty kernels: a sampled row then streams its row a second time for the
exponential race of sampling/seeded_noise.py, each kept token's key E_t / w_t in fp64 with w_t =
exp((x_t - max) / temperature) (the softmax at the temperature, unnormalized: the race's winner
does not depend on the scale), min-p keeping w_t >= min_p.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagleserve.kernels import pdl
from eagleserve.kernels.triton_common import wait_previous
from eagleserve.kernels.triton_sample import _mix32


@triton.jit
def _row_top(Logits, row, stride_l, V, BLOCK: tl.constexpr):
    # One pass over a row: its max, sum of exp(x - max) and lowest index of the max, in fp32.
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
    return top, total, best.to(tl.int64)


@triton.jit
def _top1_kernel(
    Logits,  # [T, V], any float dtype
    IdMap,  # [V] int64 (HAS_MAP only)
    Floats,  # [T, >= 3] fp32: temperature, top_p (unused), min_p (DRAWN only)
    Ints,  # [T, >= 3] int64: top_k (unused), seed, 1 where the row samples (DRAWN only)
    Positions,  # [T] int64: where each row's draft will sit (DRAWN only)
    Prob,  # [T] fp32
    Ids,  # [T] int64
    stride_l, stride_f, stride_i, V,
    HAS_MAP: tl.constexpr,
    DRAWN: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    top, total, chosen = _row_top(Logits, row, stride_l, V, BLOCK)
    prob = 1.0 / total  # the max's
    if DRAWN:
        if tl.load(Ints + row * stride_i + 2) != 0:
            chosen = _race(Logits, IdMap, Floats, Ints, Positions, row, top, stride_l, stride_f,
                           stride_i, V, HAS_MAP, BLOCK)  # fmt: skip
            prob = tl.exp(tl.load(Logits + row * stride_l + chosen).to(tl.float32) - top) / total
    if HAS_MAP:
        ids = tl.load(IdMap + chosen)
    else:
        ids = chosen
    tl.store(Prob + row, prob)
    tl.store(Ids + row, ids)


@triton.jit
def _race(
    Logits, IdMap, Floats, Ints, Positions, row, top, stride_l, stride_f, stride_i, V,
    HAS_MAP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # A sampled row's draw: the least E_t / w_t over its kept tokens (the lowest on a tie).
    offs = tl.arange(0, BLOCK)
    temperature = tl.load(Floats + row * stride_f)
    min_p = tl.load(Floats + row * stride_f + 2)
    seed = tl.load(Ints + row * stride_i + 1)
    h = _mix32(tl.load(Positions + row) % 4294967296)
    h = _mix32(h ^ (seed % 4294967296))
    h = _mix32(h ^ (seed >> 32))
    best_key = tl.full([], float("inf"), tl.float64)
    drawn = tl.full([], -1, tl.int64)
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = tl.load(Logits + row * stride_l + cols, mask=cols < V, other=float("-inf"))
        w = tl.exp((x.to(tl.float32) - top) / temperature)
        tokens = cols.to(tl.int64)
        if HAS_MAP:
            tokens = tl.load(IdMap + cols, mask=cols < V, other=0)
        u = _mix32(((tokens * 0x9E3779B9) % 4294967296) ^ h)
        u = ((u >> 9) * 2 + 1).to(tl.float64) * (1.0 / 16777216.0)
        keep = (w > 0) & (w >= min_p)
        key = tl.where(keep, -tl.log(1.0 - u) / tl.where(keep, w, 1.0).to(tl.float64),
                       float("inf"))  # fmt: skip
        low = tl.min(key, axis=0)
        first = tl.min(tl.where(key == low, cols, V), axis=0).to(tl.int64)
        better = low < best_key  # a later block's tie keeps the earlier (lower) token
        drawn = tl.where(better, first, drawn)
        best_key = tl.where(better, low, best_key)
    return tl.where(drawn >= 0, drawn, V - 1)


def _launch(
    logits: torch.Tensor,
    id_map: torch.Tensor | None,
    drawn: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    assert logits.dim() == 2 and logits.stride(1) == 1
    t, v = logits.shape
    prob = torch.empty(t, 1, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, 1, dtype=torch.long, device=logits.device)
    if t == 0:
        return prob, ids
    assert id_map is None or (id_map.shape == (v,) and id_map.dtype == torch.int64)
    floats, ints, positions = drawn if drawn is not None else (logits, logits, logits)
    if drawn is not None:
        assert floats.stride(1) == 1 and ints.stride(1) == 1 and positions.stride(0) == 1
    _top1_kernel[(t,)](
        logits, logits if id_map is None else id_map, floats, ints, positions, prob, ids,
        logits.stride(0), floats.stride(0), ints.stride(0), v,
        HAS_MAP=id_map is not None, DRAWN=drawn is not None,
        BLOCK=min(2048 if drawn is not None else 4096, triton.next_power_of_2(v)), num_warps=4,
        **pdl.launch_options(logits.device),
    )  # fmt: skip
    return prob, ids


def top1(
    logits: torch.Tensor, id_map: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probability [T, 1] fp32, id [T, 1] int64) of each row's most likely column of logits
    [T, V] (the softmax's max, the lowest id on a tie), the id as `id_map` [V] maps it."""
    return _launch(logits, id_map, None)


def drawn_top1(
    logits: torch.Tensor,
    floats: torch.Tensor,
    ints: torch.Tensor,
    positions: torch.Tensor,
    id_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probability [T, 1] fp32 at temperature 1, id [T, 1] int64 as `id_map` [V] maps it) of
    each row's draft from logits [T, V]: a greedy row's most likely column (`top1`'s), a
    sampled row's draw by the exponential race on the noise of its seed, positions[i] and each
    column's mapped id, over the softmax at its temperature with min-p applied (no top-k or
    top-p). Parameters as sampler.PackedSampling holds them (floats: temperature, top_p,
    min_p; ints: top_k, seed, whether the row samples), rows of any stride."""
    return _launch(logits, id_map, (floats, ints, positions))

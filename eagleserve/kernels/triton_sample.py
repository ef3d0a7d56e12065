"""A sampled row's token in one launch: sampling/sampler.py's `draw` (the exponential race on
sampling/seeded_noise.py's noise), where the torch ops launch a kernel each (the hash's mixing
rounds alone are dozens) and hold an [m, V] fp64 row of keys.

One program per row: the hash of (seed, position) in int64 registers (every product below
2**63, as in the torch version), then one pass over the row's blocks, each token's key E_t /
p_t in fp64 (E_t = -log(1 - W_t), 1 - W_t exact there), keeping the least and its token (the
lowest on a tie). A row without mass gives its last token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagleserve.kernels import pdl
from eagleserve.kernels.triton_common import wait_previous


@triton.jit
def _mix32(x):
    # x int64 in [0, 2**32); `% 2**32` is `& 0xFFFFFFFF` there, with a constant that is int64
    # (a literal below 2**32 would be typed uint32).
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) % 4294967296
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) % 4294967296
    return x ^ (x >> 16)


@triton.jit
def _seeded_draw_kernel(
    Probs,  # [m, V] fp32, non-negative, not necessarily normalized
    Seeds,  # [m] int64 in [0, 2**63)
    Positions,  # [m] int64: where each drawn token will sit
    Columns,  # [V] int64: each column's token id (read where HAS_COLUMNS)
    Out,  # [m] int64
    stride_p, V,
    BLOCK: tl.constexpr,
    HAS_COLUMNS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(Seeds + row)
    h = _mix32(tl.load(Positions + row) % 4294967296)
    h = _mix32(h ^ (seed % 4294967296))
    h = _mix32(h ^ (seed >> 32))
    offs = tl.arange(0, BLOCK)
    best_key = tl.full([], float("inf"), tl.float64)
    best = tl.full([], -1, tl.int64)
    for start in range(0, V, BLOCK):
        cols = start + offs
        p = tl.load(Probs + row * stride_p + cols, mask=cols < V, other=0.0).to(tl.float64)
        tokens = cols.to(tl.int64)
        if HAS_COLUMNS:
            tokens = tl.load(Columns + cols, mask=cols < V, other=0)
        x = _mix32(((tokens * 0x9E3779B9) % 4294967296) ^ h)
        w = ((x >> 9) * 2 + 1).to(tl.float64) * (1.0 / 16777216.0)
        key = tl.where(p > 0, -tl.log(1.0 - w) / tl.where(p > 0, p, 1.0), float("inf"))
        low = tl.min(key, axis=0)
        first = tl.min(tl.where(key == low, cols, V), axis=0).to(tl.int64)
        better = low < best_key  # a later block's tie keeps the earlier (lower) token
        best = tl.where(better, first, best)
        best_key = tl.where(better, low, best_key)
    tl.store(Out + row, tl.where(best >= 0, best, V - 1))


def seeded_draw(
    probs: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    columns: torch.Tensor | None = None,
) -> torch.Tensor:
    """[m] int64: the column of row i of probs [m, V] drawn by the exponential race on the noise
    of (seeds[i], positions[i]) and each column's token id (`columns` [V], default its index),
    as sampler.draw(probs, seeds, positions, columns) does."""
    assert probs.dim() == 2 and probs.stride(1) == 1 and probs.dtype == torch.float32
    m, v = probs.shape
    out = torch.empty(m, dtype=torch.int64, device=probs.device)
    if m == 0:
        return out
    seeds, positions = seeds.contiguous(), positions.contiguous()
    assert seeds.shape == positions.shape == (m,)
    cols = positions if columns is None else columns.to(torch.int64).contiguous()
    _seeded_draw_kernel[(m,)](
        probs, seeds, positions, cols, out, probs.stride(0), v,
        BLOCK=min(2048, triton.next_power_of_2(v)), HAS_COLUMNS=columns is not None,
        num_warps=4, **pdl.launch_options(probs.device),
    )  # fmt: skip
    return out

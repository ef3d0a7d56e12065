"""A sampled row's token in one launch: sampling/sampler.py's `draw` with the uniform of
sampling/seeded_noise.py's `position_uniforms`, where the torch ops launch a kernel each (the
hash's three mixing rounds alone are two dozen).

One program per row: the hash of (seed, position) in int64 registers (every product below
2**63, as in the torch version), the row's total in fp64, then a second pass over the same
blocks for the first token whose running sum exceeds u * total. Only a row without mass
crossing nowhere (or a rounding of order 1e-16 at the very end) falls back to its last token
with mass, else its last token.
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
    Out,  # [m] int64
    stride_p, V,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(Seeds + row)
    h = _mix32(tl.load(Positions + row) % 4294967296)
    h = _mix32(h ^ (seed % 4294967296))
    h = _mix32(h ^ (seed >> 32))
    u = (h >> 8).to(tl.float64) * (1.0 / 16777216.0)
    offs = tl.arange(0, BLOCK)
    total = tl.zeros([], tl.float64)
    last = tl.full([], -1, tl.int64)  # the last token with mass
    for start in range(0, V, BLOCK):
        cols = start + offs
        p = tl.load(Probs + row * stride_p + cols, mask=cols < V, other=0.0).to(tl.float64)
        total += tl.sum(p, axis=0)
        last = tl.maximum(last, tl.max(tl.where(p > 0, cols, -1), axis=0).to(tl.int64))
    target = u * total
    running = tl.zeros([], tl.float64)
    found = tl.zeros([], tl.int64) + V
    for start in range(0, V, BLOCK):
        cols = start + offs
        p = tl.load(Probs + row * stride_p + cols, mask=cols < V, other=0.0).to(tl.float64)
        cum = running + tl.cumsum(p, axis=0)
        first = tl.min(tl.where((cum > target) & (cols < V), cols, V), axis=0).to(tl.int64)
        found = tl.where(found == V, first, found)
        running += tl.sum(p, axis=0)
    fallback = tl.where(last >= 0, last, V - 1)
    tl.store(Out + row, tl.where(found < V, found, fallback))


def seeded_draw(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[m] int64: row i of probs [m, V] sampled by inverse CDF with the uniform of (seeds[i],
    positions[i]), as sampler.draw(probs, position_uniforms(seeds, positions)) does."""
    assert probs.dim() == 2 and probs.stride(1) == 1 and probs.dtype == torch.float32
    m, v = probs.shape
    out = torch.empty(m, dtype=torch.int64, device=probs.device)
    if m == 0:
        return out
    seeds, positions = seeds.contiguous(), positions.contiguous()
    assert seeds.shape == positions.shape == (m,)
    _seeded_draw_kernel[(m,)](
        probs, seeds, positions, out, probs.stride(0), v,
        BLOCK=min(2048, triton.next_power_of_2(v)), num_warps=4,
        **pdl.launch_options(probs.device),
    )  # fmt: skip
    return out

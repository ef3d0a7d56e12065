"""Position-keyed sampling noise: a sampled request draws its token at sequence position t from
noise that is a hash of (its seed, t, the token), not the next draw of a stateful generator.

Why: a speculative verify samples the target at several positions in one forward, a decode at
one, and the adaptive controller picks how many from measured costs. With a generator consumed
in sequence, which draw met which position (and so the tokens) followed that choice, and the
machine's timing behind it. Keyed by position, the token at t depends only on the seed, t and
the target's distribution there: the same whatever the batch, the draft length, or whether
speculation runs at all.

The draw is an exponential race (sampling/sampler.py `draw`): every token t of the vocabulary
has its own exponential E_t = -log(1 - W_t) from the uniform W_t of (seed, position, t), and the
token drawn is the one with the least E_t / w_t over the row's weights w. That samples the
row's distribution exactly, and a draft head that races its own distribution on the same E_t
draws the target's token wherever the two distributions agree around it (spec/draft_extend.py
`DraftDraw`), where an inverse-CDF draw in vocabulary order would part at every difference in
the mass of the tokens before it.

Plain int64 tensor ops on the device (no host read, capturable); every product stays below
2**63, so nothing relies on integer overflow wrapping.
"""

from __future__ import annotations

import os
import random

import torch

_M32 = 0xFFFFFFFF
# Thomas Mueller's 32-bit mixer constant: below 2**27, so a 32-bit value times it fits in int64.
_MUL = 0x45D9F3B


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2**32) in which every input bit flips about half the output bits."""
    x = x ^ (x >> 16)
    x = (x * _MUL) & _M32
    x = x ^ (x >> 16)
    x = (x * _MUL) & _M32
    return x ^ (x >> 16)


# The golden ratio's 32-bit constant: odd, so t -> t * _GOLDEN mod 2**32 is a bijection.
_GOLDEN = 0x9E3779B9


def position_hashes(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[m] int64 in [0, 2**32), one per (seeds[i], positions[i]): seeds int64 in [0, 2**63),
    positions int64 >= 0 (the position of the token drawn). For one seed, distinct positions
    below 2**32 never share a hash (each round is a bijection of the one before)."""
    h = _mix32(positions & _M32)
    h = _mix32(h ^ (seeds & _M32))
    return _mix32(h ^ (seeds >> 32))


def token_uniforms(row_hashes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[m, n] float64 uniforms W in (0, 1), odd multiples of 2**-24, of each row's hash
    (`position_hashes`) and each token id of `tokens` [n] (int64, below 2**31): distinct
    tokens of a row never share one before the last 9 bits are dropped."""
    t = (tokens[None, :] * _GOLDEN) & _M32
    x = _mix32(t ^ row_hashes[:, None])
    return ((x >> 9) * 2 + 1).double() * 2.0**-24


def exponentials(w: torch.Tensor) -> torch.Tensor:
    """-log(1 - W) of uniforms W in (0, 1), float64 (1 - W is exact there): Exp(1) draws."""
    return -torch.log1p(-w)


def entropy_seed() -> int:
    """A seed for a request that names none: 63 bits of the OS's entropy."""
    return int.from_bytes(os.urandom(8), "little") >> 1


class RequestSeeds:
    """The seeds of sampled requests that name none: each from the OS's entropy, or, given the
    engine's random seed (--random-seed), the next of one generator seeded with it, so the same
    requests arriving in the same order draw the same tokens from one run to the next."""

    def __init__(self, random_seed: int | None) -> None:
        self._rng = None if random_seed is None else random.Random(random_seed)

    def seed_for(self, own: int | None) -> int:
        """A request's sampling seed: its own where it names one (the generator does not move
        then), else the next."""
        if own is not None:
            return own
        return entropy_seed() if self._rng is None else self._rng.getrandbits(63)

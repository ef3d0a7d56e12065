"""Position-keyed sampling noise (sampling/seeded_noise.py): the documented hash, computed in
int64 tensor ops without overflow over the whole seed range, gives uniforms that look
independent across positions of one seed, across neighbouring seeds (a request's n choices are
seeds one apart) and across the tokens of one position, and exponentials from them."""

from __future__ import annotations

import math
import random

import torch

from eagleserve.sampling.seeded_noise import (
    RequestSeeds,
    entropy_seed,
    exponentials,
    position_hashes,
    token_uniforms,
)

M32 = 0xFFFFFFFF


def _mix32(x: int) -> int:
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & M32
    return x ^ (x >> 16)


def _reference(seed: int, position: int, token: int) -> float:
    h = _mix32(position & M32)
    h = _mix32(h ^ (seed & M32))
    h = _mix32(h ^ (seed >> 32))
    x = _mix32(((token * 0x9E3779B9) & M32) ^ h)
    return ((x >> 9) * 2 + 1) / 2**24


def _uniforms(seeds: torch.Tensor, positions: torch.Tensor, token: int = 0) -> torch.Tensor:
    """Each (seed, position)'s uniform of one token."""
    return token_uniforms(position_hashes(seeds, positions), torch.tensor([token]))[:, 0]


def _chi2_bound(df: int) -> float:
    """Far above the chi-square's spread (mean df, sd sqrt(2 df)): fails by chance ~never."""
    return df + 8 * math.sqrt(2 * df)


def _chi2(counts: torch.Tensor) -> float:
    expected = counts.sum() / counts.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_uniforms_are_the_documented_hash_over_the_whole_seed_range() -> None:
    seeds = [0, 1, 2**32 - 1, 2**32, 2**62 + 12345, 2**63 - 1]
    seeds += [random.randrange(2**63) for _ in range(50)]
    positions = [random.randrange(2**31) for _ in seeds]
    tokens = [0, 1, 2**16 + 3, 2**31 - 1] + [random.randrange(2**31) for _ in range(4)]
    got = token_uniforms(position_hashes(torch.tensor(seeds), torch.tensor(positions)),
                         torch.tensor(tokens))  # fmt: skip
    assert got.dtype == torch.float64
    want = [[_reference(s, p, t) for t in tokens] for s, p in zip(seeds, positions)]
    assert got.tolist() == want


def test_uniforms_fill_the_open_unit_interval_evenly() -> None:
    m = 200_000
    u = _uniforms(torch.randint(0, 2**63 - 1, (m,)), torch.randint(0, 2**20, (m,)))
    assert ((u > 0) & (u < 1)).all()
    assert _chi2(torch.histc(u, 64, 0, 1)) < _chi2_bound(63)
    row = token_uniforms(position_hashes(torch.tensor([7]), torch.tensor([3])), torch.arange(m))
    assert _chi2(torch.histc(row[0], 64, 0, 1)) < _chi2_bound(63)  # one row's tokens


def test_neighbours_are_independent() -> None:
    """Pairs (u(s, t), u(s, t + 1)), (u(s, t), u(s + 1, t)) and a position's two neighbouring
    tokens fill a 16 x 16 grid evenly, for small consecutive seeds (as `seed: i` requests send
    them) and positions from 0."""
    m = 100_000
    seeds = torch.arange(m) + random.randrange(2**40)
    positions = torch.randint(0, 64, (m,))
    token = random.randrange(49152)
    here = _uniforms(seeds, positions, token)
    for other in (_uniforms(seeds, positions + 1, token), _uniforms(seeds + 1, positions, token),
                  _uniforms(seeds, positions, token + 1)):  # fmt: skip
        cell = (here * 16).long() * 16 + (other * 16).long()
        counts = torch.bincount(cell, minlength=256).double()
        assert _chi2(counts) < _chi2_bound(255)
        assert abs(float(torch.corrcoef(torch.stack([here, other]))[0, 1])) < 0.02


def test_one_seed_never_repeats_a_uniform_soon_and_entropy_seeds_fit_the_range() -> None:
    seed = random.randrange(2**63)
    u = _uniforms(torch.full((4096,), seed), torch.arange(4096))
    assert u.unique().numel() >= 4090  # 23-bit values: a few birthday collisions at most
    assert all(0 <= entropy_seed() < 2**63 for _ in range(100))


def test_exponentials_have_unit_mean_and_no_zero() -> None:
    e = exponentials(
        _uniforms(torch.randint(0, 2**63 - 1, (200_000,)), torch.zeros(200_000, dtype=torch.long))
    )
    assert (e > 0).all() and torch.isfinite(e).all()
    assert abs(float(e.mean()) - 1) < 0.01 and abs(float(e.var()) - 1) < 0.03


def test_a_random_seed_gives_unseeded_requests_one_sequence_of_seeds() -> None:
    """--random-seed: a request's own seed is kept, and the n-th unseeded request gets the
    generator's n-th seed whatever seeded requests come between; another seed or none gives
    other seeds."""
    random_seed = random.randrange(2**32)
    owns = [None if random.random() < 0.6 else random.randrange(2**63) for _ in range(40)]
    got = [RequestSeeds(random_seed).seed_for(None)]  # a fresh generator's first
    seeds = RequestSeeds(random_seed)
    assigned = [seeds.seed_for(own) for own in owns]
    assert [s for s, own in zip(assigned, owns) if own is not None] == [
        o for o in owns if o is not None
    ]
    unseeded = [s for s, own in zip(assigned, owns) if own is None]
    fresh = RequestSeeds(random_seed)
    assert [fresh.seed_for(None) for _ in unseeded] == unseeded and unseeded[:1] == got
    assert all(0 <= s < 2**63 for s in unseeded) and len(set(unseeded)) == len(unseeded)
    other = RequestSeeds(random_seed + 1)
    assert [other.seed_for(None) for _ in unseeded] != unseeded
    assert RequestSeeds(None).seed_for(None) != RequestSeeds(None).seed_for(None)

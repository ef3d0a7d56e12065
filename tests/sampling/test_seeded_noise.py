"""Position-keyed sampling noise (sampling/seeded_noise.py): the documented hash, computed in
int64 tensor ops without overflow over the whole seed range, gives uniforms that look
independent across positions of one seed and across neighbouring seeds (a request's n
choices are seeds one apart)."""

from __future__ import annotations

import math
import random

import torch

from eagleserve.sampling.seeded_noise import RequestSeeds, entropy_seed, position_uniforms

M32 = 0xFFFFFFFF


def _mix32(x: int) -> int:
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & M32
    return x ^ (x >> 16)


def _reference(seed: int, position: int) -> float:
    h = _mix32(position & M32)
    h = _mix32(h ^ (seed & M32))
    h = _mix32(h ^ (seed >> 32))
    return (h >> 8) / 2**24


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
    got = position_uniforms(torch.tensor(seeds), torch.tensor(positions))
    assert got.dtype == torch.float32
    assert got.tolist() == [_reference(s, p) for s, p in zip(seeds, positions)]


def test_uniforms_fill_the_unit_interval_evenly() -> None:
    m = 200_000
    u = position_uniforms(torch.randint(0, 2**63 - 1, (m,)), torch.randint(0, 2**20, (m,)))
    assert ((u >= 0) & (u < 1)).all()
    assert _chi2(torch.histc(u, 64, 0, 1)) < _chi2_bound(63)


def test_neighbouring_positions_and_seeds_are_independent() -> None:
    """Pairs (u(s, t), u(s, t + 1)) and (u(s, t), u(s + 1, t)) fill a 16 x 16 grid evenly, for
    small consecutive seeds (as `seed: i` requests send them) and positions from 0."""
    m = 100_000
    seeds = torch.arange(m) + random.randrange(2**40)
    positions = torch.randint(0, 64, (m,))
    here = position_uniforms(seeds, positions)
    for other in (position_uniforms(seeds, positions + 1), position_uniforms(seeds + 1, positions)):
        cell = (here * 16).long() * 16 + (other * 16).long()
        counts = torch.bincount(cell, minlength=256).double()
        assert _chi2(counts) < _chi2_bound(255)
        assert abs(float(torch.corrcoef(torch.stack([here, other]))[0, 1])) < 0.02


def test_one_seed_never_repeats_a_uniform_soon_and_entropy_seeds_fit_the_range() -> None:
    seed = random.randrange(2**63)
    u = position_uniforms(torch.full((4096,), seed), torch.arange(4096))
    assert u.unique().numel() >= 4090  # 24-bit values: a few birthday collisions at most
    assert all(0 <= entropy_seed() < 2**63 for _ in range(100))


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

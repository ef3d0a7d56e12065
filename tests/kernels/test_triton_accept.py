"""The one-launch greedy walk (kernels/triton_accept.py) against the torch walk it replaces
(spec/accept.py's `packed_greedy`), on fresh random chains and trees."""

from __future__ import annotations

import pytest
import torch
from triton_mode import DEVICE  # before triton is imported: picks the interpreter without a GPU

pytest.importorskip("triton")

from eagleserve.kernels.triton_accept import greedy_accept  # noqa: E402
from eagleserve.spec.accept import packed_greedy, unpack_walk  # noqa: E402


def random_tree(bs: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """An ancestor-or-self mask [bs, n, n] of random trees in node order (each node's parent a
    lower index; deep and wide shapes both occur; row 0 a chain), and their deepest path."""
    mask = torch.zeros(bs, n, n, dtype=torch.bool)
    depth = torch.zeros(bs, n, dtype=torch.long)
    for i in range(n):
        mask[:, i, i] = True
        if i == 0:
            continue
        # Parent i - 1 half the time (long paths), else any earlier node; row 0 a chain.
        any_earlier = torch.randint(0, i, (bs,), generator=gen)
        parent = torch.where(torch.rand(bs, generator=gen) < 0.5, i - 1, any_earlier)
        parent[0] = i - 1
        rows = torch.arange(bs)
        mask[rows, i] |= mask[rows, parent]
        depth[:, i] = depth[rows, parent] + 1
    return mask, int(depth.max())


def check(tokens: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor | None,
          depth: int | None) -> torch.Tensor:  # fmt: skip
    want = packed_greedy(tokens, logits, mask, depth)
    got = packed_greedy(
        tokens.to(DEVICE),
        logits.to(DEVICE),
        None if mask is None else mask.to(DEVICE),
        depth,
        kernel=True,
    )
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got.cpu(), want)
    return want


@pytest.mark.parametrize(("bs", "n"), [(1, 2), (5, 4), (16, 6)])
def test_the_kernel_walks_a_chain_as_the_torch_ops_do(bs: int, n: int) -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    lens = set()
    for _ in range(4):
        vocab = 3  # small: rejections, partial and full runs all occur
        logits = torch.randn(bs * n, vocab, generator=gen)
        tokens = torch.randint(0, vocab, (bs, n), generator=gen)
        lens |= set(unpack_walk(check(tokens, logits, None, None)).accept_lens.tolist())
    assert 1 in lens and (bs == 1 or len(lens) > 1)


@pytest.mark.parametrize(("bs", "n"), [(3, 5), (16, 8), (8, 11)])
def test_the_kernel_walks_a_tree_as_the_torch_ops_do(bs: int, n: int) -> None:
    """Trees with duplicate siblings (a 3-token vocabulary), the walk bounded at the trees'
    deepest path and at the widest bound (n - 1)."""
    seed = int(torch.randint(0, 10**6, ()))
    gen = torch.Generator().manual_seed(seed)
    longest = 1
    for _ in range(4):
        mask, depth = random_tree(bs, n, gen)
        logits = torch.randn(bs * n, 3, generator=gen)
        tokens = torch.randint(0, 3, (bs, n), generator=gen)
        # Row 0 drafts the target's own tokens: its walk goes all the way down its chain.
        tokens[0, 1:] = logits.view(bs, n, 3)[0, :-1].argmax(-1)
        for bound in (depth, n - 1):
            packed = check(tokens, logits, mask, bound)
            longest = max(longest, int(unpack_walk(packed).accept_lens.max()))
    assert longest == n, seed  # row 0's walk went past every depth


def test_an_empty_batch_launches_nothing() -> None:
    out = greedy_accept(torch.zeros(0, 4, dtype=torch.long, device=DEVICE),
                        torch.zeros(0, 4, dtype=torch.long, device=DEVICE))  # fmt: skip
    assert out.shape == (0, 10)

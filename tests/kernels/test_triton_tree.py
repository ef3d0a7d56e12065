"""A top-k draft's verify tree in one launch (kernels/triton_tree.py) against the torch ops it
replaces (spec/tree.py's `build_tree`), on trees drafted from fresh random distributions."""

from __future__ import annotations

import pytest
import torch
from triton_mode import DEVICE  # before triton is imported: picks the interpreter without a GPU

pytest.importorskip("triton")

from eagleserve.spec.tree import (  # noqa: E402
    build_tree,
    organize_draft_results,
    select_top_k_tokens,
)


def drafted(bs: int, topk: int, steps: int, n: int, gen: torch.Generator) -> tuple:
    """organize_draft_results' output of `steps` random top-k steps, and the roots' tokens."""
    score_list, token_list, parents_list = [], [], []
    logits = torch.randn(bs, 50, generator=gen)
    logits[0] *= 30  # request 0's first branch is near-certain at every step: a deep tree
    p, idx = torch.softmax(logits, -1).topk(topk)
    hidden, scores = torch.randn(bs, 3, generator=gen), None
    for step in range(steps):
        _, hidden, scores, (s, t, par) = select_top_k_tokens(step, p, idx, hidden, scores, topk)
        score_list.append(s), token_list.append(t), parents_list.append(par)
        # Peaked rows sometimes: a branch then holds several of the selected nodes.
        logits = torch.randn(bs * topk, 50, generator=gen) * (1 + 4 * torch.rand(1, generator=gen))
        logits[0] *= 30
        p, idx = torch.softmax(logits, -1).topk(topk)
    roots = torch.randint(0, 50, (bs,), generator=gen)
    return roots, *organize_draft_results(score_list, token_list, parents_list, n)


@pytest.mark.parametrize(("topk", "steps", "n"), [(2, 1, 3), (4, 3, 8), (3, 4, 10), (2, 5, 12)])
def test_the_kernel_builds_the_torch_tree(topk: int, steps: int, n: int) -> None:
    seed = int(torch.randint(0, 10**6, ()))
    gen = torch.Generator().manual_seed(seed)
    deepest = 0
    for _ in range(3):
        inputs = drafted(8, topk, steps, n, gen)
        want = build_tree(*inputs, topk, n, validate=True)
        got = build_tree(*(x.to(DEVICE) for x in inputs), topk, n, kernel=True)
        for name in ("draft_tokens", "parents", "depths", "tree_mask"):
            assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), (name, seed)
        deepest = max(deepest, int(want.depths.max()))
    assert deepest == min(steps, n - 1), seed  # request 0's tree went all the way down

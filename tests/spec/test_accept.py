"""Tree verification (eagleserve.spec.accept): the greedy walk and the commit of its path;
sampled rows are test_accept_sampling.py's."""

from __future__ import annotations

import pytest
import torch

from eagleserve.spec.accept import (
    AcceptResult,
    commit_tree_path,
    packed_greedy,
    unpack_walk,
    verify_greedy,
    verify_greedy_chain,
)
from eagleserve.spec.tree import (
    TreeInfo,
    build_tree,
    organize_draft_results,
    parents_from_mask,
    select_top_k_tokens,
)

# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _random_parents(bs: int, n: int, gen: torch.Generator, chain: bool) -> torch.Tensor:
    """[bs, n] parents with parents[:, 0] = -1 and parents[:, i] < i."""
    if chain:
        return torch.arange(-1, n - 1).repeat(bs, 1)
    par = torch.full((bs, n), -1, dtype=torch.long)
    for i in range(1, n):
        par[:, i] = torch.randint(0, i, (bs,), generator=gen)
    return par


def _check_result(res: AcceptResult, bs: int, n: int) -> None:
    assert res.accept_index.shape == (bs, n) and res.output_tokens.shape == (bs, n)
    assert res.accept_lens.shape == (bs,) and res.bonus_tokens.shape == (bs,)
    for t in (res.accept_index, res.accept_lens, res.output_tokens, res.bonus_tokens):
        assert t.dtype == torch.long
    assert (res.accept_index[:, 0] == 0).all()
    assert ((res.accept_lens >= 1) & (res.accept_lens <= n)).all()
    width = torch.arange(n)
    inside = width[None, :] < res.accept_lens[:, None]
    assert ((res.accept_index >= 0) == inside).all()
    assert ((res.output_tokens >= 0) == inside).all()
    assert torch.equal(
        res.output_tokens.gather(1, (res.accept_lens - 1)[:, None])[:, 0], res.bonus_tokens
    )
    assert torch.equal(
        res.last_node, res.accept_index.gather(1, (res.accept_lens - 1)[:, None])[:, 0]
    )


def _reference_greedy(tokens: list[int], parents: list[int], predict: list[int]) -> list[int]:
    """Plain walk: from the root, take the lowest-index child matching the target's argmax."""
    path = [0]
    while True:
        cur = path[-1]
        kids = [c for c in range(len(tokens)) if parents[c] == cur and tokens[c] == predict[cur]]
        if not kids:
            return path
        path.append(kids[0])


# ---------------------------------------------------------------------------------------------
# Greedy
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bs", "n", "vocab", "chain"),
    [
        (64, 1, 5, True),
        (64, 2, 3, True),
        (64, 5, 3, True),
        (64, 8, 2, True),
        (64, 4, 3, False),
        (64, 8, 3, False),
        (64, 12, 2, False),
        (32, 16, 4, False),
    ],
)
def test_greedy_matches_reference_walk(bs: int, n: int, vocab: int, chain: bool) -> None:
    gen = torch.Generator().manual_seed(bs * 100 + n * 7 + vocab + chain)
    for _ in range(5):
        parents = _random_parents(bs, n, gen, chain)
        tokens = torch.randint(0, vocab, (bs, n), generator=gen)  # small vocab: dup siblings
        predict = torch.randint(0, vocab, (bs, n), generator=gen)
        res = verify_greedy(tokens, parents, predict)
        _check_result(res, bs, n)
        for b in range(bs):
            path = _reference_greedy(tokens[b].tolist(), parents[b].tolist(), predict[b].tolist())
            a = len(path)
            assert res.accept_lens[b] == a
            assert res.accept_index[b, :a].tolist() == path
            expect_out = [int(tokens[b, c]) for c in path[1:]] + [int(predict[b, path[-1]])]
            assert res.output_tokens[b, :a].tolist() == expect_out
            assert res.bonus_tokens[b] == predict[b, path[-1]]


@pytest.mark.parametrize(("bs", "n", "vocab"), [(64, 1, 5), (64, 2, 2), (64, 4, 2), (33, 6, 3)])
def test_greedy_chain_equals_the_walk(bs: int, n: int, vocab: int) -> None:
    """The chain shortcut commits what the node walk commits on a chain, field for field
    (small vocabularies: rejections, partial and longer runs all occur)."""
    gen = torch.Generator().manual_seed(bs + 17 * n + vocab)
    parents = _random_parents(bs, n, gen, True)
    seen: set[int] = set()
    for _ in range(5):
        tokens = torch.randint(0, vocab, (bs, n), generator=gen)
        predict = torch.randint(0, vocab, (bs, n), generator=gen)
        walk = verify_greedy(tokens, parents, predict)
        fast = verify_greedy_chain(tokens, predict)
        for name in ("accept_index", "accept_lens", "output_tokens", "bonus_tokens"):
            assert torch.equal(getattr(fast, name), getattr(walk, name)), name
        seen |= set(walk.accept_lens.tolist())
    assert seen >= {1, min(n, 3)}


@pytest.mark.parametrize(("bs", "n"), [(1, 2), (7, 4), (16, 6)])
def test_packed_greedy_chain_unpacks_to_the_chain_walk(bs: int, n: int) -> None:
    """What a chain's verify graph computes (the argmax of its logits, walked and packed into
    one tensor) unpacks to `verify_greedy_chain` of that argmax, field for field."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    vocab = 3  # small: rejections, partial and full runs all occur
    logits = torch.randn(bs * n, vocab, generator=gen)
    tokens = torch.randint(0, vocab, (bs, n), generator=gen)
    got = unpack_walk(packed_greedy(tokens, logits))
    want = verify_greedy_chain(tokens, logits.argmax(-1).view(bs, n))
    for name in ("accept_index", "accept_lens", "output_tokens", "bonus_tokens"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize(("topk", "steps", "n"), [(2, 2, 4), (4, 3, 8), (3, 4, 10)])
def test_a_tree_verify_graph_walks_what_the_host_walks(topk: int, steps: int, n: int) -> None:
    """A tree's verify graph holds the ancestor mask, not the parents: the parents it reads off
    the mask are build_tree's, and its packed walk (depth-bounded by the draft steps) unpacks
    to the host's walk of the same argmax, field for field."""
    seed = int(torch.randint(0, 10**6, ()))
    gen = torch.Generator().manual_seed(seed)
    bs, vocab = 16, 3  # a small vocabulary: matches at every depth, duplicate siblings
    tree = _random_built_tree(bs, topk, steps, n, vocab, gen)
    assert torch.equal(parents_from_mask(tree.tree_mask), tree.parents), seed
    assert int(tree.depths.max()) <= steps
    logits = torch.randn(bs * n, vocab, generator=gen)
    got = unpack_walk(packed_greedy(tree.draft_tokens, logits, tree.tree_mask, steps))
    want = verify_greedy(tree.draft_tokens, tree.parents, logits.argmax(-1).view(bs, n))
    assert got.accept_index.shape == (bs, steps + 1)
    assert torch.equal(got.accept_lens, want.accept_lens), seed
    assert torch.equal(got.bonus_tokens, want.bonus_tokens), seed
    for name in ("accept_index", "output_tokens"):  # the same, narrower
        assert torch.equal(getattr(got, name), getattr(want, name)[:, : steps + 1]), name
        assert (getattr(want, name)[:, steps + 1 :] == -1).all()
    assert int(want.accept_lens.max()) > 1


def test_greedy_hand_built_tree() -> None:
    #        0 (root)
    #      /   |   \
    #     1:7  2:7  3:4         two children carry 7: the lower index (1) wins
    #     |    |
    #     4:5  5:9
    #     |
    #     6:2
    parents = torch.tensor([[-1, 0, 0, 0, 1, 2, 4]] * 3)
    tokens = torch.tensor([[11, 7, 7, 4, 5, 9, 2]] * 3)
    predict = torch.tensor(
        [
            [7, 5, 9, 0, 2, 0, 8],  # 0 -> 1 -> 4 -> 6, bonus 8
            [7, 3, 9, 0, 2, 0, 8],  # 0 -> 1, then 5 != 3: bonus 3
            [6, 5, 9, 0, 2, 0, 8],  # nothing matches: bonus 6
        ]
    )
    res = verify_greedy(tokens, parents, predict)
    assert res.accept_lens.tolist() == [4, 2, 1]
    assert res.accept_index.tolist() == [
        [0, 1, 4, 6, -1, -1, -1],
        [0, 1, -1, -1, -1, -1, -1],
        [0, -1, -1, -1, -1, -1, -1],
    ]
    assert res.output_tokens.tolist() == [
        [7, 5, 2, 8, -1, -1, -1],
        [7, 3, -1, -1, -1, -1, -1],
        [6, -1, -1, -1, -1, -1, -1],
    ]
    assert res.bonus_tokens.tolist() == [8, 3, 6]
    narrow = verify_greedy(tokens, parents, predict, max_depth=3)
    assert torch.equal(narrow.accept_index, res.accept_index[:, :4])
    assert torch.equal(narrow.output_tokens, res.output_tokens[:, :4])


def _random_built_tree(
    bs: int, topk: int, steps: int, n: int, vocab: int, gen: torch.Generator
) -> TreeInfo:
    """A verify tree from select/organize/build on random draft distributions (over 50 ids,
    then taken mod `vocab`: a small vocabulary gives duplicate siblings and many matches)."""
    score_list, token_list, parents_list = [], [], []
    p, idx = torch.softmax(torch.randn(bs, 50, generator=gen), -1).topk(topk)
    hidden, scores = torch.randn(bs, 3, generator=gen), None
    for step in range(steps):
        _, hidden, scores, (s, t, par) = select_top_k_tokens(step, p, idx, hidden, scores, topk)
        score_list.append(s), token_list.append(t % vocab), parents_list.append(par)
        p, idx = torch.softmax(torch.randn(bs * topk, 50, generator=gen), -1).topk(topk)
    return build_tree(
        torch.randint(0, vocab, (bs,), generator=gen),
        *organize_draft_results(score_list, token_list, parents_list, n),
        topk,
        n,
    )


def test_greedy_on_built_tree_follows_target_argmax() -> None:
    """Tree from select/organize/build; the target agrees on a random prefix of some path."""
    gen = torch.Generator().manual_seed(9)
    bs, topk, steps, n, vocab = 16, 2, 4, 9, 50
    tree = _random_built_tree(bs, topk, steps, n, vocab, gen)
    predict = torch.randint(0, vocab, (bs, n), generator=gen)
    # Make the target agree with the draft along the parent chain of a random node.
    for b in range(bs):
        node = int(torch.randint(1, n, (1,), generator=gen))
        while node > 0:
            par = int(tree.parents[b, node])
            predict[b, par] = tree.draft_tokens[b, node]
            node = par
    res = verify_greedy(tree.draft_tokens, tree.parents, predict)
    _check_result(res, bs, n)
    assert (res.accept_lens >= 2).all()
    for b in range(bs):
        path = _reference_greedy(
            tree.draft_tokens[b].tolist(), tree.parents[b].tolist(), predict[b].tolist()
        )
        assert res.accept_index[b, : len(path)].tolist() == path


@pytest.mark.parametrize(("topk", "steps", "n"), [(2, 2, 4), (4, 3, 8), (3, 4, 10)])
def test_commit_puts_the_accepted_path_first_and_keeps_every_slot(
    topk: int, steps: int, n: int
) -> None:
    """After a verify's commit, positions L, L + 1, ... hold the accepted nodes' slots in path
    order, then the rejected nodes' slots in node order; other positions and rows are
    untouched, and each row owns the slots it owned."""
    seed = int(torch.randint(0, 10**6, ()))
    gen = torch.Generator().manual_seed(seed)
    bs = 12
    tree = _random_built_tree(bs, topk, steps, n, 3, gen)
    logits = torch.randn(bs * n, 3, generator=gen)
    acc = verify_greedy(tree.draft_tokens, tree.parents, logits.argmax(-1).view(bs, n),
                        max_depth=steps)  # fmt: skip
    r2t = torch.randperm(40 * (bs + 3), generator=gen).view(bs + 3, 40)
    before = r2t.clone()
    rpi = torch.randperm(bs + 3, generator=gen)[:bs]
    L = torch.randint(0, 40 - n, (bs,), generator=gen)
    commit_tree_path(r2t, rpi, L, acc.accept_index, n)
    for b in range(bs):
        r, lo = int(rpi[b]), int(L[b])
        old = before[r, lo : lo + n].tolist()
        path = [int(i) for i in acc.accept_index[b] if i >= 0]
        rest = [i for i in range(n) if i not in path]
        assert r2t[r, lo : lo + n].tolist() == [old[i] for i in path + rest], seed
        assert torch.equal(r2t[r, :lo], before[r, :lo])
        assert torch.equal(r2t[r, lo + n :], before[r, lo + n :])
    untouched = [i for i in range(bs + 3) if i not in rpi.tolist()]
    assert torch.equal(r2t[untouched], before[untouched])
    assert int(acc.accept_lens.max()) > 1

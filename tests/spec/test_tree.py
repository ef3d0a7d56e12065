"""Draft expansion, selection and verify-tree construction (eagleserve.spec.tree)."""

from __future__ import annotations

import itertools

import pytest
import torch

from eagleserve.spec.tree import (
    InvalidChainConfig,
    Topk1ChainBuffers,
    build_chain,
    build_tree,
    num_candidates,
    organize_draft_results,
    select_top_k_tokens,
)

VOCAB = 37


def _child_code(code: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """Bijective base-VOCAB code of a token path: code(path + [t]) = code(path) * V + t + 1."""
    return code * VOCAB + tok + 1


def _random_topk(rows: int, topk: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of a random peaky distribution: probabilities in (0, 1], distinct tokens per row."""
    logits = torch.randn(rows, VOCAB, generator=gen) * 3.0
    return torch.softmax(logits, dim=-1).topk(topk, dim=-1)


def _run_draft(
    bs: int,
    topk: int,
    num_steps: int,
    gen: torch.Generator,
    topk_fn=None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Simulates the draft loop; the "hidden state" carries the path code of each branch.

    Returns the three lists and, independently of the parent bookkeeping under test, the path
    code of every flat candidate [bs, num_candidates] (computed from the hidden states that
    select_top_k_tokens routes to each branch).
    """
    topk_fn = topk_fn or (lambda rows: _random_topk(rows, topk, gen))
    score_list, token_list, parents_list, codes = [], [], [], []
    root = torch.zeros(bs, 1, dtype=torch.long)  # code of the (empty) path at the root
    topk_p, topk_index = topk_fn(bs)  # [bs, topk]
    codes.append(_child_code(root, topk_index))  # [bs, topk]
    hidden, scores = root, None
    for step in range(num_steps):
        ids, hidden, scores, (s, t, p) = select_top_k_tokens(
            step, topk_p, topk_index, hidden, scores, topk
        )
        score_list.append(s)
        token_list.append(t)
        parents_list.append(p)
        if step == num_steps - 1:
            break
        # "Forward" each branch: its new hidden state is its own path code.
        branch_code = _child_code(hidden[:, 0], ids)  # [bs*topk]
        hidden = branch_code.unsqueeze(1)
        topk_p, topk_index = topk_fn(bs * topk)  # [bs*topk, topk]
        cand = _child_code(branch_code.unsqueeze(1), topk_index)  # [bs*topk, topk]
        codes.append(cand.view(bs, topk * topk))
    return score_list, token_list, parents_list, torch.cat(codes, dim=1)


def _check_tree(
    tree,
    verified_id: torch.Tensor,
    tsi: torch.Tensor,
    token_list: list[torch.Tensor],
    cand_codes: torch.Tensor,
    n: int,
) -> None:
    bs = verified_id.shape[0]
    assert tree.draft_tokens.shape == (bs, n) and tree.draft_tokens.dtype == torch.long
    assert tree.parents.shape == (bs, n) and tree.parents.dtype == torch.long
    assert tree.depths.shape == (bs, n) and tree.depths.dtype == torch.long
    assert tree.tree_mask.shape == (bs, n, n) and tree.tree_mask.dtype == torch.bool
    all_tokens = torch.cat(token_list, dim=1)
    for b in range(bs):
        par = tree.parents[b].tolist()
        dep = tree.depths[b].tolist()
        mask = tree.tree_mask[b]
        assert par[0] == -1 and dep[0] == 0
        assert tree.draft_tokens[b, 0] == verified_id[b]
        code = [0] * n
        for i in range(1, n):
            assert 0 <= par[i] < i, "parent must precede the node"
            assert dep[i] == dep[par[i]] + 1
            # Node tokens are the token_list entries of the selected candidates.
            assert tree.draft_tokens[b, i] == all_tokens[b, tsi[b, i - 1]]
            # The parent chain spells the path the draft actually expanded.
            code[i] = code[par[i]] * VOCAB + int(tree.draft_tokens[b, i]) + 1
            assert code[i] == cand_codes[b, tsi[b, i - 1]]
        for i in range(n):
            ancestors = set()
            j = i
            while j >= 0:
                ancestors.add(j)
                j = par[j]
            expect = torch.zeros(n, dtype=torch.bool)
            expect[list(ancestors)] = True
            assert torch.equal(mask[i], expect)
            assert dep[i] == len(ancestors) - 1  # depth = number of strict ancestors
        # Ancestor-closed: a node's mask row is its parent's plus itself.
        for i in range(1, n):
            row = mask[par[i]].clone()
            row[i] = True
            assert torch.equal(mask[i], row)


@pytest.mark.parametrize("topk", [1, 2, 3, 4])
@pytest.mark.parametrize("num_steps", [1, 2, 3, 4, 5])
def test_select_organize_build_random(topk: int, num_steps: int) -> None:
    gen = torch.Generator().manual_seed(1000 * topk + num_steps)
    bs = 5
    total = num_candidates(num_steps, topk)
    choices = sorted({1, 2, min(total, topk + 1) + 1, min(total, 8) + 1, total + 1})
    score_list, token_list, parents_list, cand_codes = _run_draft(bs, topk, num_steps, gen)
    assert cand_codes.shape == (bs, total)
    assert torch.cat(score_list, dim=1).flatten(1).shape == (bs, total)
    all_scores = torch.cat(score_list, dim=1).flatten(1)
    for n in choices:
        parent_list, tsi, draft = organize_draft_results(score_list, token_list, parents_list, n)
        assert parent_list.dtype == torch.long and tsi.dtype == torch.long
        assert tsi.shape == (bs, n - 1) and draft.shape == (bs, n - 1)
        assert parent_list.shape == (bs, 0 if num_steps == 1 else 1 + topk * (num_steps - 1))
        assert torch.equal(tsi, tsi.sort(dim=1).values)
        # The selection is the n-1 best scores.
        if 1 < n <= total:
            chosen = torch.zeros_like(all_scores, dtype=torch.bool).scatter_(1, tsi, True)
            worst_in = all_scores.masked_fill(~chosen, float("inf")).min(dim=1).values
            best_out = all_scores.masked_fill(chosen, -float("inf")).max(dim=1).values
            assert (worst_in >= best_out).all()
        verified = torch.randint(0, VOCAB, (bs,), generator=gen)
        tree = build_tree(verified, parent_list, tsi, draft, topk, n, validate=True)
        _check_tree(tree, verified, tsi, token_list, cand_codes, n)


def _quantized_topk(
    rows: int, topk: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities with many exact ties (powers of two, ones and zeros) between levels."""
    patterns = torch.tensor(
        [
            [1.0, 0.0, 0.0, 0.0],
            [0.5, 0.5, 0.0, 0.0],
            [0.5, 0.25, 0.25, 0.0],
            [0.25, 0.25, 0.25, 0.25],
            [1.0, 0.0, 0.0, 0.0],
        ]
    )
    pick = torch.randint(0, patterns.shape[0], (rows,), generator=gen)
    probs = patterns[pick, :topk]  # [rows, topk], descending like a real top-k
    tokens = torch.stack([torch.randperm(VOCAB, generator=gen)[:topk] for _ in range(rows)])
    return probs, tokens


@pytest.mark.parametrize("topk", [1, 2, 3, 4])
def test_ties_keep_selection_ancestor_closed(topk: int) -> None:
    """Children whose score equals their parent's (p = 1, or equal products) never displace it."""
    gen = torch.Generator().manual_seed(7 + topk)
    for num_steps in (2, 3, 5):
        bs = 16
        lists = _run_draft(bs, topk, num_steps, gen, lambda r: _quantized_topk(r, topk, gen))
        score_list, token_list, parents_list, cand_codes = lists
        total = num_candidates(num_steps, topk)
        all_scores = torch.cat(score_list, dim=1).flatten(1)
        assert (all_scores.unsqueeze(2) == all_scores.unsqueeze(1)).sum() > bs * total  # ties
        for n in range(2, total + 2):
            parent_list, tsi, draft = organize_draft_results(
                score_list, token_list, parents_list, n
            )
            # Reference: best n-1 scores, ties broken by the lower flat index.
            for b in range(bs):
                order = sorted(range(total), key=lambda f: (-float(all_scores[b, f]), f))
                assert tsi[b].tolist() == sorted(order[: n - 1])
            verified = torch.randint(0, VOCAB, (bs,), generator=gen)
            tree = build_tree(verified, parent_list, tsi, draft, topk, n, validate=True)
            _check_tree(tree, verified, tsi, token_list, cand_codes, n)


def test_build_tree_validate_detects_open_selection() -> None:
    """Scores that are not probabilities can break closure; validate=True reports it."""
    gen = torch.Generator().manual_seed(3)
    score_list, token_list, parents_list, _ = _run_draft(2, 2, 3, gen)
    parent_list, _, _ = organize_draft_results(score_list, token_list, parents_list, 4)
    tsi = torch.tensor([[0, 1, 8], [0, 1, 9]])  # flat 8/9 descend from unselected step-1 nodes
    draft = torch.cat(token_list, dim=1).gather(1, tsi)
    with pytest.raises(ValueError):
        build_tree(torch.tensor([1, 2]), parent_list, tsi, draft, 2, 4, validate=True)


@pytest.mark.parametrize("num_steps", [1, 2, 3, 4, 5])
def test_chain_tree_is_trivial(num_steps: int) -> None:
    gen = torch.Generator().manual_seed(num_steps)
    bs, n = 3, num_steps + 1
    score_list, token_list, parents_list, _ = _run_draft(bs, 1, num_steps, gen)
    parent_list, tsi, draft = organize_draft_results(score_list, token_list, parents_list, n)
    verified = torch.randint(0, VOCAB, (bs,), generator=gen)
    tree = build_tree(verified, parent_list, tsi, draft, 1, n, validate=True)
    assert torch.equal(tree.parents, torch.arange(-1, n - 1).expand(bs, n))
    assert torch.equal(tree.depths, torch.arange(n).expand(bs, n))
    assert torch.equal(tree.tree_mask, torch.ones(n, n, dtype=torch.bool).tril().expand(bs, n, n))
    assert torch.equal(tree.draft_tokens[:, 1:], torch.cat(token_list, dim=1))
    seq_lens = torch.randint(5, 50, (bs,), generator=gen)
    assert torch.equal(tree.positions(seq_lens), seq_lens[:, None] + torch.arange(n))


@pytest.mark.parametrize("num_steps", [1, 2, 3, 5])
def test_build_chain_equals_build_tree_for_chains(num_steps: int) -> None:
    gen = torch.Generator().manual_seed(200 + num_steps)
    n = num_steps + 1
    for bs in (1, 4, 7):
        score_list, token_list, parents_list, _ = _run_draft(bs, 1, num_steps, gen)
        parent_list, tsi, draft = organize_draft_results(score_list, token_list, parents_list, n)
        verified = torch.randint(0, VOCAB, (bs,), generator=gen)
        slow = build_tree(verified, parent_list, tsi, draft, 1, n, validate=True)
        fast = build_chain(verified, torch.cat(token_list, dim=1))
        for name in ("draft_tokens", "parents", "depths", "tree_mask"):
            a, b = getattr(fast, name), getattr(slow, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name


def _assert_same(fast: tuple, slow: tuple) -> None:
    for f, s in zip(fast, slow, strict=True):
        assert f.shape == s.shape
        assert f.dtype == s.dtype
        assert torch.equal(f, s)
    assert fast[0].dtype == torch.long and fast[1].dtype == torch.long
    assert fast[0].is_contiguous() and fast[1].is_contiguous()


def _chain_organized(
    buffers: Topk1ChainBuffers, token_list: list[torch.Tensor], num_steps: int
) -> tuple[torch.Tensor, ...]:
    """What draft_tree.draft_chain returns for a chain's tokens."""
    parents, score_index = buffers.constants(token_list[0].shape[0], num_steps)
    return parents, score_index, torch.cat(token_list, dim=1)


@pytest.mark.parametrize("num_steps", [1, 2, 3, 4, 5])
def test_chain_fast_path_matches_slow_path(num_steps: int) -> None:
    gen = torch.Generator().manual_seed(100 + num_steps)
    max_bs = 6
    buffers = Topk1ChainBuffers(max_bs, num_steps, num_steps + 1, "cpu")
    for bs in (1, 3, max_bs, max_bs + 1, 2 * max_bs + 3):
        score_list, token_list, parents_list, _ = _run_draft(bs, 1, num_steps, gen)
        slow = organize_draft_results(score_list, token_list, parents_list, num_steps + 1)
        fast = _chain_organized(buffers, token_list, num_steps)
        _assert_same(fast, slow)
        if bs <= max_bs:  # served from the preallocated buffers
            assert fast[0].data_ptr() == buffers._topk1_parents_prealloc.data_ptr()
            assert fast[1].data_ptr() == buffers._topk1_score_indices_prealloc.data_ptr()
        else:  # batch larger than the buffers: built afresh, same values
            assert fast[1].data_ptr() != buffers._topk1_score_indices_prealloc.data_ptr()


def test_chain_buffers_rebuild_for_new_num_steps() -> None:
    gen = torch.Generator().manual_seed(11)
    buffers = Topk1ChainBuffers(4, 3, 4, "cpu")
    for num_steps in (1, 5, 2, 4):
        # Stale buffers: another chain's constants are built afresh.
        score_list, token_list, parents_list, _ = _run_draft(3, 1, num_steps, gen)
        slow = organize_draft_results(score_list, token_list, parents_list, num_steps + 1)
        _assert_same(_chain_organized(buffers, token_list, num_steps), slow)
        buffers._rebuild_topk1_chain_buffers(num_steps, num_steps + 1)
        assert buffers._topk1_parents_prealloc.shape == (4, slow[0].shape[1])
        assert buffers._topk1_score_indices_prealloc.shape == (4, num_steps)
        fast = _chain_organized(buffers, token_list, num_steps)
        _assert_same(fast, slow)
        assert fast[1].data_ptr() == buffers._topk1_score_indices_prealloc.data_ptr()


@pytest.mark.parametrize(
    ("num_steps", "num_draft_tokens"), [(3, 3), (3, 5), (1, 1), (0, 1), (2, 0), (-1, 0)]
)
def test_chain_buffers_reject_invalid_config(num_steps: int, num_draft_tokens: int) -> None:
    with pytest.raises(AssertionError):
        Topk1ChainBuffers(4, num_steps, num_draft_tokens, "cpu")
    buffers = Topk1ChainBuffers(4, 2, 3, "cpu")
    with pytest.raises(InvalidChainConfig):
        buffers._rebuild_topk1_chain_buffers(num_steps, num_draft_tokens)
    with pytest.raises(ValueError):
        buffers._rebuild_topk1_chain_buffers(num_steps, num_draft_tokens)
    assert buffers.num_steps == 2  # a failed rebuild leaves the old buffers in place


def test_organize_rejects_too_many_draft_tokens() -> None:
    gen = torch.Generator().manual_seed(5)
    score_list, token_list, parents_list, _ = _run_draft(2, 2, 2, gen)
    with pytest.raises(ValueError):
        organize_draft_results(score_list, token_list, parents_list, num_candidates(2, 2) + 2)


def test_select_top_k_tokens_shapes_and_offsets() -> None:
    gen = torch.Generator().manual_seed(21)
    for topk, bs, h in itertools.product((1, 2, 3), (1, 4), (1, 8)):
        p0, i0 = _random_topk(bs, topk, gen)
        hid0 = torch.randn(bs, h, generator=gen)
        ids, hid, scores, (s, t, par) = select_top_k_tokens(0, p0, i0, hid0, None, topk)
        assert ids.shape == (bs * topk,) and hid.shape == (bs * topk, h)
        assert torch.equal(scores, p0) and s.shape == (bs, 1, topk) and torch.equal(t, i0)
        assert par.dtype == torch.long and torch.equal(par, torch.arange(-1, topk).expand(bs, -1))
        hid1 = torch.randn(bs * topk, h, generator=gen)
        for step in (1, 3):
            p1, i1 = _random_topk(bs * topk, topk, gen)
            ids2, hid2, sc2, (s2, t2, par2) = select_top_k_tokens(step, p1, i1, hid1, scores, topk)
            expand = scores[:, :, None] * p1.view(bs, topk, topk)
            assert torch.equal(s2, expand) and torch.equal(t2, i1.view(bs, topk * topk))
            chosen = par2 - (topk * topk * (step - 1) + topk)  # [bs, topk]
            assert ((chosen >= 0) & (chosen < topk * topk)).all()
            assert torch.equal(sc2, expand.flatten(1).gather(1, chosen))
            assert torch.equal(sc2, expand.flatten(1).topk(topk).values)
            assert torch.equal(ids2, t2.gather(1, chosen).flatten())
            rows = (chosen // topk + torch.arange(bs)[:, None] * topk).flatten()
            assert torch.equal(hid2, hid1[rows])

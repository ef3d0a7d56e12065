"""Tree verification (eagleserve.spec.accept): greedy walk and lossless sampling."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from eagleserve.spec.accept import (
    AcceptResult,
    verify_greedy,
    verify_greedy_chain,
    verify_sampling,
)
from eagleserve.spec.tree import (
    Topk1ChainBuffers,
    build_tree,
    organize_draft_results,
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


def test_greedy_on_built_tree_follows_target_argmax() -> None:
    """Tree from select/organize/build; the target agrees on a random prefix of some path."""
    gen = torch.Generator().manual_seed(9)
    bs, topk, steps, n, vocab = 16, 2, 4, 9, 50
    score_list, token_list, parents_list = [], [], []
    p, idx = torch.softmax(torch.randn(bs, vocab, generator=gen), -1).topk(topk)
    hidden, scores = torch.randn(bs, 3, generator=gen), None
    for step in range(steps):
        _, hidden, scores, (s, t, par) = select_top_k_tokens(step, p, idx, hidden, scores, topk)
        score_list.append(s), token_list.append(t), parents_list.append(par)
        p, idx = torch.softmax(torch.randn(bs * topk, vocab, generator=gen), -1).topk(topk)
    tree = build_tree(
        torch.randint(0, vocab, (bs,), generator=gen),
        *organize_draft_results(score_list, token_list, parents_list, n),
        topk,
        n,
    )
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


# ---------------------------------------------------------------------------------------------
# Sampling: mechanics
# ---------------------------------------------------------------------------------------------


def _reference_sampling(
    tokens: list[int], parents: list[int], probs: torch.Tensor, u: list[float]
) -> tuple[list[int], int]:
    """Plain walk with the documented randomness: u[c] tests node c, u[0] draws the bonus."""
    path = [0]
    p = probs[0].double().clone()
    for c in range(1, len(tokens)):
        if parents[c] != path[-1]:
            continue
        if u[c] < float(p[tokens[c]] / p.sum()):
            path.append(c)
            p = probs[c].double().clone()
        else:
            p[tokens[c]] = 0.0
    cdf = torch.cumsum(p, 0)
    bonus = int(torch.searchsorted(cdf, u[0] * cdf[-1], right=True))
    return path, bonus


@pytest.mark.parametrize(("n", "vocab", "chain"), [(4, 5, True), (7, 4, False), (12, 3, False)])
def test_sampling_matches_reference_walk(n: int, vocab: int, chain: bool) -> None:
    gen = torch.Generator().manual_seed(n * 31 + vocab)
    bs = 48
    parents = _random_parents(bs, n, gen, chain)
    tokens = torch.randint(0, vocab, (bs, n), generator=gen)
    probs = torch.softmax(torch.randn(bs, n, vocab, generator=gen) * 2, dim=-1)
    seeds = [int(s) for s in torch.randint(0, 2**31, (bs,), generator=gen)]
    res = verify_sampling(tokens, parents, probs, [torch.Generator().manual_seed(s) for s in seeds])
    _check_result(res, bs, n)
    for b in range(bs):
        u = torch.rand(n, generator=torch.Generator().manual_seed(seeds[b])).tolist()
        path, bonus = _reference_sampling(tokens[b].tolist(), parents[b].tolist(), probs[b], u)
        assert res.accept_index[b, : len(path)].tolist() == path
        assert res.accept_lens[b] == len(path)
        assert res.bonus_tokens[b] == bonus


def test_sampling_with_one_hot_probs_is_greedy() -> None:
    gen = torch.Generator().manual_seed(4)
    bs, n, vocab = 128, 9, 3
    parents = _random_parents(bs, n, gen, chain=False)
    tokens = torch.randint(0, vocab, (bs, n), generator=gen)
    predict = torch.randint(0, vocab, (bs, n), generator=gen)
    probs = torch.nn.functional.one_hot(predict, vocab).float()
    greedy = verify_greedy(tokens, parents, predict)
    sampled = verify_sampling(tokens, parents, probs, None)
    for name in ("accept_index", "accept_lens", "output_tokens", "bonus_tokens"):
        assert torch.equal(getattr(greedy, name), getattr(sampled, name)), name


def test_sampling_seeds_are_per_request() -> None:
    gen = torch.Generator().manual_seed(8)
    bs, n, vocab = 6, 6, 8
    parents = _random_parents(bs, n, gen, chain=False)
    tokens = torch.randint(0, vocab, (bs, n), generator=gen)
    probs = torch.softmax(torch.randn(bs, n, vocab, generator=gen), dim=-1)

    def run(seeds: list[int | None], rows: list[int]) -> AcceptResult:
        gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
        return verify_sampling(tokens[rows], parents[rows], probs[rows], gens)

    rows = list(range(bs))
    a = run([10, 11, 12, 13, 14, 15], rows)
    b = run([10, 11, 12, 13, 14, 15], rows)
    for name in ("accept_index", "accept_lens", "output_tokens", "bonus_tokens"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    # Same seed, different batch company (and an unseeded neighbour): same result per request.
    torch.manual_seed(123)
    c = run([None, 13, 10, None], [1, 3, 0, 5])
    for j, r in enumerate([3, 0]):
        assert torch.equal(c.accept_index[j + 1], a.accept_index[r])
        assert torch.equal(c.output_tokens[j + 1], a.output_tokens[r])
    # Different seeds give different draws: over many seeds the outputs must vary.
    outs = {tuple(run([s] * bs, rows).output_tokens.flatten().tolist()) for s in range(20)}
    assert len(outs) > 10


def test_sampling_never_accepts_a_duplicate_sibling_and_stays_lossless() -> None:
    """Root children carry tokens [2, 2, 0]: the second 2 is zeroed and can never be accepted."""
    torch.manual_seed(17)
    bs, vocab = 40000, 5
    parents = torch.tensor([-1, 0, 0, 0]).repeat(bs, 1)
    tokens = torch.tensor([1, 2, 2, 0]).repeat(bs, 1)
    target = torch.tensor([0.15, 0.05, 0.4, 0.1, 0.3])
    probs = torch.softmax(torch.randn(4, vocab), dim=-1).repeat(bs, 1, 1)
    probs[:, 0] = target
    res = verify_sampling(tokens, parents, probs, None)
    assert not (res.accept_index == 2).any()
    first = res.output_tokens[:, 0]
    freq = torch.bincount(first, minlength=vocab).double() / bs
    bound = 0.5 * sum(math.sqrt(p * (1 - p) / bs) for p in target.tolist())
    bound += math.sqrt(math.log(1e6) / (2 * bs))
    assert 0.5 * (freq - target.double()).abs().sum() < bound


def test_sampling_degenerate_rows_do_not_crash() -> None:
    """All-zero or underflowed rows: no NaN, valid tokens, the walk stops."""
    bs, n, vocab = 4, 4, 6
    parents = torch.arange(-1, n - 1).repeat(bs, 1)
    tokens = torch.tensor([[0, 1, 2, 3]] * bs)
    probs = torch.zeros(bs, n, vocab)
    probs[1, 0, 1] = 1e-40  # subnormal mass on the proposed token only
    probs[2, 0, 4] = 1.0
    probs[3, :, 5] = 1e-30
    res = verify_sampling(tokens, parents, probs, None)
    _check_result(res, bs, n)
    assert ((res.bonus_tokens >= 0) & (res.bonus_tokens < vocab)).all()
    assert res.bonus_tokens[2] == 4 and res.bonus_tokens[3] == 5
    assert res.accept_lens[0] == 1 and res.accept_lens[2] == 1


# ---------------------------------------------------------------------------------------------
# Sampling: losslessness end to end
# ---------------------------------------------------------------------------------------------

V = 6  # vocabulary of the toy models
EMIT = 3  # tokens compared
MAX_LEN = 5  # longest prefix looked up: 2 emitted + 3 draft levels
N_CODES = (V ** (MAX_LEN + 1) - 1) // (V - 1)  # bijective base-V codes of all prefixes


def _child(code: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    return code * V + tok + 1


def _toy_models() -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft next-token tables indexed by prefix code: [N_CODES, V] each.

    The target is peaky and keeps its top 4 tokens only (zero-probability tokens exist, so any
    leak of a draft token the target forbids is visible). The draft is a noisy copy: right
    often enough to accept, wrong often enough to exercise rejection and the residual.
    """
    gen = torch.Generator().manual_seed(2024)
    logits = torch.randn(N_CODES, V, generator=gen) * 1.5
    kth = logits.topk(4, dim=-1).values[:, -1:]
    target = torch.softmax(logits.masked_fill(logits < kth, -float("inf")), dim=-1)
    noise = torch.softmax(torch.randn(N_CODES, V, generator=gen) * 1.5, dim=-1)
    draft = 0.7 * target + 0.3 * noise
    return target, draft


def _exact_joint(target: torch.Tensor) -> torch.Tensor:
    """[V**EMIT] exact probability of each first-EMIT-token sequence under the target."""
    joint = torch.empty(V**EMIT, dtype=torch.float64)
    for k, seq in enumerate(itertools.product(range(V), repeat=EMIT)):
        code, prob = 0, 1.0
        for t in seq:
            prob *= float(target[code, t])
            code = code * V + t + 1
        joint[k] = prob
    return joint


def _speculate(
    verify,
    target: torch.Tensor,
    draft: torch.Tensor,
    samples: int,
    topk: int,
    num_steps: int,
    num_draft_tokens: int,
    seed: int,
) -> torch.Tensor:
    """Runs speculative steps for `samples` independent sequences (the batch) until each has
    EMIT tokens; returns their first EMIT tokens [samples, EMIT]."""
    torch.manual_seed(seed)
    out = torch.full((samples, EMIT), -1, dtype=torch.long)
    count = torch.zeros(samples, dtype=torch.long)
    code = torch.zeros(samples, dtype=torch.long)  # prefix code of the emitted tokens
    chain = Topk1ChainBuffers(samples, num_steps, num_draft_tokens, "cpu") if topk == 1 else None
    while (count < EMIT).any():
        act = (count < EMIT).nonzero().squeeze(1)
        root = code[act]  # [bs]
        bs = act.shape[0]
        # Draft: expand by the draft table; the "hidden state" is the branch's prefix code.
        topk_p, topk_index = draft[root].topk(topk, dim=-1)
        hidden, scores = root.unsqueeze(1), None
        lists: tuple[list, list, list] = ([], [], [])
        for step in range(num_steps):
            ids, hidden, scores, entries = select_top_k_tokens(
                step, topk_p, topk_index, hidden, scores, topk
            )
            for lst, e in zip(lists, entries, strict=True):
                lst.append(e)
            if step == num_steps - 1:
                break
            branch = _child(hidden[:, 0], ids)  # [bs*topk]
            hidden = branch.unsqueeze(1)
            topk_p, topk_index = draft[branch].topk(topk, dim=-1)
        organized = (
            chain.organize(*lists, num_draft_tokens)
            if chain is not None
            else organize_draft_results(*lists, num_draft_tokens)
        )
        tree = build_tree(torch.randint(0, V, (bs,)), *organized, topk, num_draft_tokens)
        # Target distribution after every node: look up the node's prefix code.
        node_code = torch.zeros(bs, num_draft_tokens, dtype=torch.long)
        node_code[:, 0] = root
        for i in range(1, num_draft_tokens):
            par_code = node_code.gather(1, tree.parents[:, i : i + 1])[:, 0]
            node_code[:, i] = _child(par_code, tree.draft_tokens[:, i])
        res = verify(tree.draft_tokens, tree.parents, target[node_code], None)
        # Commit the accepted tokens (only the first EMIT matter).
        for k in range(res.output_tokens.shape[1]):
            pos = count[act] + k
            take = (k < res.accept_lens) & (pos < EMIT)
            if not take.any():
                break
            rows = act[take]
            out[rows, pos[take]] = res.output_tokens[take, k]
            code[rows] = _child(code[rows], res.output_tokens[take, k])
        count[act] = (count[act] + res.accept_lens).clamp(max=EMIT)
    return out


def _tv(tokens: torch.Tensor, joint: torch.Tensor) -> float:
    flat = (tokens * torch.tensor([V * V, V, 1])).sum(dim=1)
    freq = torch.bincount(flat, minlength=V**EMIT).double() / tokens.shape[0]
    return 0.5 * float((freq - joint).abs().sum())


def _tv_bound(joint: torch.Tensor, samples: int, delta: float = 1e-6) -> float:
    """Upper bound on the TV of an exact sampler's empirical distribution, w.p. >= 1 - delta.

    E[TV] <= 0.5 * sum_k sqrt(p_k (1 - p_k) / N) (Jensen per cell; <= 0.5 sqrt(K / N) by
    Cauchy-Schwarz), and TV changes by at most 1/N when one sample changes, so McDiarmid adds
    sqrt(ln(1/delta) / (2N)).
    """
    mean = 0.5 * float((joint * (1 - joint) / samples).sqrt().sum())
    return mean + math.sqrt(math.log(1 / delta) / (2 * samples))


def _always_accept(tokens, parents, probs, generators) -> AcceptResult:
    """Wrong rule: follow the first child everywhere, bonus from the leaf's target row."""
    bs, n = tokens.shape
    first_child = torch.full((bs, n), -1, dtype=torch.long)
    for c in range(n - 1, 0, -1):  # descending: the lowest child index is written last
        first_child.scatter_(1, parents[:, c : c + 1], torch.full((bs, 1), c))
    predict = tokens.gather(1, first_child.clamp(min=0))
    res = verify_greedy(tokens, parents, predict)
    return _with_bonus_from_full_row(res, probs)


def _no_residual(tokens, parents, probs, generators) -> AcceptResult:
    """Wrong rule: correct acceptance, but the bonus ignores the rejected tokens."""
    return _with_bonus_from_full_row(verify_sampling(tokens, parents, probs, generators), probs)


def _with_bonus_from_full_row(res: AcceptResult, probs: torch.Tensor) -> AcceptResult:
    rows = probs[torch.arange(probs.shape[0]), res.last_node]
    bonus = torch.multinomial(rows, 1)[:, 0]
    out = res.output_tokens.clone()
    out.scatter_(1, (res.accept_lens - 1)[:, None], bonus[:, None])
    return AcceptResult(res.accept_index, res.accept_lens, out, bonus)


SAMPLES = 20000
CONFIGS = {"chain": (1, 3, 4), "tree": (2, 3, 6)}  # topk, num_steps, num_draft_tokens


@pytest.fixture(scope="module")
def toy() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    target, draft = _toy_models()
    return target, draft, _exact_joint(target)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_sampling_is_lossless(config: str, toy) -> None:
    target, draft, joint = toy
    out = _speculate(verify_sampling, target, draft, SAMPLES, *CONFIGS[config], seed=1)
    assert (out >= 0).all()
    flat = (out * torch.tensor([V * V, V, 1])).sum(dim=1)
    assert (joint[flat] > 0).all(), "emitted a sequence the target gives probability 0"
    tv, bound = _tv(out, joint), _tv_bound(joint, SAMPLES)
    assert tv < bound, (tv, bound)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_speculation_reproduces_target_argmax(config: str, toy) -> None:
    target, draft, _ = toy

    def greedy(tokens, parents, probs, generators):
        return verify_greedy(tokens, parents, probs.argmax(dim=-1))

    out = _speculate(greedy, target, draft, 64, *CONFIGS[config], seed=2)
    code, expect = 0, []
    for _ in range(EMIT):
        t = int(target[code].argmax())
        expect.append(t)
        code = code * V + t + 1
    assert (out == torch.tensor(expect)).all()


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("rule", [_always_accept, _no_residual])
def test_lossless_check_detects_wrong_rules(config: str, rule, toy) -> None:
    """The same statistic must reject sampling rules known to be biased."""
    target, draft, joint = toy
    out = _speculate(rule, target, draft, SAMPLES, *CONFIGS[config], seed=3)
    tv, bound = _tv(out, joint), _tv_bound(joint, SAMPLES)
    assert tv > 1.5 * bound, (tv, bound)

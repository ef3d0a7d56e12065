"""Penalties and logit bias as pure functions on tiny random tensors (CPU): each against a
per-element reference written from the definitions (OpenAI's presence/frequency penalties,
vLLM's repetition penalty, min_tokens, a sparse logit_bias), and the verify's per-node state
against committing the node's path token by token."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import reference_penalize

from eagleserve.core import Req, SamplingParams
from eagleserve.sampling.penalties import (
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    path_counts,
)
from eagleserve.sampling.penalty_state import BatchPenalties, PenaltyState
from eagleserve.spec.tree import build_tree

V = 11


def random_params(g: torch.Generator) -> SamplingParams:
    u = lambda lo, hi: lo + (hi - lo) * float(torch.rand(1, generator=g))
    bias = {int(t): u(-100, 100) for t in torch.randint(0, V, (3,), generator=g)}
    return SamplingParams(presence_penalty=u(-2, 2), frequency_penalty=u(-2, 2),
                          repetition_penalty=u(0.5, 2.0), logit_bias=bias)  # fmt: skip


def test_penalties_match_the_definitions() -> None:
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    rows = 6
    logits = torch.randn(rows, V, generator=g) * 3
    prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in range(2, 2 + rows)]
    outputs = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in range(rows)]
    params = [random_params(g) for _ in range(rows)]
    counts = torch.zeros(rows, V, dtype=torch.int32)
    prompt_mask = torch.zeros(rows, V, dtype=torch.bool)
    for i in range(rows):
        for t in outputs[i]:
            counts[i, t] += 1
        prompt_mask[i, prompts[i]] = True
    bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items()]
    got = apply_logit_bias(
        logits,
        torch.tensor([b[0] for b in bias]),
        torch.tensor([b[1] for b in bias]),
        torch.tensor([b[2] for b in bias]),
    )
    got = apply_penalties(
        got, counts, prompt_mask,
        torch.tensor([p.frequency_penalty for p in params]),
        torch.tensor([p.presence_penalty for p in params]),
        torch.tensor([p.repetition_penalty for p in params]),
    )  # fmt: skip
    for i in range(rows):
        want = reference_penalize(logits[i].tolist(), prompts[i], outputs[i], params[i])
        assert got[i].tolist() == pytest.approx(want, rel=1e-5, abs=1e-4), i


def test_neutral_rows_are_unchanged_bit_for_bit() -> None:
    logits = torch.randn(3, V) * 5
    counts = torch.randint(0, 4, (3, V), dtype=torch.int32)
    prompt = torch.rand(3, V) < 0.5
    out = apply_penalties(logits, counts, prompt, torch.zeros(3), torch.zeros(3), torch.ones(3))
    assert torch.equal(out, logits)


def test_logit_bias_adds_repeated_entries() -> None:
    logits = torch.randn(2, V)
    tok = int(torch.randint(0, V, (1,)))
    out = apply_logit_bias(logits, torch.tensor([1, 1, 0]), torch.tensor([tok, tok, tok]),
                           torch.tensor([2.5, -1.0, 7.0]))  # fmt: skip
    want = logits.clone()
    want[1, tok] += 1.5
    want[0, tok] += 7.0
    assert torch.allclose(out, want)


def test_min_tokens_masks_stop_tokens_only_below() -> None:
    logits = torch.randn(3, V)
    stop = int(torch.randint(0, V, (1,)))
    out_lens = torch.tensor([0, 4, 5])
    min_tokens = torch.tensor([1, 5, 5])
    out = apply_min_tokens(logits, out_lens, min_tokens, torch.tensor([0, 0, 1, 2]),
                           torch.tensor([stop, stop, stop, stop]))  # fmt: skip
    assert out[0, stop] == -math.inf and out[1, stop] == -math.inf
    assert out[2, stop] == logits[2, stop]
    keep = torch.ones(V, dtype=torch.bool)
    keep[stop] = False
    assert torch.equal(out[:, keep], logits[:, keep])


def random_tree(bs: int, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [bs, n], parents [bs, n]) of random trees in build_tree's node order."""
    parents = torch.full((bs, n), -1, dtype=torch.long)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (bs,), generator=g)
    return torch.randint(0, V, (bs, n), generator=g), parents


def ancestors_of(parents: torch.Tensor) -> torch.Tensor:
    bs, n = parents.shape
    mask = torch.zeros(bs, n, n, dtype=torch.bool)
    for b in range(bs):
        for i in range(n):
            j = i
            while j >= 0:
                mask[b, i, j] = True
                j = int(parents[b, j])
    return mask


def test_path_counts_follow_each_nodes_ancestors() -> None:
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    tokens, parents = random_tree(3, 7, g)
    got = path_counts(tokens, ancestors_of(parents), V)
    for b in range(3):
        for i in range(7):
            want = torch.zeros(V, dtype=torch.int32)
            j = i
            while j > 0:  # the root's token is committed already
                want[tokens[b, j]] += 1
                j = int(parents[b, j])
            assert torch.equal(got[b, i], want), (b, i)


def test_path_counts_of_a_chain_are_cumulative() -> None:
    tokens = torch.randint(0, V, (2, 5))
    chain = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 5, 5)
    got = path_counts(tokens, chain, V)
    for i in range(5):
        want = torch.nn.functional.one_hot(tokens[:, 1 : i + 1], V).sum(1).int()
        assert torch.equal(got[:, i], want)


def make_req(rid: str, slot: int, prompt: list[int], out: list[int], p: SamplingParams) -> Req:
    req = Req(rid, prompt, p, eos_token_ids=frozenset({V - 1}), output_ids=list(out))
    req.req_pool_idx = slot
    return req


def test_state_commits_match_host_counts() -> None:
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    state = PenaltyState(4, V, torch.device("cpu"))
    prompts = [torch.randint(0, V, (5,), generator=g).tolist() for _ in range(2)]
    state.reset([3, 1], prompts, [[2, 2], []])
    steps = torch.randint(0, V, (2, 3), generator=g)
    valid = torch.tensor([[True, True, False], [True, False, False]])
    state.commit(torch.tensor([3, 1]), steps, valid)
    counts, mask, lens = state.rows(torch.tensor([3, 1]))
    want = [[2, 2, *steps[0, :2].tolist()], steps[1, :1].tolist()]
    for i in range(2):
        assert counts[i].tolist() == [want[i].count(t) for t in range(V)]
        assert mask[i].tolist() == [t in prompts[i] for t in range(V)]
    assert lens.tolist() == [4, 1]


@pytest.mark.parametrize("topk", [1, 3], ids=["chain", "tree"])
def test_verify_nodes_see_the_state_of_their_path(topk: int) -> None:
    """Node i of a verify is penalized exactly as a decode would be after committing the
    tokens on i's path one by one (target-only decoding's state at that node)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    bs, n = 3, 6
    params = [random_params(g) for _ in range(bs)]
    params[1] = SamplingParams()  # a row without penalties stays as it is
    params[2].min_tokens, params[2].max_new_tokens = 4, 9
    prompts = [torch.randint(0, V, (4,), generator=g).tolist() for _ in range(bs)]
    outputs = [torch.randint(0, V, (k,), generator=g).tolist() for k in (3, 0, 1)]
    slots = torch.tensor([2, 0, 3])
    reqs = [make_req(f"r{i}", int(slots[i]), prompts[i], outputs[i], params[i]) for i in range(bs)]
    if topk == 1:
        tokens = torch.randint(0, V, (bs, n), generator=g)
        parents = torch.arange(-1, n - 1).expand(bs, n)
    else:
        tokens, parents = random_tree(bs, n, g)
    anc = ancestors_of(parents)
    depths = anc.sum(-1) - 1
    logits = torch.randn(bs, n, V, generator=g) * 4
    pen = BatchPenalties.of_reqs(reqs, V, torch.device("cpu"), prefill_rows=len(reqs))
    assert pen is not None and pen.rows.tolist() == [0, 2]
    state = PenaltyState(4, V, torch.device("cpu"))
    pen.reset(state)
    # The root (the bonus token) is committed before the verify, as a worker does.
    pen.commit(state, slots, tokens[:, :1])
    got = pen.verify_logits(logits, state, slots, tokens, anc, depths)
    assert torch.equal(got[1], logits[1])
    for b in (0, 2):
        for i in range(n):
            one = PenaltyState(4, V, torch.device("cpu"))
            path = [int(tokens[b, j]) for j in range(n) if anc[b, i, j]]
            one.reset([int(slots[b])], [prompts[b]], [outputs[b] + path])
            want = pen.next_logits(logits[:, i], one, slots)[b]
            assert torch.equal(got[b, i], want), (b, i)
    eos_below = got[2, :, V - 1] == -math.inf
    assert eos_below.tolist() == [len(outputs[2]) + int(d) + 1 < 4 for d in depths[2]]


def test_build_tree_masks_are_what_verify_uses() -> None:
    """The verify passes build_tree's `tree_mask` and `depths` as ancestors and depths."""
    bs, topk, m = 2, 2, 5
    verified = torch.randint(0, V, (bs,))
    # Candidates of a 3-step, top-2 draft: flat indices sorted, ancestor-closed (0, 1 at step
    # 0; their children at 2..5).
    tsi = torch.tensor([[0, 1, 2, 3, 6], [0, 1, 4, 5, 8]])
    parent_list = torch.tensor([[-1, 0, 1, 2, 3, 4, 5]] * bs)
    tree = build_tree(verified, parent_list, tsi, torch.randint(0, V, (bs, m)), topk, m + 1)
    assert torch.equal(tree.tree_mask, ancestors_of(tree.parents))
    assert torch.equal(tree.depths, tree.tree_mask.sum(-1) - 1)

"""spec/draft_tree.py: the chain draft (topk == 1) walks the chain directly; it must draft the
tree the general top-k walk builds for topk == 1 (parents, score order, tokens), feed each head
step the same tokens, features and paths, and hold for batches past its buffers too."""

from __future__ import annotations

import pytest
import torch

from eagleserve.core import EagleDraftInput
from eagleserve.spec.draft_tree import draft_chain, draft_tree
from eagleserve.spec.tree import Topk1ChainBuffers

VOCAB, HIDDEN = 97, 6


def recording_step(calls: list[tuple[torch.Tensor, ...]], seed: int):  # noqa: ANN201
    """A stand-in head step: tokens and features a fixed function of its inputs (random
    weights), probabilities random; records what it was given."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(HIDDEN, HIDDEN, generator=g)

    def step(ids, feats, depth, mask, paths):  # noqa: ANN001, ANN202
        calls.append((ids.clone(), feats.clone(), torch.tensor(depth),
                      torch.empty(0) if paths is None else paths.clone()))  # fmt: skip
        assert mask is None  # a chain has no draft-region mask
        nxt = torch.tanh(feats @ w + ids[:, None].float() / VOCAB)
        tokens = ((nxt.sum(-1) * 1000).long() + 13 * depth) % VOCAB
        p = torch.rand(ids.shape[0], 1, generator=g)
        return p, tokens[:, None], nxt

    return step


def random_seeds(bs: int, g: torch.Generator) -> EagleDraftInput:
    """Each request's seed: its first draft's probability, its token and its features."""
    return EagleDraftInput(
        torch.rand(bs, 1, generator=g),
        torch.randint(0, VOCAB, (bs, 1), generator=g),
        torch.randn(bs, HIDDEN, generator=g),
    )


@pytest.mark.parametrize("num_steps", [1, 2, 5])
@pytest.mark.parametrize("bs", [3, 9])  # 9: past the buffers (their constants built afresh)
@pytest.mark.parametrize("track", [False, True])
def test_chain_draft_is_the_topk1_tree(num_steps: int, bs: int, track: bool) -> None:
    seed = int(torch.randint(0, 2**31, ()))
    info = random_seeds(bs, torch.Generator().manual_seed(seed))
    buffers = Topk1ChainBuffers(4, num_steps, num_steps + 1, "cpu")
    fast_calls: list[tuple[torch.Tensor, ...]] = []
    slow_calls: list[tuple[torch.Tensor, ...]] = []
    fast = draft_chain(info, num_steps, recording_step(fast_calls, seed), buffers, track)
    slow = draft_tree(info, num_steps, 1, num_steps + 1, recording_step(slow_calls, seed), track)
    assert torch.equal(fast.draft_tokens, slow.draft_tokens)
    assert torch.equal(fast.parent_list, slow.parent_list)
    assert torch.equal(fast.top_scores_index, slow.top_scores_index)
    assert fast.draft_tokens.shape == (bs, num_steps)
    assert len(fast_calls) == len(slow_calls) == num_steps - 1
    for a, b in zip(fast_calls, slow_calls, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def probability_step(probs: list[torch.Tensor], seed: int):  # noqa: ANN201
    """`recording_step` whose probabilities are kept in `probs` (one [bs, 1] per step)."""
    inner = recording_step([], seed)

    def step(ids, feats, depth, mask, paths):  # noqa: ANN001, ANN202
        p, tokens, nxt = inner(ids, feats, depth, mask, paths)
        probs.append(p)
        return p, tokens, nxt

    return step


@pytest.mark.parametrize("bs", [1, 3, 9])
def test_a_chain_stops_where_no_request_has_a_likely_path(bs: int) -> None:
    """With min_path_prob, the chain drafts while some request's product of draft probabilities
    (the seed's, then each step's) is at least it: the drafts are a prefix of the whole chain's,
    its constants those of a chain of that length, and no head step runs past the stop."""
    num_steps = 5
    for _ in range(20):
        seed = int(torch.randint(0, 2**31, ()))
        g = torch.Generator().manual_seed(seed)
        info = random_seeds(bs, g)
        threshold = float(torch.rand((), generator=g)) * 0.6
        buffers = Topk1ChainBuffers(4, num_steps, num_steps + 1, "cpu")
        whole_probs: list[torch.Tensor] = []
        whole = draft_chain(info, num_steps, probability_step(whole_probs, seed), buffers)
        cut_probs: list[torch.Tensor] = []
        cut = draft_chain(info, num_steps, probability_step(cut_probs, seed), buffers,
                          min_path_prob=threshold)  # fmt: skip
        # The reference: per request, the product of the probabilities of its drafts so far.
        path, n = info.topk_p[:, 0].clone(), 1
        while n < num_steps and float(path.max()) >= threshold:
            path, n = path * whole_probs[n - 1][:, 0], n + 1
        assert cut.draft_tokens.shape == (bs, n)
        assert torch.equal(cut.draft_tokens, whole.draft_tokens[:, :n])
        assert len(cut_probs) == n - 1  # head steps: one per draft after the seed
        reference = draft_tree(info, n, 1, n + 1, recording_step([], seed))
        assert torch.equal(cut.parent_list, reference.parent_list)
        assert torch.equal(cut.top_scores_index, reference.top_scores_index)


def test_a_threshold_of_zero_drafts_every_step() -> None:
    bs, num_steps = 4, 3
    info = EagleDraftInput(torch.rand(bs, 1) * 1e-6, torch.randint(0, VOCAB, (bs, 1)),
                           torch.randn(bs, HIDDEN))  # fmt: skip
    buffers = Topk1ChainBuffers(4, num_steps, num_steps + 1, "cpu")
    out = draft_chain(info, num_steps, recording_step([], 1), buffers, min_path_prob=0.0)
    assert out.draft_tokens.shape == (bs, num_steps)

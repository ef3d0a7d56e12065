"""Lossless speculative sampling end to end (eagleserve.spec.accept): on toy target and draft
models over a tiny vocabulary, speculation's output distribution equals the target's (total
variation within a bound), and the check catches a wrong acceptance rule."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from eagleserve.sampling.sampling_info import SamplingInfo
from eagleserve.spec.accept import AcceptResult, accept, verify_greedy
from eagleserve.spec.tree import (
    Topk1ChainBuffers,
    build_tree,
    organize_draft_results,
    select_top_k_tokens,
)

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
    EMIT tokens; returns their first EMIT tokens [samples, EMIT]. Sequence b's token k is
    drawn with the noise of (seeds[b], position k)."""
    torch.manual_seed(seed)
    seeds = torch.randint(0, 2**62, (samples,))
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
            (*chain.constants(bs, num_steps), torch.cat(lists[1], dim=1))
            if chain is not None
            else organize_draft_results(*lists, num_draft_tokens)
        )
        tree = build_tree(torch.randint(0, V, (bs,)), *organized, topk, num_draft_tokens)
        # Target distribution after every node: look up the node's prefix code.
        node_code = torch.zeros(bs, num_draft_tokens, dtype=torch.long)
        node_code[:, 0] = root
        depth = torch.zeros(bs, num_draft_tokens, dtype=torch.long)
        for i in range(1, num_draft_tokens):
            par = tree.parents[:, i : i + 1]
            node_code[:, i] = _child(node_code.gather(1, par)[:, 0], tree.draft_tokens[:, i])
            depth[:, i] = depth.gather(1, par)[:, 0] + 1
        # Node i sits at position count - 1 + depth: the token after it is the sequence's
        # token count + depth.
        positions = count[act, None] - 1 + depth
        res = verify(tree.draft_tokens, tree.parents, target[node_code], seeds[act], positions)
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


def _seeded_info(seeds: torch.Tensor) -> SamplingInfo:
    """Plain sampling (temperature 1, no filters) for rows with these seeds."""
    bs = seeds.shape[0]
    return SamplingInfo(torch.ones(bs, 1), torch.ones(bs), torch.full((bs,), V), torch.zeros(bs),
                        [False] * bs, seeds, False, False, False)  # fmt: skip


def _target_draws(tokens, parents, probs, seeds, positions) -> AcceptResult:
    """What the engine runs: the walk along the target's seeded draws (spec/accept.py)."""
    return accept(_seeded_info(seeds), tokens, parents, probs.log(), positions)


def _always_accept(tokens, parents, probs, seeds, positions) -> AcceptResult:
    """Wrong rule: follow the first child everywhere, bonus from the leaf's target row."""
    bs, n = tokens.shape
    first_child = torch.full((bs, n), -1, dtype=torch.long)
    for c in range(n - 1, 0, -1):  # descending: the lowest child index is written last
        first_child.scatter_(1, parents[:, c : c + 1], torch.full((bs, 1), c))
    predict = tokens.gather(1, first_child.clamp(min=0))
    res = verify_greedy(tokens, parents, predict)
    return _with_bonus_from_full_row(res, probs)


def _no_residual(tokens, parents, probs, seeds, positions) -> AcceptResult:
    """Wrong rule: correct acceptance, but the bonus is drawn afresh, not conditioned on the
    drafts it rejected."""
    res = _target_draws(tokens, parents, probs, seeds, positions)
    return _with_bonus_from_full_row(res, probs)


def _one_noise_per_sequence(tokens, parents, probs, seeds, positions) -> AcceptResult:
    """Wrong keys: every position of a sequence draws with the same uniform (the seed's)."""
    return _target_draws(tokens, parents, probs, seeds, torch.zeros_like(positions))


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
    out = _speculate(_target_draws, target, draft, SAMPLES, *CONFIGS[config], seed=1)
    assert (out >= 0).all()
    flat = (out * torch.tensor([V * V, V, 1])).sum(dim=1)
    assert (joint[flat] > 0).all(), "emitted a sequence the target gives probability 0"
    tv, bound = _tv(out, joint), _tv_bound(joint, SAMPLES)
    assert tv < bound, (tv, bound)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_speculation_reproduces_target_argmax(config: str, toy) -> None:
    target, draft, _ = toy

    def greedy(tokens, parents, probs, seeds, positions):
        return verify_greedy(tokens, parents, probs.argmax(dim=-1))

    out = _speculate(greedy, target, draft, 64, *CONFIGS[config], seed=2)
    code, expect = 0, []
    for _ in range(EMIT):
        t = int(target[code].argmax())
        expect.append(t)
        code = code * V + t + 1
    assert (out == torch.tensor(expect)).all()


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("rule", [_always_accept, _no_residual, _one_noise_per_sequence])
def test_lossless_check_detects_wrong_rules(config: str, rule, toy) -> None:
    """The same statistic must reject sampling rules known to be biased."""
    target, draft, joint = toy
    out = _speculate(rule, target, draft, SAMPLES, *CONFIGS[config], seed=3)
    tv, bound = _tv(out, joint), _tv_bound(joint, SAMPLES)
    assert tv > 1.5 * bound, (tv, bound)

"""Running the draft steps: a chain (topk == 1, preallocated buffers) or a top-k tree."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from eagleserve.core import EagleDraftInput
from eagleserve.spec.tree import Topk1ChainBuffers, organize_draft_results, select_top_k_tokens

# step_fn(input_ids [bs*topk], features [bs*topk, h], depth, region_mask, paths) ->
#   (topk_p [bs*topk, topk], topk_index [bs*topk, topk], next_features [bs*topk, h]);
# paths [bs, topk, depth]: each branch's draft tokens so far, the newest being input_ids
# (tracked only when asked for: grammar masks need them; None otherwise).
StepFn = Callable[
    [torch.Tensor, torch.Tensor, int, "torch.Tensor | None", "torch.Tensor | None"],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]


@dataclass
class DraftTree:
    parent_list: torch.Tensor  # [bs, W] long
    top_scores_index: torch.Tensor  # [bs, num_draft_tokens - 1] long
    draft_tokens: torch.Tensor  # [bs, num_draft_tokens - 1]
    # A chain that may stop short: whether some request's path was still likely after its
    # last draft (it would go on if planned deeper); None where not checked.
    goes_on: bool | None = None


def _run_steps(
    info: EagleDraftInput, num_steps: int, topk: int, step_fn: StepFn, track_paths: bool = False
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    score_list: list[torch.Tensor] = []
    token_list: list[torch.Tensor] = []
    parents_list: list[torch.Tensor] = []
    topk_p, topk_index, hidden = info.topk_p, info.topk_index, info.hidden_states
    scores = None
    region_mask = None  # [bs, topk, s * topk]: which draft-region nodes each branch sees
    paths = None
    for i in range(num_steps):
        ids, feats, scores, (s_e, t_e, p_e) = select_top_k_tokens(
            i, topk_p, topk_index, hidden, scores, topk
        )
        score_list.append(s_e)
        token_list.append(t_e)
        parents_list.append(p_e)
        if i == num_steps - 1:
            break
        if topk > 1:
            region_mask = _extend_region_mask(region_mask, p_e, i, topk)
        if track_paths:
            paths = extend_paths(paths, p_e, ids, i, topk)
        topk_p, topk_index, hidden = step_fn(ids, feats, i + 1, region_mask, paths)
    return score_list, token_list, parents_list


def extend_paths(
    paths: torch.Tensor | None, parents_entry: torch.Tensor, ids: torch.Tensor, i: int, topk: int
) -> torch.Tensor:
    """The branches' token paths after step i: [bs, topk, i + 1]. Step i >= 1 picked candidate
    `chosen` (flat in the step's topk * topk), which extends branch chosen // topk."""
    bs = parents_entry.shape[0]
    new = ids.view(bs, topk, 1)
    if paths is None:
        return new
    branch = (parents_entry - (topk * topk * (i - 1) + topk)) // topk  # [bs, topk]
    kept = torch.gather(paths, 1, branch[:, :, None].expand(-1, -1, paths.shape[2]))
    return torch.cat([kept, new], dim=2)


def _extend_region_mask(
    mask: torch.Tensor | None, parents_entry: torch.Tensor, i: int, topk: int
) -> torch.Tensor:
    """Mask for the branches expanded at draft depth i + 1 (ancestor-or-self over the region)."""
    bs = parents_entry.shape[0]
    eye = torch.eye(topk, dtype=torch.bool, device=parents_entry.device).expand(bs, -1, -1)
    if mask is None:
        return eye.clone()
    chosen = parents_entry - (topk * topk * (i - 1) + topk)  # [bs, topk] in [0, topk^2)
    branch = chosen // topk  # which previous branch each new node extends
    inherited = torch.gather(mask, 1, branch[:, :, None].expand(-1, -1, mask.shape[2]))
    return torch.cat([inherited, eye], dim=2)


def draft_chain(
    info: EagleDraftInput,
    num_steps: int,
    step_fn: StepFn,
    buffers: Topk1ChainBuffers,
    track_paths: bool = False,
    min_path_prob: float = 0.0,
) -> DraftTree:
    """The tree `draft_tree` builds for topk == 1, without its bookkeeping: one branch, whose
    only candidate each step is the next node (scores, parents and the selection are the
    identity). Each step feeds back the step's token and features as they are.

    With `min_path_prob` > 0 the chain stops before a step where no request's path probability
    (`chain_goes_on`) reaches it: fewer than num_steps drafts, at least the seed. Each check
    reads a probability on the host, so only a CPU's drafting passes one (there it is memory
    the host already holds; on a GPU it would be a device sync per step)."""
    ids, feats = info.topk_index.flatten(), info.hidden_states
    tokens = [info.topk_index]
    paths = None
    path_prob = info.topk_p.reshape(-1) if min_path_prob > 0 else None
    for depth in range(1, num_steps):
        if path_prob is not None and not chain_goes_on(path_prob, min_path_prob):
            break
        if track_paths:  # [bs, 1, depth]: the tokens drafted so far, newest last
            new = ids.view(-1, 1, 1)
            paths = new if paths is None else torch.cat([paths, new], dim=2)
        step_p, topk_index, feats = step_fn(ids, feats, depth, None, paths)
        if path_prob is not None:
            path_prob = path_prob * step_p.reshape(-1)
        tokens.append(topk_index)
        ids = topk_index.flatten()
    parent_list, top_scores_index = buffers.constants(ids.shape[0], num_steps)
    if len(tokens) < num_steps:  # a shorter chain's are prefixes of these (views: no kernel)
        n = len(tokens)
        parent_list, top_scores_index = parent_list[:, : n if n > 1 else 0], top_scores_index[:, :n]
    goes_on = None if path_prob is None else chain_goes_on(path_prob, min_path_prob)
    return DraftTree(parent_list, top_scores_index, torch.cat(tokens, dim=1), goes_on)


def chain_goes_on(path_prob: torch.Tensor, min_path_prob: float) -> bool | None:
    """Whether a chain drafts one more token: some request's path probability, the product of
    the head's probability of each of its drafts so far (EAGLE-2's path score; path_prob [bs]),
    is at least min_path_prob. The head's probability predicts acceptance (TRAINING.md, "Where
    the first draft misses"), so a draft after an unlikely path would cost a head step and a
    verify row for a token the target seldom keeps; the batch's verify has one width, so the
    chain goes on while any request's path is likely. None without a cut (min_path_prob 0)."""
    return float(path_prob.max()) >= min_path_prob if min_path_prob > 0 else None


def draft_tree(
    info: EagleDraftInput,
    num_steps: int,
    topk: int,
    num_draft_tokens: int,
    step_fn: StepFn,
    track_paths: bool = False,
) -> DraftTree:
    score_list, token_list, parents_list = _run_steps(info, num_steps, topk, step_fn, track_paths)
    parent_list, top_scores_index, draft_tokens = organize_draft_results(
        score_list, token_list, parents_list, num_draft_tokens
    )
    return DraftTree(parent_list, top_scores_index, draft_tokens)

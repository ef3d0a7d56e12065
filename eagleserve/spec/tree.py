"""Draft-tree bookkeeping for EAGLE: candidate expansion, selection and the verify tree.

Layout (SGLang's convention, kept so the pieces interoperate):

* The draft runs `num_steps` steps. Step 0 contributes `topk` candidates (flat indices
  `0..topk-1`), every later step `i >= 1` contributes `topk * topk` candidates (flat indices
  `topk + topk*topk*(i-1) + branch*topk + child`), `branch` being one of the `topk` candidates
  chosen at step `i-1` for expansion.
* `score_list[i]` holds the cumulative scores (product of draft probabilities along the path)
  of step i's candidates, `token_list[i]` their tokens, `parents_list[i]` the flat index of the
  parent of each candidate slot *of the next step*, shifted so that
  `parent_list = cat(parents_list[:-1], dim=1)` satisfies:
  candidate `f` has parent flat index `parent_list[f // topk]` (`-1` = the root).
* The verify tree has `num_draft_tokens` nodes per request: node 0 is the root (the bonus token
  of the previous iteration, not yet in the KV cache) and nodes `1..n-1` are the selected
  candidates in ascending flat-index order. A parent's flat index is always smaller than its
  child's, so a node's parent always has a smaller node index.

Everything here is pure tensor code without device-specific calls.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = [
    "InvalidChainConfig",
    "Topk1ChainBuffers",
    "TreeInfo",
    "build_chain",
    "build_tree",
    "num_candidates",
    "organize_draft_results",
    "parents_from_mask",
    "select_top_k_tokens",
]


class InvalidChainConfig(AssertionError, ValueError):
    """A topk=1 chain needs `num_draft_tokens == num_steps + 1` and `num_steps >= 1`.

    Subclasses AssertionError (SGLang asserts here) and ValueError; raised explicitly so the
    check survives `python -O`.
    """


def _stable_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim; among equal values the lower index wins.

    `torch.topk` leaves the order of ties unspecified (and it differs between devices). The
    tree relies on a parent (lower flat index, score >= child's) being picked before an
    equal-score child, so ties are broken by index with a stable descending sort.
    """
    if k == 1:  # max returns the first index of the maximum: no sort needed
        values, indices = x.max(dim=-1, keepdim=True)
        return values, indices
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def num_candidates(num_steps: int, topk: int) -> int:
    """Number of flat candidates the draft produces: topk + (num_steps - 1) * topk**2."""
    return topk + (num_steps - 1) * topk * topk


def select_top_k_tokens(
    step: int,
    topk_p: torch.Tensor,
    topk_index: torch.Tensor,
    hidden_states: torch.Tensor,
    scores: torch.Tensor | None,
    topk: int,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]:
    """One draft step's expansion: picks the `topk` branches to feed the next draft forward.

    step 0: topk_p / topk_index are [bs, topk] (the draft's top-k after the root), hidden_states
        [bs, h]; every one of the topk candidates becomes a branch.
    step i >= 1: topk_p / topk_index are [bs*topk, topk] (one row per branch), hidden_states
        [bs*topk, h]; the topk best of the topk*topk children by cumulative score become the
        next branches.

    Returns (input_ids [bs*topk], hidden [bs*topk, h], scores [bs, topk],
    (score_entry, token_entry, parents_entry)) where the entries go to score_list / token_list /
    parents_list (see the module docstring for the flat-index convention).
    """
    if step == 0:
        bs = topk_p.shape[0]
        input_ids = topk_index.flatten()  # [bs*topk]
        hidden = hidden_states.repeat_interleave(topk, dim=0)  # [bs*topk, h]
        new_scores = topk_p  # [bs, topk]
        # Slot 0 (parent of step-0 candidates) is the root; slots 1..topk name the step-0
        # candidates 0..topk-1, parents of step-1 children of branch b (f // topk == 1 + b).
        parents_entry = (
            torch.arange(-1, topk, dtype=torch.long, device=topk_p.device)
            .unsqueeze(0)
            .repeat(bs, 1)
        )  # [bs, topk+1]
        return input_ids, hidden, new_scores, (topk_p.unsqueeze(1), topk_index, parents_entry)

    if scores is None:
        raise ValueError("select_top_k_tokens: scores are required for step >= 1")
    bs = scores.shape[0]
    # Cumulative score of child c of branch b = score(b) * p(c | b); probabilities <= 1 keep a
    # child's score <= its parent's, which makes the final selection ancestor-closed.
    expand_scores = scores.unsqueeze(2) * topk_p.view(bs, topk, topk)  # [bs, topk, topk]
    new_scores, chosen = _stable_topk(expand_scores.flatten(1), topk)  # [bs, topk] each
    token_entry = topk_index.reshape(bs, topk * topk)  # [bs, topk*topk]
    input_ids = torch.gather(token_entry, 1, chosen).flatten()  # [bs*topk]
    if hidden_states.shape[0] > 0:
        # Child `chosen` descends from branch chosen // topk of the same request.
        rows = chosen // topk + (
            torch.arange(bs, device=chosen.device).unsqueeze(1) * topk
        )  # [bs, topk]
        hidden = hidden_states[rows.flatten()]  # [bs*topk, h]
    else:
        hidden = hidden_states
    # Flat index of the chosen candidates in the concatenated score list.
    parents_entry = chosen + (topk * topk * (step - 1) + topk)  # [bs, topk]
    return input_ids, hidden, new_scores, (expand_scores, token_entry, parents_entry)


def organize_draft_results(
    score_list: list[torch.Tensor],
    token_list: list[torch.Tensor],
    parents_list: list[torch.Tensor],
    num_draft_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keeps the num_draft_tokens - 1 best candidates over all steps.

    Returns (parent_list [bs, W] long, top_scores_index [bs, n-1] long sorted ascending,
    draft_tokens [bs, n-1]); W = 0 when there was a single step (every candidate's parent is
    the root).
    """
    all_scores = torch.cat(score_list, dim=1).flatten(1)  # [bs, num_candidates]
    all_tokens = torch.cat(token_list, dim=1)  # [bs, num_candidates]
    k = num_draft_tokens - 1
    if not 0 <= k <= all_scores.shape[1]:
        raise ValueError(
            f"num_draft_tokens={num_draft_tokens} needs 1..{all_scores.shape[1] + 1} "
            f"(there are {all_scores.shape[1]} candidates)"
        )
    # Stable selection: a parent (lower index, score >= child's) always beats its child.
    _, top_scores_index = _stable_topk(all_scores, k)
    # Ascending flat order = parents before children = node order of the verify tree.
    top_scores_index = torch.sort(top_scores_index, dim=-1).values  # [bs, n-1]
    draft_tokens = torch.gather(all_tokens, 1, top_scores_index)  # [bs, n-1]
    if len(parents_list) > 1:
        parent_list = torch.cat(parents_list[:-1], dim=1)  # [bs, W]
    else:
        bs = parents_list[0].shape[0]
        parent_list = torch.empty(bs, 0, dtype=torch.long, device=parents_list[0].device)
    return parent_list, top_scores_index, draft_tokens


class Topk1ChainBuffers:
    """Precomputed organize_draft_results outputs for topk == 1 (a chain).

    With one candidate per step all num_steps candidates are kept, so cat/topk/sort/gather is the
    identity: parents are `arange(-1, num_steps - 1)` (width 0 for a single step, matching the
    slow path) and score indices `arange(num_steps)`. Only the tokens change per iteration
    (draft_tree.draft_chain cats them).
    """

    def __init__(
        self, max_bs: int, num_steps: int, num_draft_tokens: int, device: torch.device | str
    ) -> None:
        self.max_bs = max(int(max_bs), 1)
        self.device = torch.device(device)
        self.num_steps = 0
        self.num_draft_tokens = 0
        self._topk1_parents_prealloc: torch.Tensor = torch.empty(0, 0, dtype=torch.long)
        self._topk1_score_indices_prealloc: torch.Tensor = torch.empty(0, 0, dtype=torch.long)
        self._rebuild_topk1_chain_buffers(num_steps, num_draft_tokens)

    def _rebuild_topk1_chain_buffers(self, num_steps: int, num_draft_tokens: int) -> None:
        """(Re)builds the constants; call again whenever num_steps changes (adaptive spec)."""
        if num_steps < 1 or num_draft_tokens != num_steps + 1:
            raise InvalidChainConfig(
                f"topk=1 chain needs num_steps >= 1 and num_draft_tokens == num_steps + 1, "
                f"got num_steps={num_steps}, num_draft_tokens={num_draft_tokens}"
            )
        self._topk1_parents_prealloc, self._topk1_score_indices_prealloc = self._chain_rows(
            self.max_bs, num_steps
        )
        self.num_steps = num_steps
        self.num_draft_tokens = num_draft_tokens

    def constants(self, bs: int, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(parent_list [bs, W], top_scores_index [bs, num_steps]) of a chain of num_steps: row
        slices of the buffers (contiguous views: no copy, no kernel) where they fit, built
        afresh otherwise."""
        if bs <= self.max_bs and num_steps == self.num_steps:
            return self._topk1_parents_prealloc[:bs], self._topk1_score_indices_prealloc[:bs]
        return self._chain_rows(bs, num_steps)

    def _chain_rows(self, bs: int, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh contiguous (parent_list [bs, W], top_scores_index [bs, num_steps]). The slow
        path's parent_list is cat(parents_list[:-1]): [-1, 0] from step 0 then [i] from step i,
        i.e. arange(-1, num_steps - 1); with one step it is empty."""
        width = num_steps if num_steps > 1 else 0
        parents = torch.arange(-1, width - 1, dtype=torch.long, device=self.device)
        scores = torch.arange(num_steps, dtype=torch.long, device=self.device)
        return parents.expand(bs, -1).contiguous(), scores.expand(bs, -1).contiguous()


@dataclass
class TreeInfo:
    """The verify tree, n = num_draft_tokens nodes per request; node 0 is the root.

    draft_tokens [bs, n] long: root = verified_id, then the selected candidates.
    parents [bs, n] long: node index of each node's parent (-1 for the root); parents[i] < i.
    depths [bs, n] long: root 0; the node's position is seq_len + depth.
    tree_mask [bs, n, n] bool: mask[b, i, j] = node j is node i or one of its ancestors.
    """

    draft_tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    tree_mask: torch.Tensor
    goes_on: bool | None = None  # a chain that may stop short: `DraftTree.goes_on`

    def positions(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """[bs, n] positions of the nodes given the committed lengths seq_lens [bs]."""
        return seq_lens.unsqueeze(1) + self.depths


def build_tree(
    verified_id: torch.Tensor,
    parent_list: torch.Tensor,
    top_scores_index: torch.Tensor,
    draft_tokens: torch.Tensor,
    topk: int,
    num_draft_tokens: int,
    *,
    validate: bool = False,
    kernel: bool = False,
) -> TreeInfo:
    """Builds the verify tree from organize_draft_results' output.

    The selection is ancestor-closed by construction: a child's cumulative score is a product
    with a probability <= 1, so it never exceeds its parent's (floating-point multiplication by
    a factor in [0, 1] is monotone), the parent has the smaller flat index, and the selection
    breaks ties by index. `validate=True` checks it anyway (it synchronizes with the device, so
    keep it off the hot path); a violation means the scores were not probabilities (NaN, > 1).
    `kernel`: in one Triton launch (kernels/triton_tree.py), the same tree.
    """
    bs = verified_id.shape[0]
    n = num_draft_tokens
    m = n - 1
    device = verified_id.device
    if top_scores_index.shape != (bs, m) or draft_tokens.shape != (bs, m):
        raise ValueError(
            f"expected top_scores_index/draft_tokens of shape {(bs, m)}, got "
            f"{tuple(top_scores_index.shape)} / {tuple(draft_tokens.shape)}"
        )
    if kernel and not validate:
        from eagleserve.kernels.triton_tree import build_tree_kernel  # imports triton

        return TreeInfo(*build_tree_kernel(verified_id, parent_list, top_scores_index,
                                           draft_tokens, topk, n))  # fmt: skip
    tsi = top_scores_index.long()  # [bs, m]

    # Parent flat index of every selected candidate: parent_list[f // topk].
    if parent_list.shape[1] == 0:
        parent_flat = torch.full_like(tsi, -1)  # single step: all children of the root
    else:
        parent_flat = torch.gather(parent_list.long(), 1, tsi // topk)  # [bs, m]
    # Node index of that parent: its position in the sorted selection, plus one for the root.
    pos = torch.searchsorted(tsi, parent_flat.clamp(min=0)).clamp(max=max(m - 1, 0))  # [bs, m]
    is_root = parent_flat < 0
    if validate and m > 0:
        found = is_root | (torch.gather(tsi, 1, pos) == parent_flat)
        if not bool(found.all()):
            raise ValueError("draft selection is not closed under ancestors")
    parent_node = torch.where(is_root, torch.zeros_like(pos), pos + 1)  # [bs, m]
    parents = torch.cat(
        [torch.full((bs, 1), -1, dtype=torch.long, device=device), parent_node], dim=1
    )  # [bs, n]

    # Depth from the flat index: step 0 candidates sit at depth 1, step i at depth i + 1.
    step = torch.where(tsi < topk, torch.zeros_like(tsi), 1 + (tsi - topk) // (topk * topk))
    depths = torch.cat(
        [torch.zeros(bs, 1, dtype=torch.long, device=device), step + 1], dim=1
    )  # [bs, n]

    # Ancestor mask by pointer chasing; the tree is at most num_steps deep (<= n - 1).
    num_steps = 1 if parent_list.shape[1] == 0 else (parent_list.shape[1] - 1) // topk + 1
    mask = torch.eye(n, dtype=torch.bool, device=device).unsqueeze(0).repeat(bs, 1, 1)
    cur = parents.clone()  # [bs, n]: current ancestor of every node (-1 = past the root)
    for _ in range(min(num_steps, m)):
        valid = cur >= 0
        safe = cur.clamp(min=0)
        mask.scatter_(
            2, safe.unsqueeze(2), valid.unsqueeze(2) | torch.gather(mask, 2, safe[..., None])
        )
        cur = torch.where(valid, torch.gather(parents, 1, safe), cur)

    tokens = torch.cat([verified_id.long().view(bs, 1), draft_tokens.long()], dim=1)  # [bs, n]
    return TreeInfo(draft_tokens=tokens, parents=parents, depths=depths, tree_mask=mask)


def parents_from_mask(tree_mask: torch.Tensor) -> torch.Tensor:
    """[bs, n] parents of a verify tree from its ancestor mask [bs, n, n] (`build_tree`'s:
    node j is an ancestor of i or i itself): the ancestor with the largest index, since indices
    grow along every root path; -1 for the root. A verify graph holds the mask, not the
    parents."""
    n = tree_mask.shape[-1]
    node = torch.arange(n, device=tree_mask.device)
    strict = tree_mask & (node[None, :] < node[:, None])  # ancestors, not the node itself
    return torch.where(strict, node, -1).amax(dim=-1)


@functools.lru_cache(maxsize=32)
def _chain_layout(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chain of n nodes: parents [n] (i - 1), depths [n] (i), ancestor mask [n, n] (lower
    triangle). Constants per (n, device): every chain verify of that width shares them."""
    node = torch.arange(n, device=device)
    return node - 1, node, torch.ones(n, n, dtype=torch.bool, device=device).tril()


def build_chain(
    verified_id: torch.Tensor, draft_tokens: torch.Tensor, goes_on: bool | None = None
) -> TreeInfo:
    """`build_tree` for a top-1 chain (draft_tokens [bs, k] in drafting order): the same
    TreeInfo, from one concatenation. Parents, depths and mask are read-only views of shared
    constants (a chain's shape does not depend on its tokens); a chain verify then launches
    no tree-building kernels."""
    bs, k = draft_tokens.shape
    parents, depths, mask = _chain_layout(k + 1, draft_tokens.device)
    tokens = torch.cat([verified_id.long().view(bs, 1), draft_tokens.long()], dim=1)  # [bs, n]
    return TreeInfo(
        draft_tokens=tokens,
        parents=parents.expand(bs, k + 1),
        depths=depths.expand(bs, k + 1),
        tree_mask=mask.expand(bs, k + 1, k + 1),
        goes_on=goes_on,
    )

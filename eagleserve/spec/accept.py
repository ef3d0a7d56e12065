"""Verification of a draft tree against the target model, greedy and sampled alike: the
target's own choice after every node (its argmax, or its seeded draw: `accept`), then the walk
along the drafts equal to it.

The walk uses the node order of `eagleserve.spec.tree.build_tree`: node 0 is the root and a
node's parent always has a smaller index. It takes one step per depth (the first child of the
node before whose token is the target's choice there).

Results (AcceptResult), width D = max_depth + 1 (default max_depth = n - 1, enough for any tree):
  accept_index [bs, D] long: accepted node indices by depth, starting with the root 0, then -1.
  accept_lens [bs] long: accepted drafts + 1 = tokens committed this step.
  output_tokens [bs, D] long: output_tokens[k] is the token following node accept_index[k]:
      the accepted draft tokens, then the bonus token at accept_lens - 1, then -1.
  bonus_tokens [bs] long: the token after the last accepted node (the next root).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagleserve.distributed.parallel import broadcast_from_first
from eagleserve.kernels import cpu_ext
from eagleserve.sampling.sampler import greedy_ids, sample, sample_packed
from eagleserve.sampling.sampling_info import DrawKernel, PackedSampling, SamplingInfo
from eagleserve.spec.tree import parents_from_mask

__all__ = [
    "AcceptResult",
    "accept",
    "commit_tree_path",
    "verify_greedy",
    "verify_greedy_chain",
]


@dataclass
class AcceptResult:
    accept_index: torch.Tensor  # [bs, D] long, -1 padded
    accept_lens: torch.Tensor  # [bs] long, >= 1
    output_tokens: torch.Tensor  # [bs, D] long, -1 padded
    bonus_tokens: torch.Tensor  # [bs] long

    @property
    def last_node(self) -> torch.Tensor:
        """[bs] node index of the last accepted node (0 when no draft was accepted)."""
        return torch.gather(self.accept_index, 1, (self.accept_lens - 1).unsqueeze(1)).squeeze(1)


def _check_shapes(draft_tokens: torch.Tensor, parents: torch.Tensor, max_depth: int | None) -> int:
    if draft_tokens.dim() != 2 or parents.shape != draft_tokens.shape:
        raise ValueError(
            f"draft_tokens and parents must both be [bs, n], got {tuple(draft_tokens.shape)} "
            f"and {tuple(parents.shape)}"
        )
    n = draft_tokens.shape[1]
    depth = n - 1 if max_depth is None else max_depth
    if not 0 <= depth <= max(n - 1, 0):
        raise ValueError(f"max_depth must be in 0..{n - 1}, got {max_depth}")
    return depth


def _assemble(
    draft_tokens: torch.Tensor,
    accept_index: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus: torch.Tensor,
) -> AcceptResult:
    """output_tokens[k] = token of node accept_index[k + 1] for k < len - 1, bonus at len - 1."""
    bs, width = accept_index.shape
    nxt = torch.cat(
        [accept_index[:, 1:], torch.full((bs, 1), -1, dtype=torch.long, device=bonus.device)],
        dim=1,
    )  # [bs, D]: the node following accept_index[k] on the path (-1 past the end)
    out = torch.where(
        nxt >= 0, torch.gather(draft_tokens.long(), 1, nxt.clamp(min=0)), torch.full_like(nxt, -1)
    )  # [bs, D]
    out.scatter_(1, (accept_lens - 1).unsqueeze(1), bonus.long().unsqueeze(1))
    return AcceptResult(
        accept_index=accept_index,
        accept_lens=accept_lens,
        output_tokens=out,
        bonus_tokens=bonus.long(),
    )


def _walk_start(
    bs: int, depth: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tree walk before any draft node is tested: (cur [bs], the current = last accepted node:
    the root 0; lens [bs], accepted nodes incl. the root: 1; accept_index [bs, depth + 1]:
    the root, then -1)."""
    cur = torch.zeros(bs, dtype=torch.long, device=device)
    lens = torch.ones(bs, dtype=torch.long, device=device)
    accept_index = torch.full((bs, depth + 1), -1, dtype=torch.long, device=device)
    accept_index[:, 0] = 0
    return cur, lens, accept_index


def verify_greedy(
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    target_predict: torch.Tensor,
    *,
    max_depth: int | None = None,
) -> AcceptResult:
    """Longest root path whose every token equals the target's choice after its parent.

    draft_tokens [bs, n], parents [bs, n] (parents[:, 0] = -1, parents[:, i] < i),
    target_predict [bs, n]: the target's token after node i (argmax, or seeded draw). Among
    children carrying the same (matching) token the lowest node index is taken. max_depth
    bounds the result width (default n - 1; must be >= the tree's real depth).

    One step per depth, not per node: the path's node at depth d is the first matching child
    of its node at depth d - 1 (a few ops per depth whatever the width, so a tree's verify
    graph can walk it too: `packed_greedy`). A depth with no such child ends the path, and
    every later depth finds none either.
    """
    depth = _check_shapes(draft_tokens, parents, max_depth)
    bs = draft_tokens.shape[0]
    tokens = draft_tokens.long()
    predict = target_predict.long()
    # Node i carries the target's choice after its parent (never the root: it has none).
    match = (tokens == torch.gather(predict, 1, parents.clamp(min=0))) & (parents >= 0)
    cur, lens, accept_index = _walk_start(bs, depth, draft_tokens.device)
    for d in range(1, depth + 1):
        child = match & (parents == cur[:, None])  # [bs, n]
        found = child.any(dim=1)
        first = child.to(torch.uint8).argmax(dim=1)  # the lowest matching node index
        cur = torch.where(found, first, cur)
        accept_index[:, d] = torch.where(found, first, -1)
        lens = lens + found.long()
    bonus = torch.gather(predict, 1, cur.unsqueeze(1)).squeeze(1)  # [bs]
    return _assemble(tokens, accept_index, lens, bonus)


def verify_greedy_chain(draft_tokens: torch.Tensor, target_predict: torch.Tensor) -> AcceptResult:
    """`verify_greedy` for a chain (parents[:, i] = i - 1): node c is accepted while every node
    up to it carries the target's choice after its parent, so the accepted length is one plus
    the leading run of matches. An accepted node's token is the choice after the node before
    it, so the committed tokens are the target's choices at nodes 0 .. len - 1 (the last one
    the bonus): a dozen ops whatever n is (the tree walk costs several per depth)."""
    _check_shapes(draft_tokens, draft_tokens, None)
    bs, n = draft_tokens.shape
    predict = target_predict.long()
    match = draft_tokens[:, 1:] == predict[:, :-1]  # [bs, n - 1]
    lens = 1 + match.long().cumprod(dim=1).sum(dim=1)  # [bs]
    nodes = torch.arange(n, device=predict.device).expand(bs, n)
    live = nodes < lens.unsqueeze(1)
    return AcceptResult(
        accept_index=torch.where(live, nodes, -1),
        accept_lens=lens,
        output_tokens=torch.where(live, predict, -1),
        bonus_tokens=torch.gather(predict, 1, (lens - 1).unsqueeze(1)).squeeze(1),
    )


def packed_greedy(
    tokens: torch.Tensor,
    logits: torch.Tensor,
    tree_mask: torch.Tensor | None = None,
    max_depth: int | None = None,
    *,
    kernel: bool = False,
) -> torch.Tensor:
    """The greedy acceptance of the target's argmax at each node of `tokens` [bs, n] (a chain
    when `tree_mask` is None: `verify_greedy_chain`; else `verify_greedy` of the tree whose
    ancestor mask [bs, n, n] it is), packed into one [bs, 2D + 2] tensor (accept_index,
    output_tokens, accept_lens, bonus_tokens): a verify graph computes it after its forward,
    so an all-greedy batch's acceptance launches nothing from the host (`unpack_walk`).
    `kernel`: the walk in one Triton launch (kernels/triton_accept.py), the same values."""
    predict = greedy_ids(logits).view(tokens.shape)
    return packed_walk(tokens, predict, tree_mask, max_depth, kernel=kernel)


def packed_walk(
    tokens: torch.Tensor,
    predict: torch.Tensor,
    tree_mask: torch.Tensor | None = None,
    max_depth: int | None = None,
    *,
    kernel: bool = False,
) -> torch.Tensor:
    """`packed_greedy`'s walk over the target's choice `predict` [bs, n] after each node (its
    argmax, or for a sampled row its draw: `accept`)."""
    if kernel:
        from eagleserve.kernels.triton_accept import greedy_accept  # imports triton

        return greedy_accept(tokens.long(), predict, tree_mask, max_depth)
    acc = (
        verify_greedy_chain(tokens, predict)
        if tree_mask is None
        else verify_greedy(tokens, parents_from_mask(tree_mask), predict, max_depth=max_depth)
    )
    return torch.cat([acc.accept_index, acc.output_tokens, acc.accept_lens[:, None],
                      acc.bonus_tokens[:, None]], dim=1)  # fmt: skip


def verify_walks(
    tokens: torch.Tensor,
    positions: torch.Tensor,
    logits: torch.Tensor,
    sampling: PackedSampling | None,
    tree_mask: torch.Tensor | None,
    max_depth: int | None,
    kernel: bool,
    draw_kernel: DrawKernel | None,
) -> tuple[torch.Tensor, ...]:
    """A verify graph's acceptance walks of the nodes `tokens` [bs, n] at `positions` [bs * n]
    (`packed_walk`'s layout): greedy, and with `sampling` over the target's draws for rows
    whose parameters it holds (each request's repeated per node; none filtering by top-k or
    top-p), each node's choice drawn where it would sit, one past the node, as `accept` draws
    it. A batch reads the one its rows need (`unpack_walk`)."""
    greedy = packed_greedy(tokens, logits, tree_mask, max_depth, kernel=kernel)
    if sampling is None:
        return (greedy,)
    drawn = sample_packed(logits, sampling, positions + 1, None, False, draw_kernel)
    return greedy, packed_walk(tokens, drawn.view(tokens.shape), tree_mask, max_depth,
                               kernel=kernel)  # fmt: skip


def cpu_walk(logits: torch.Tensor) -> bool:
    """Whether a greedy chain's argmax and walk over these logits run as one call of the CPU
    kernels (`greedy_chain_walk`: the values `verify_greedy_chain` gives, without the dozen
    ops a CPU runs cold after a forward has streamed the weights through its caches)."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_ext.loaded()


def unpack_walk(packed: torch.Tensor) -> AcceptResult:
    """The AcceptResult of `packed_walk`'s output: views of it, no copy."""
    d = (packed.shape[1] - 2) // 2
    return AcceptResult(packed[:, :d], packed[:, 2 * d], packed[:, d : 2 * d], packed[:, -1])


def commit_tree_path(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    accept_index: torch.Tensor,
    n: int,
) -> None:
    """Permutes the slots of positions [L, L + n) of each request (L = seq_lens) so the accepted
    nodes sit at L, L + 1, ... in path order; no KV is copied. Rejected nodes keep their slots
    (behind the path, in node order), so the request still owns exactly the slots it owned.
    Node indices grow along every root path, so path order is node order: a stable sort on
    "rejected" is the permutation."""
    cols = seq_lens[:, None] + torch.arange(n, device=accept_index.device)[None, :]  # [bs, n]
    rows = req_pool_indices[:, None]
    slots = req_to_token[rows, cols]  # [bs, n]
    # A path's -1 padding marks the root, which every path holds anyway.
    rejected = torch.ones_like(cols, dtype=torch.uint8).scatter_(1, accept_index.clamp(min=0), 0)
    order = rejected.argsort(dim=1, stable=True)
    req_to_token[rows, cols] = slots.gather(1, order)


def accept(
    info: SamplingInfo,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    logits: torch.Tensor,
    positions: torch.Tensor,
    *,
    chain: bool = False,
    walked: AcceptResult | None = None,
    max_depth: int | None = None,
) -> AcceptResult:
    """The walk over the target's own choice after each node: its argmax for a greedy row, for
    a sampled row its draw with the noise of the position that choice would sit at, one past
    its node's (positions [bs, n]: the nodes' own; sampling/sampler.py `sample`). A draft is
    accepted while it equals what the target itself would have emitted there, so every
    committed token is the target's own, as target-only decoding would draw it with the same
    seed: lossless, and a drafted token is accepted with its target probability (for a tree,
    the sum over the distinct tokens of the children). `chain`: every row's tree is a chain
    (a top-1 draft), walked in a few ops; `walked`: this walk already done on these logits (a
    verify graph's epilogue, `packed_walk`'s result unpacked), used as it is.
    `max_depth`: a tree's depth bound (the result's width is max_depth + 1; default n - 1).
    Under tensor parallelism every rank takes rank 0's result: the ranks then commit the same
    tokens and KV paths."""
    if walked is not None:
        acc = walked
    elif chain and info.all_greedy and cpu_walk(logits):
        acc = unpack_walk(cpu_ext.greedy_chain_walk(tokens, logits.reshape(-1, logits.shape[-1])))
    else:
        bs, n = tokens.shape
        rows = logits.reshape(bs * n, -1)
        if info.all_greedy:
            predict = greedy_ids(rows).view(bs, n)
        else:
            at = positions.reshape(-1) + 1
            predict = sample(rows, info.repeat_interleave(n), at).view(bs, n)
        acc = (
            verify_greedy_chain(tokens, predict)
            if chain
            else verify_greedy(tokens, parents, predict, max_depth=max_depth)
        )
    broadcast_from_first(acc.accept_index, acc.accept_lens, acc.output_tokens, acc.bonus_tokens)
    return acc

"""Sampling: logits -> penalties and bias -> output-constraint mask -> target distribution
(temperature, top-k, top-p, min-p) -> tokens.

The output-constraint mask (a grammar, allowed_token_ids, bad_words: constrained/
constraint_batch.py) comes after penalties and bias, so nothing can re-enable a token it
forbids; greedy argmax sees it too.

A sampled request draws the token at position t by an exponential race on the noise of (its
seed, t) (sampling/seeded_noise.py), so a seed gives the same tokens whatever else is in the
batch, and a speculative verify draws the target's own token at each drafted position.
Penalties and bias change the logits before anything else (sampling/penalty_state.py), greedy
rows included; logprobs stay those of the raw model, as vLLM's.
"""

from __future__ import annotations

import torch

from eagleserve.constrained.constraint_batch import BatchConstraint
from eagleserve.constrained.grammar_mask import mask_logits
from eagleserve.core import GenerationBatchResult, Req
from eagleserve.device import tensor_to
from eagleserve.distributed.parallel import broadcast_from_first
from eagleserve.kernels import cpu_ext
from eagleserve.sampling.penalty_state import PenaltyState
from eagleserve.sampling.sampling_info import DrawKernel, PackedSampling, SamplingInfo
from eagleserve.sampling.seeded_noise import exponentials, position_hashes, token_uniforms

# Candidates a CPU row's top-k / top-p filter looks among when torch's ops sample (no C++
# sampling kernel: kernels/cpu_sample.cpp), fewest first (a CPU's topk of a few thousand is far
# cheaper than its sort of a whole vocabulary); a row whose kept tokens may lie past them all
# sorts its whole row.
TOP_CANDIDATES = (256, 4096)


def _keep_sorted(
    sorted_p: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """Probabilities sorted descending [n, K] with those top-k / top-p drop zeroed: the first
    top_k, and of them the smallest prefix whose mass reaches top_p (the first always stays).
    A row with top_p 1 keeps every token: its rounded cumulative sum may pass 1 in the tail,
    and its tokens must not depend on whether another row of the batch filters."""
    rank = torch.arange(sorted_p.shape[-1], device=sorted_p.device)[None, :]
    cum_before = sorted_p.cumsum(-1) - sorted_p
    top_ps = top_ps[:, None]
    drop = (rank >= top_ks[:, None]) | ((cum_before >= top_ps) & (rank > 0) & (top_ps < 1))
    return sorted_p.masked_fill(drop, 0.0)


def _top_k_top_p(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """probs [n, V] with the tokens top-k / top-p drop zeroed, in place. On a CPU, a row whose
    kept tokens all lie among its k most likely (its top_k fits, or their mass reaches its
    top_p), for the first k of TOP_CANDIDATES that holds, is filtered among those; the others
    sort their whole row. The choice is each row's own (it reads its values on the host, free
    on a CPU), so a row's result does not depend on its batch."""
    if probs.device.type != "cpu":  # an accelerator sorts fast and must not be read mid-batch
        sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)
        kept = _keep_sorted(sorted_p, top_ks, top_ps)
        return probs.zero_().scatter_(-1, sorted_idx, kept)
    rows = torch.arange(probs.shape[0])
    for k in (k for k in TOP_CANDIDATES if k < probs.shape[-1]):
        whole = rows.numel() == probs.shape[0]
        src, row_ks, row_ps = (
            (probs, top_ks, top_ps) if whole else (probs[rows], top_ks[rows], top_ps[rows])
        )
        cand_p, cand_idx = src.topk(k, dim=-1)  # sorted descending (copies)
        beyond = cand_p.cumsum(-1)[:, -1]  # the mass before the first token past them
        fits = (row_ks <= k) | ((row_ps < 1) & (beyond >= row_ps))
        kept = _keep_sorted(cand_p, row_ks, row_ps)
        if bool(fits.all()):
            if whole:
                return probs.zero_().scatter_(-1, cand_idx, kept)
            probs[rows] = src.zero_().scatter_(-1, cand_idx, kept)
            return probs
        done = rows[fits]
        probs[done] = torch.zeros_like(src[fits]).scatter_(-1, cand_idx[fits], kept[fits])
        rows = rows[~fits]
    src = probs[rows]
    sorted_p, sorted_idx = src.sort(dim=-1, descending=True)
    kept = _keep_sorted(sorted_p, top_ks[rows], top_ps[rows])
    probs[rows] = src.zero_().scatter_(-1, sorted_idx, kept)
    return probs


def logits_to_probs(logits: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
    """The target distribution a sampled request draws from, as weights: logits [n, V] ->
    the temperature's probabilities [n, V] with the tokens top-k, top-p and min-p drop zeroed,
    not scaled back to a sum of 1 (`draw` needs no normalized row, and one pass less)."""
    probs = torch.softmax(logits.float() / info.temperatures, dim=-1)
    if info.needs_top_k or info.needs_top_p:
        probs = _top_k_top_p(probs, info.top_ks, info.top_ps)
    if info.needs_min_p:
        max_p = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < info.min_ps[:, None] * max_p, 0.0)
    return probs


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1), the same indices: on a CPU whose kernels are loaded (a packed
    target's), one vectorized pass per row instead of torch's generic reduction, which costs
    a few percent of a small model's decode step over a full vocabulary."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_ext.loaded():
        return cpu_ext.argmax_rows(logits)
    return logits.argmax(dim=-1)


def draw(
    probs: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    columns: torch.Tensor | None = None,
) -> torch.Tensor:
    """The exponential race of each row of non-negative probs [m, V] (not necessarily
    normalized): the column with the least E_t / probs_t, E_t the exponential of (seeds[i],
    positions[i], t) (seeded_noise.py) for t the column's token id (`columns` [V]; default its
    index), the lowest column on a tie. A column is drawn with probability probs_t /
    sum(probs), and never one of zero mass; a row without mass gives its last column."""
    m, v = probs.shape
    tokens = torch.arange(v, device=probs.device) if columns is None else columns
    e = exponentials(token_uniforms(position_hashes(seeds, positions), tokens))
    keys = e / probs.double()  # zero mass: +inf
    idx = keys.argmin(dim=-1)
    massless = ~(probs > 0).any(dim=-1)
    return torch.where(massless, v - 1, idx)


def _draw_sampled(
    logits: torch.Tensor, info: SamplingInfo, positions: torch.Tensor, columns: torch.Tensor | None
) -> torch.Tensor:
    """Column indices of sampled rows (no greedy one among them)."""
    if info.draw_kernel == "cpu":
        return cpu_ext.sample_rows(logits.float(), info.temperatures, info.top_ks, info.top_ps,
                                   info.min_ps, info.seeds, positions, columns)  # fmt: skip
    probs = logits_to_probs(logits, info)
    if info.draw_kernel == "triton":
        from eagleserve.kernels.triton_sample import seeded_draw  # imports triton

        return seeded_draw(probs, info.seeds, positions, columns)
    return draw(probs, info.seeds, positions, columns)


def sample(
    logits: torch.Tensor,
    info: SamplingInfo,
    positions: torch.Tensor,
    columns: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [m, V] -> column indices [m] int64: the argmax for a greedy row; for a sampled
    row, the draw of its target distribution on the noise of (its seed, positions[i]),
    positions [m] int64 being where the drawn token will sit in its sequence. `columns` [V]:
    the token id of each column (a draft head's vocabulary), default the column's index."""
    if info.all_greedy:
        return greedy_ids(logits)
    if columns is None and info.draw_kernel == "triton" and not info.sorts:
        # No row filters by top-k / top-p: every row, greedy or drawn, in one kernel.
        return sample_packed(logits, info.packed(), positions, None, False, "triton")
    if not any(info.is_greedy):
        return _draw_sampled(logits, info, positions, columns)
    rows = [i for i, g in enumerate(info.is_greedy) if not g]
    idx = tensor_to(rows, torch.long, logits.device)
    sub = info.rows(rows, idx)
    out = greedy_ids(logits)
    out[idx] = _draw_sampled(logits[idx], sub, positions[idx], columns)
    return out


def sample_packed(
    logits: torch.Tensor,
    packed: PackedSampling,
    positions: torch.Tensor,
    columns: torch.Tensor | None,
    filtered: bool,
    draw_kernel: DrawKernel | None,
) -> torch.Tensor:
    """`sample` of rows whose parameters are `packed`, with nothing read on the host (inside a
    device graph): every row is drawn and a greedy row's argmax taken in its place. `filtered`
    False: no row filters by top-k or top-p (min-p is always applied: a 0 changes nothing). A
    row's token is `sample`'s, since a filter a row does not ask for keeps every weight."""
    f, i = packed.floats, packed.ints
    if columns is None and draw_kernel == "triton" and not filtered:
        # One kernel from the logits (kernels/triton_top1.py: the race over unnormalized
        # weights, the torch draw's token but at near-ties of the race).
        from eagleserve.kernels.triton_top1 import drawn_top1  # imports triton: only here

        return drawn_top1(logits, f, i, positions.contiguous())[1][:, 0]
    info = SamplingInfo(temperatures=f[:, 0:1], top_ps=f[:, 1], top_ks=i[:, 0], min_ps=f[:, 2],
                        is_greedy=[False] * logits.shape[0], seeds=i[:, 1],
                        needs_top_k=filtered, needs_top_p=filtered, needs_min_p=True,
                        draw_kernel=draw_kernel)  # fmt: skip
    drawn = _draw_sampled(logits, info, positions, columns)
    return torch.where(i[:, 2] != 0, drawn, greedy_ids(logits))


def top_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of the raw model distribution: chosen [n], top values [n, k], top ids [n, k]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, token_ids.view(-1, 1)).squeeze(-1)
    vals, ids = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], token_ids.view(-1, 1)[:, :0])
    return chosen, vals, ids


def sample_with_logprobs(
    logits: torch.Tensor,
    reqs: list[Req],
    info: SamplingInfo,
    positions: torch.Tensor,
    penalized: torch.Tensor | None = None,
) -> GenerationBatchResult:
    """One next token per row of `logits` (row i for reqs[i], to sit at positions[i]), with
    logprobs when any asks. Tokens come from `penalized` when given; logprobs always from the
    raw `logits`."""
    next_ids = sample(logits if penalized is None else penalized, info, positions)
    broadcast_from_first(next_ids)  # tensor parallelism: rank 0's draw is every rank's
    if all(r.sampling_params.logprobs is None for r in reqs):
        return GenerationBatchResult(next_ids)
    k = max((r.sampling_params.logprobs or 0) for r in reqs)
    chosen, vals, ids = top_logprobs(logits, next_ids, k)
    return GenerationBatchResult(next_ids, None, chosen, vals, ids)


def sample_next(
    logits: torch.Tensor,
    reqs: list[Req],
    info: SamplingInfo,
    positions: torch.Tensor,
    state: PenaltyState,
    slots: torch.Tensor,
    prefill: bool,
    constraint: BatchConstraint | None = None,
) -> GenerationBatchResult:
    """A prefill's or decode's next tokens (positions [bs]: where each will sit) with
    penalties and output-constraint masks: a prefill first resets its requests' penalty rows;
    the sampled tokens are committed to them and to the constrained rows' matchers."""
    pen = info.penalties
    if pen is None and constraint is None:
        return sample_with_logprobs(logits, reqs, info, positions)
    if pen is not None and prefill:
        pen.reset(state)
    scored = logits if pen is None else pen.next_logits(logits, state, slots)
    if constraint is not None:
        scored = mask_logits(scored, constraint.next_allowed(logits.device))
    result = sample_with_logprobs(logits, reqs, info, positions, scored)
    if pen is not None:
        pen.commit(state, slots, result.next_token_ids[:, None])
    if constraint is not None:
        constraint.advance(result.next_token_ids)
    return result

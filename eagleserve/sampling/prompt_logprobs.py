"""Prompt logprobs: the logprob of every prompt token given the tokens before it (and the top-k
alternatives), from the hidden states a prefill computes anyway.

A prefill's logits are those of each request's last token only; requests that ask for prompt
logprobs get the rest from `compute_logits` over their hidden rows, a bounded number of rows at a
time (a long prompt's [T, V] logits would not fit at once). The forward computed every extend
token, so the rows of token p score token p + 1 when p + 1 is still in the prompt. A prompt's
first token has no logprob (None), as in OpenAI's and vLLM's `echo` answers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from eagleserve.core import ScheduleBatch
from eagleserve.device import tensor_to
from eagleserve.messages import PromptScores

ROWS_PER_CHUNK = 512  # logits rows materialized at once (fp32 [rows, V])


@dataclass
class PromptLogprobs:
    """Scores of one prefill, flat over the requests that asked, in batch order."""

    rows: list[int]  # batch rows that asked
    counts: list[int]  # tokens scored per such row
    first: list[bool]  # whether the row's scores start at the prompt's first token (None)
    ks: list[int]  # top alternatives each row asked for (the tensors hold the largest k)
    chosen: torch.Tensor  # [T] logprob of each scored prompt token
    ranks: torch.Tensor  # [T] its rank in its distribution (1: the most likely)
    top_vals: torch.Tensor  # [T, k]
    top_ids: torch.Tensor  # [T, k]

    def to_host(self) -> PromptLogprobs:
        cpu = lambda t: t.to("cpu")
        return PromptLogprobs(self.rows, self.counts, self.first, self.ks, cpu(self.chosen),
                              cpu(self.ranks), cpu(self.top_vals), cpu(self.top_ids))  # fmt: skip

    def per_row(self) -> list[tuple[int, PromptScores]]:
        """Host only: (batch row, its scores) per asking row; a row starting at the prompt's
        first token begins with None (no rank, no alternatives)."""
        chosen, vals, ids = self.chosen.tolist(), self.top_vals.tolist(), self.top_ids.tolist()
        ranks = self.ranks.tolist()
        out = []
        start = 0
        for row, n, first, k in zip(self.rows, self.counts, self.first, self.ks):
            lead = 1 if first else 0
            scores = PromptScores([None] * lead, [None] * lead, [[]] * lead)
            scores.logprobs += chosen[start : start + n]
            scores.ranks += ranks[start : start + n]
            scores.top += [list(zip(ids[j][:k], vals[j][:k])) for j in range(start, start + n)]
            out.append((row, scores))
            start += n
        return out


def wants_prompt_logprobs(batch: ScheduleBatch) -> list[int]:
    """Rows of a prefill whose requests ask for prompt logprobs and have not had them (a
    retracted request re-prefills after its first token: it had them). A mixed batch's decode
    rows are not prefilled (under overlap their first token may not be on the host yet)."""
    prefilled = batch.reqs[: batch.batch_size - batch.decode_rows]
    return [i for i, r in enumerate(prefilled)
            if r.sampling_params.prompt_logprobs is not None and not r.output_ids]  # fmt: skip


def score_prompts(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    batch: ScheduleBatch,
    rows: list[int],
) -> PromptLogprobs:
    """Prompt logprobs of `rows` of an extend batch. `hidden` [T, H] are the final hidden states
    of every extend token; `compute_logits` maps hidden rows to logits (model dtype)."""
    assert batch.prefix_lens is not None and batch.extend_lens is not None
    starts = [0]
    for n in batch.extend_lens[:-1]:
        starts.append(starts[-1] + n)
    flat: list[int] = []
    targets: list[int] = []
    counts: list[int] = []
    for i in rows:
        prompt = batch.reqs[i].origin_input_ids
        pre, ext = batch.prefix_lens[i], batch.extend_lens[i]
        scored = range(pre, min(pre + ext, len(prompt) - 1))  # token p scores token p + 1
        flat += [starts[i] + p - pre for p in scored]
        targets += [prompt[p + 1] for p in scored]
        counts.append(len(scored))
    ks = [batch.reqs[i].sampling_params.prompt_logprobs or 0 for i in rows]
    k = max(ks)
    dev = hidden.device
    idx = tensor_to(flat, torch.long, dev)
    tgt = tensor_to(targets, torch.long, dev)
    first = [batch.prefix_lens[i] == 0 for i in rows]
    chosen = [torch.zeros(0, device=dev)]  # one-token prompts score nothing but the None
    ranks = [torch.zeros(0, dtype=torch.long, device=dev)]
    vals = [torch.zeros(0, k, device=dev)]
    ids = [torch.zeros(0, k, dtype=torch.long, device=dev)]
    for lo in range(0, len(flat), ROWS_PER_CHUNK):
        rows_logits = compute_logits(hidden[idx[lo : lo + ROWS_PER_CHUNK]]).float()
        logp = torch.log_softmax(rows_logits, dim=-1)
        picked = logp.gather(-1, tgt[lo : lo + ROWS_PER_CHUNK, None])
        chosen.append(picked.squeeze(-1))
        ranks.append((logp > picked).sum(dim=-1) + 1)
        top = logp.topk(k, dim=-1)
        vals.append(top.values)
        ids.append(top.indices)
    return PromptLogprobs(rows, counts, first, ks, torch.cat(chosen).float(), torch.cat(ranks),
                          torch.cat(vals).float(), torch.cat(ids))  # fmt: skip

"""Penalties and logit bias, applied to the target's logits before temperature, top-k/p/min-p
and the greedy argmax (the order vLLM's sampler uses): `logit_bias` (a sparse add), `min_tokens`
(stop tokens masked while fewer outputs exist), then the repetition penalty (vLLM's: tokens in
the prompt or the output have positive logits divided by it, negative ones multiplied) and
OpenAI's frequency and presence penalties (`logit -= frequency * count + presence * (count > 0)`,
counted over output tokens only).

The functions are pure and take one row per distribution. Under speculation a verify of n nodes
per request has n rows per request, each with the counts of its own path: the committed counts
plus the draft tokens on the node's ancestor chain (`path_counts`), so each node sees exactly the
state target-only decoding would have had there. The device state and the batch glue are in
sampling/penalty_state.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PenaltyRows:
    """Per-row parameters of the rows that carry any penalty or bias (device tensors, [R]).

    `bias_*` and `stop_*` are sparse entries whose `*_row` index these R rows."""

    frequency: torch.Tensor  # [R] fp32
    presence: torch.Tensor  # [R] fp32
    repetition: torch.Tensor  # [R] fp32, 1.0 = off
    min_tokens: torch.Tensor  # [R] int64, 0 = off
    bias_row: torch.Tensor  # [B] int64
    bias_token: torch.Tensor  # [B] int64
    bias_value: torch.Tensor  # [B] fp32
    stop_row: torch.Tensor  # [S] int64: tokens masked while the output is below min_tokens
    stop_token: torch.Tensor  # [S] int64
    # Host: whether any row needs the counts (penalties or min_tokens); bias alone does not.
    uses_counts: bool

    def repeat_interleave(self, n: int) -> PenaltyRows:
        """n rows per row (a verify's nodes): row r becomes rows r * n .. r * n + n - 1."""
        dev = self.frequency.device
        offs = torch.arange(n, device=dev)

        def spread(rows: torch.Tensor) -> torch.Tensor:
            return (rows[:, None] * n + offs[None, :]).reshape(-1)

        return PenaltyRows(
            self.frequency.repeat_interleave(n),
            self.presence.repeat_interleave(n),
            self.repetition.repeat_interleave(n),
            self.min_tokens.repeat_interleave(n),
            spread(self.bias_row),
            self.bias_token.repeat_interleave(n),
            self.bias_value.repeat_interleave(n),
            spread(self.stop_row),
            self.stop_token.repeat_interleave(n),
            self.uses_counts,
        )


def apply_logit_bias(
    logits: torch.Tensor, row: torch.Tensor, token: torch.Tensor, value: torch.Tensor
) -> torch.Tensor:
    """logits [R, V] + the sparse entries (row, token, value); repeated entries add up."""
    return logits.index_put((row, token), value.to(logits.dtype), accumulate=True)


def apply_min_tokens(
    logits: torch.Tensor,
    out_lens: torch.Tensor,
    min_tokens: torch.Tensor,
    stop_row: torch.Tensor,
    stop_token: torch.Tensor,
) -> torch.Tensor:
    """Stop tokens of rows whose output has fewer than min_tokens tokens get -inf."""
    below = out_lens[stop_row] < min_tokens[stop_row]  # [S]
    add = torch.where(below, float("-inf"), 0.0).to(logits.dtype)
    # Adding -inf or 0: a token listed twice (EOS also a stop id) gives the same result.
    return logits.index_put((stop_row, stop_token), add, accumulate=True)


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """logits [R, V] fp32; counts [R, V] output-token counts; prompt_mask [R, V] bool.

    Neutral rows (0, 0, 1.0) come back bit for bit."""
    counts = counts.to(logits.dtype)
    in_output = counts > 0
    seen = prompt_mask | in_output
    rep = repetition[:, None].to(logits.dtype)
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, scaled, logits)
    logits = logits - frequency[:, None] * counts
    return logits - presence[:, None] * in_output.to(logits.dtype)


def apply_all(
    logits: torch.Tensor,
    params: PenaltyRows,
    counts: torch.Tensor | None,
    prompt_mask: torch.Tensor | None,
    out_lens: torch.Tensor | None,
) -> torch.Tensor:
    """Bias, min_tokens, then the penalties, for rows that match `params` one to one. The
    counts, prompt mask and output lengths may be None when `params.uses_counts` is False."""
    logits = apply_logit_bias(logits.float(), params.bias_row, params.bias_token,
                              params.bias_value)  # fmt: skip
    if not params.uses_counts:
        return logits
    assert counts is not None and prompt_mask is not None and out_lens is not None
    logits = apply_min_tokens(logits, out_lens, params.min_tokens, params.stop_row,
                              params.stop_token)  # fmt: skip
    return apply_penalties(logits, counts, prompt_mask, params.frequency, params.presence,
                           params.repetition)  # fmt: skip


def path_counts(tokens: torch.Tensor, ancestors: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token counts along each node's path in a verify tree, the root excluded (its token is
    already committed). tokens [R, n]; ancestors [R, n, n] bool, ancestors[r, i, j] = node j is
    node i or one of its ancestors (a chain: lower triangular) -> [R, n, V] int32."""
    r, n = tokens.shape
    on_path = ancestors.clone()
    on_path[:, :, 0] = False
    out = torch.zeros(r, n, vocab_size, dtype=torch.int32, device=tokens.device)
    return out.scatter_add_(2, tokens[:, None, :].expand(r, n, n), on_path.to(torch.int32))

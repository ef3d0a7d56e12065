"""Penalty state on the device and the per-batch glue between it and the sampler.

`PenaltyState` keeps, per request slot, the output token counts, the prompt's token set and the
output length. A worker resets a slot's row when its request is prefilled (from the host token
lists, which are exact then: a retracted request brings its outputs) and adds every token it
commits; nothing is read back to the host. `BatchPenalties` is built on the host with the
batch's `SamplingInfo` and turns a forward's logits into penalized ones: one row per request
for a prefill or decode, one row per node for a verify (sampling/penalties.py `path_counts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagleserve.core import Req
from eagleserve.device import tensor_to
from eagleserve.sampling.penalties import PenaltyRows, apply_all, path_counts


class PenaltyState:
    """Output counts, prompt token sets and output lengths per request slot, on the device.

    Allocated at the first request that needs them ([slots, V] int32 + bool); a slot's row is
    valid from its request's prefill (`reset`) on, for as long as every token the request
    commits goes through `commit`."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.device = device
        self.counts: torch.Tensor | None = None  # [slots, V] int32
        self.prompt_mask: torch.Tensor | None = None  # [slots, V] bool
        self.out_lens: torch.Tensor | None = None  # [slots] int64

    def _allocate(self) -> None:
        if self.counts is None:
            shape, dev = (self.num_slots, self.vocab_size), self.device
            self.counts = torch.zeros(shape, dtype=torch.int32, device=dev)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=dev)
            self.out_lens = torch.zeros(self.num_slots, dtype=torch.int64, device=dev)

    def reset(self, slots: list[int], prompts: list[list[int]], outputs: list[list[int]]) -> None:
        """Rows of `slots` from the host token lists (a prefill; a retracted request brings the
        outputs it had)."""
        self._allocate()
        assert self.counts is not None and self.prompt_mask is not None
        assert self.out_lens is not None
        dev = self.device
        idx = tensor_to(slots, torch.long, dev)
        self.counts[idx] = 0
        self.prompt_mask[idx] = False
        self.out_lens[idx] = tensor_to([len(o) for o in outputs], torch.int64, dev)
        p_rows = [s for s, p in zip(slots, prompts) for _ in p]
        p_toks = [t for p in prompts for t in p]
        self.prompt_mask[tensor_to(p_rows, torch.long, dev),
                         tensor_to(p_toks, torch.long, dev)] = True  # fmt: skip
        o_rows = [s for s, o in zip(slots, outputs) for _ in o]
        o_toks = [t for o in outputs for t in o]
        if o_toks:
            ones = torch.ones(len(o_toks), dtype=torch.int32, device=dev)
            self.counts.index_put_(
                (tensor_to(o_rows, torch.long, dev), tensor_to(o_toks, torch.long, dev)),
                ones, accumulate=True,
            )  # fmt: skip

    def commit(self, slots: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Adds the committed tokens: slots [bs], tokens [bs, w], valid [bs, w] (None: all)."""
        if self.counts is None:
            return
        assert self.out_lens is not None
        take = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid
        rows = slots[:, None].expand_as(tokens)
        self.counts.index_put_((rows, tokens.clamp(min=0)), take.to(torch.int32),
                               accumulate=True)  # fmt: skip
        self.out_lens.index_add_(0, slots, take.sum(dim=1))

    def rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(counts [m, V], prompt_mask [m, V], out_lens [m]) of the given slots."""
        assert self.counts is not None and self.prompt_mask is not None
        assert self.out_lens is not None
        return self.counts[slots], self.prompt_mask[slots], self.out_lens[slots]


@dataclass(frozen=True)
class BatchPenalties:
    """The rows of a batch with penalties or bias, their parameters, and (prefilled rows) the
    slots to reset with their host token lists."""

    rows: torch.Tensor  # [R] int64 batch rows
    params: PenaltyRows
    resets: tuple[list[int], list[list[int]], list[list[int]]] | None

    @classmethod
    def of_reqs(
        cls, reqs: list[Req], vocab_size: int, device: torch.device, prefill_rows: int
    ) -> BatchPenalties | None:
        """`prefill_rows`: the first rows are prefilled, so their counts restart from their host
        tokens; a decoding row's counts go on (under overlap its host tokens lag a step)."""
        rows = [i for i, r in enumerate(reqs)
                if r.sampling_params.has_penalties or r.sampling_params.logit_bias]  # fmt: skip
        if not rows:
            return None
        ps = [reqs[i].sampling_params for i in rows]
        bias = [(j, t, v) for j, p in enumerate(ps) for t, v in p.logit_bias.items()]
        stops = [(j, t) for j, i in enumerate(rows) for t in stop_tokens(reqs[i], vocab_size)]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return tensor_to(values, dtype, device)

        params = PenaltyRows(
            frequency=tensor([p.frequency_penalty for p in ps], torch.float32),
            presence=tensor([p.presence_penalty for p in ps], torch.float32),
            repetition=tensor([p.repetition_penalty for p in ps], torch.float32),
            min_tokens=tensor([p.min_tokens for p in ps], torch.long),
            bias_row=tensor([b[0] for b in bias], torch.long),
            bias_token=tensor([b[1] for b in bias], torch.long),
            bias_value=tensor([b[2] for b in bias], torch.float32),
            stop_row=tensor([s[0] for s in stops], torch.long),
            stop_token=tensor([s[1] for s in stops], torch.long),
            uses_counts=any(p.has_penalties for p in ps),
        )
        resets = None
        counted = [reqs[i] for i, p in zip(rows, ps) if p.has_penalties and i < prefill_rows]
        if counted:
            assert all(r.req_pool_idx is not None for r in counted)
            resets = (
                [r.req_pool_idx for r in counted],  # type: ignore[misc]
                [list(r.origin_input_ids) for r in counted],
                [list(r.output_ids) for r in counted],
            )
        return cls(tensor(rows, torch.long), params, resets)

    def _state_rows(
        self, state: PenaltyState, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple[None, None, None]:
        if not self.params.uses_counts:
            return None, None, None
        return state.rows(slots[self.rows])

    def next_logits(
        self, logits: torch.Tensor, state: PenaltyState, slots: torch.Tensor
    ) -> torch.Tensor:
        """logits [bs, V] of a prefill or decode (row i: the request in slot slots[i])."""
        counts, prompt, lens = self._state_rows(state, slots)
        out = logits.float().clone()
        out[self.rows] = apply_all(out[self.rows], self.params, counts, prompt, lens)
        return out

    def verify_logits(
        self,
        logits: torch.Tensor,
        state: PenaltyState,
        slots: torch.Tensor,
        tokens: torch.Tensor,
        ancestors: torch.Tensor,
        depths: torch.Tensor,
    ) -> torch.Tensor:
        """logits [bs, n, V] of a verify: node i of request b sees the committed counts plus the
        tokens on its path (tokens [bs, n], ancestors [bs, n, n], depths [bs, n])."""
        bs, n, vocab = logits.shape
        r = int(self.rows.shape[0])
        sub = logits[self.rows].reshape(r * n, vocab).float()
        counts, prompt, lens = self._state_rows(state, slots)
        if counts is not None:
            assert prompt is not None and lens is not None
            path = path_counts(tokens[self.rows], ancestors[self.rows], vocab)
            counts = (counts[:, None] + path).reshape(r * n, vocab)
            prompt = prompt[:, None].expand(r, n, vocab).reshape(r * n, vocab)
            lens = (lens[:, None] + depths[self.rows]).reshape(-1)
        out = logits.float().clone()
        out[self.rows] = apply_all(sub, self.params.repeat_interleave(n), counts, prompt,
                                   lens).view(r, n, vocab)  # fmt: skip
        return out

    def reset(self, state: PenaltyState) -> None:
        """A prefill batch: the counted requests' rows start from their host token lists."""
        if self.resets is not None:
            state.reset(*self.resets)

    def commit(
        self,
        state: PenaltyState,
        slots: torch.Tensor,
        tokens: torch.Tensor,
        valid: torch.Tensor | None = None,
    ) -> None:
        """tokens [bs, w] committed this forward (valid [bs, w]; None: all of them)."""
        if self.params.uses_counts:
            keep = None if valid is None else valid[self.rows]
            state.commit(slots[self.rows], tokens[self.rows], keep)


def stop_tokens(req: Req, vocab_size: int) -> list[int]:
    """Tokens masked while `req` is below min_tokens: EOS (unless ignored) and its stop ids, in
    the vocabulary; none when they would be the whole vocabulary (no token left to sample)."""
    p = req.sampling_params
    if p.min_tokens <= 0:
        return []
    ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids))
    ids = {t for t in ids if 0 <= t < vocab_size}
    return sorted(ids) if len(ids) < vocab_size else []

"""Target-only generation: one forward, then sampling (and logprobs when asked for)."""

from __future__ import annotations

import torch

from eagleserve.core import ScheduleBatch
from eagleserve.model.runner import ModelRunner
from eagleserve.model.sampler import SamplingInfo, sample, top_logprobs
from eagleserve.scheduler.output_processor import GenerationBatchResult


def forward_inputs(batch: ScheduleBatch) -> dict[str, torch.Tensor]:
    """Positions and per-request lengths of an extend or decode batch, on the batch's device."""
    dev = batch.device
    if batch.mode == "extend":
        ext = batch.extend_lens
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(batch.prefix_lens, ext)])
        extend_lens = torch.tensor(ext, dtype=torch.long, device=dev)
        return dict(
            positions=positions.to(dev),
            prefix_lens=torch.tensor(batch.prefix_lens, dtype=torch.long, device=dev),
            extend_lens=extend_lens,
            logits_indices=torch.cumsum(extend_lens, 0) - 1,
        )
    ones = torch.ones_like(batch.seq_lens)
    return dict(
        positions=batch.seq_lens - 1,
        prefix_lens=batch.seq_lens - 1,
        extend_lens=ones,
        logits_indices=None,
    )


def sample_with_logprobs(
    logits: torch.Tensor, batch: ScheduleBatch, vocab_size: int
) -> GenerationBatchResult:
    info = SamplingInfo.from_reqs(batch.reqs, vocab_size, logits.device)
    next_ids = sample(logits, info)
    k = max((r.sampling_params.logprobs or 0) for r in batch.reqs)
    if any(r.sampling_params.logprobs is not None for r in batch.reqs):
        chosen, vals, ids = top_logprobs(logits, next_ids, k)
        return GenerationBatchResult(next_ids, None, chosen, vals, ids)
    return GenerationBatchResult(next_ids)


class TargetWorker:
    decode_slots_per_req = 1

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.req_to_token_pool = runner.req_to_token_pool
        self.token_to_kv_pool = runner.token_to_kv_pool

    def prepare_for_decode(self, batch: ScheduleBatch) -> None:
        batch.prepare_for_decode(self.req_to_token_pool, self.token_to_kv_pool)

    def forward_batch_generation(self, batch: ScheduleBatch) -> GenerationBatchResult:
        out = self.runner.forward(
            batch.mode,
            batch.input_ids,
            out_cache_loc=batch.out_cache_loc,
            req_pool_indices=batch.req_pool_indices,
            **forward_inputs(batch),
        )
        result = sample_with_logprobs(out.logits, batch, self.runner.config.vocab_size)
        # The sampled tokens are the next decode step's inputs.
        batch.input_ids = result.next_token_ids
        return result

    def extend_to_decode(self, batch: ScheduleBatch) -> None:
        batch.mode = "decode"
        batch.prefix_lens = batch.extend_lens = None

"""Target-only generation: one forward, then sampling (and logprobs when asked for)."""

from __future__ import annotations

from eagleserve.config import ServerArgs
from eagleserve.core import GenerationBatchResult, ScheduleBatch
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.sampling.prompt_logprobs import score_prompts, wants_prompt_logprobs
from eagleserve.sampling.sampler import sample_next


class TargetWorker:
    decode_slots_per_req = 1

    def __init__(self, runner: ModelRunner, args: ServerArgs) -> None:
        self.runner = runner
        self.req_to_token_pool = runner.req_to_token_pool
        self.token_to_kv_pool = runner.token_to_kv_pool
        if runner.graphs_enabled(args):
            runner.capture_graphs(args.graph_max_bs(), (), False)

    def prepare_for_decode(self, batch: ScheduleBatch) -> None:
        batch.prepare_for_decode(self.req_to_token_pool, self.token_to_kv_pool)

    def forward_batch_generation(self, batch: ScheduleBatch) -> GenerationBatchResult:
        out = self.runner.forward_batch(batch)
        info = self.runner.sampling_info(batch)
        # seq_lens counts this forward's tokens: it is where each sampled token will sit.
        assert batch.seq_lens is not None
        result = sample_next(
            out.logits,
            batch.reqs,
            info,
            batch.seq_lens,
            self.runner.penalty_state,
            batch.req_pool_indices,
            prefill=batch.mode == "extend",
            constraint=batch.constraint,
        )
        scored = wants_prompt_logprobs(batch) if batch.mode == "extend" else []
        if scored:
            model = self.runner.model
            result.prompt_logprobs = score_prompts(
                model.compute_logits, out.hidden_states, batch, scored
            )
        # The sampled tokens are the next decode step's inputs.
        batch.input_ids = result.next_token_ids
        return result

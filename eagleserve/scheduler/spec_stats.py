"""Engine-wide speculative statistics, counted per request and iteration from verify results."""

from __future__ import annotations

import dataclasses

from eagleserve.config import SpecConfig
from eagleserve.core import Req
from eagleserve.messages import EngineStats
from eagleserve.spec.adaptive import ACCEPT_PRIOR, record_verify, update_acceptance


class SpecStats:
    def __init__(self, spec: SpecConfig | None, acceptance_prior: list[float] | None) -> None:
        self.spec = spec
        num_steps = spec.num_steps if spec else 0
        self.verify_calls = 0
        self.accepted_tokens = 0
        self.accepted_per_position = [0] * num_steps
        self.proposed_tokens = 0
        self.iterations_per_num_drafts = [0] * (num_steps + 1 if num_steps else 0)
        # Engine-wide acceptance by depth: /metrics, and what each request's estimate is shrunk
        # towards (spec/adaptive.py).
        self.acceptance_ema = list(acceptance_prior or [ACCEPT_PRIOR] * num_steps)
        self.acceptance_judged = [0] * num_steps  # verifies that judged each depth

    def count_verify(self, req: Req, num_drafts: int | None, accepted: int) -> None:
        """Speculative statistics of one request's iteration; a k = 0 iteration (adaptive) is
        a plain decode and no verify."""
        k = len(self.accepted_per_position) if num_drafts is None else num_drafts
        if self.iterations_per_num_drafts:
            self.iterations_per_num_drafts[k] += 1
        if k == 0:
            return
        if req.spec_trials:
            record_verify(req.spec_hits, req.spec_trials, k, accepted - 1)
        update_acceptance(self.acceptance_ema, self.acceptance_judged, k, accepted - 1)
        req.spec_verify_ct += 1
        req.spec_accepted_tokens += accepted
        self.verify_calls += 1
        self.accepted_tokens += accepted
        spec = self.spec
        assert spec is not None
        self.proposed_tokens += k if spec.is_chain else spec.num_draft_tokens - 1
        for d in range(min(accepted - 1, len(self.accepted_per_position))):
            self.accepted_per_position[d] += 1

    def with_spec_fields(self, stats: EngineStats) -> EngineStats:
        """`stats` with its speculative fields from these counts."""
        return dataclasses.replace(
            stats,
            spec_verify_calls_total=self.verify_calls,
            spec_accepted_tokens_total=self.accepted_tokens,
            spec_accepted_per_position=list(self.accepted_per_position),
            spec_proposed_tokens_total=self.proposed_tokens,
            spec_iterations_per_num_drafts=list(self.iterations_per_num_drafts),
            spec_acceptance_ema=list(self.acceptance_ema),
        )

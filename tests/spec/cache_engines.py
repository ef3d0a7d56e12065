"""`engine`: an engine of the lossless target (lossless_fixtures.py) with the prefix cache on or
off, target-only or speculating by one of the `SPEC` settings (chain, tree, adaptive depth),
pool-checked after the test. test_prefix_cache.py's, shared with test_chunked_prefill.py."""

from __future__ import annotations

from typing import Any

from conftest import track
from lossless_fixtures import script_choices

from eagleserve import Engine

SPEC: dict[str, dict[str, Any]] = {
    "target": {},
    "chain": dict(speculative_num_steps=3, speculative_eagle_topk=1,
                  speculative_num_draft_tokens=4),
    "tree": dict(speculative_num_steps=3, speculative_eagle_topk=2,
                 speculative_num_draft_tokens=6),
    "adaptive": dict(speculative_num_steps=3, speculative_eagle_topk=1,
                     speculative_num_draft_tokens=4, speculative_adaptive=True,
                     speculative_adaptive_probe_interval=8),
}  # fmt: skip


def engine(target: str, head: str, spec: str, cache: bool, overlap: bool, **kw: Any) -> Engine:
    extra = dict(SPEC[spec])
    if extra:
        extra.update(speculative_algorithm="EAGLE", speculative_draft_model_path=head)
    eng = Engine(
        model=target,
        device="cpu",
        max_total_tokens=kw.pop("max_total_tokens", 2048),
        max_running_requests=kw.pop("max_running_requests", 8),
        disable_overlap_schedule=not overlap,
        disable_radix_cache=not cache,
        **extra,
        **kw,
    )
    if spec == "adaptive":  # held head inputs at every finish: k = 0 stretches and catch-ups
        script_choices(eng, [0, 0, 3, 1, 0, 2])
    return track(eng)  # type: ignore[return-value]

"""A tree's draft steps run on the target's attention backend: with Triton (on a GPU for real,
elsewhere in the interpreter) the head's tree-mask forwards see what the torch backend's padded
SDPA lets them see, so the drafts, the acceptance and the (greedy, target-only) tokens match."""

from __future__ import annotations

import random

import pytest
import triton_mode  # noqa: F401  (before triton: the interpreter where no GPU is present)
from lossless_fixtures import heads, target_dir

from eagleserve import Engine, SamplingParams
from eagleserve.layers.triton_backend import TritonAttnBackend

pytestmark = pytest.mark.usefixtures("torch_threads")
__all__ = ["heads", "target_dir"]  # module-scoped fixtures of lossless_fixtures
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=5)


def test_tree_drafts_on_triton_equal_the_torch_backend(
    target_dir: str, heads: dict[str, str]
) -> None:
    rng = random.Random()
    prompts = [[rng.randrange(1, 90) for _ in range(n)] for n in (5, rng.randrange(8, 20))]
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    common = dict(model=target_dir, device=str(triton_mode.DEVICE), dtype="float32",
                  max_total_tokens=1024, max_running_requests=4, disable_overlap_schedule=True,
                  disable_cuda_graph=True)  # fmt: skip
    spec = dict(TREE, speculative_algorithm="EAGLE", speculative_draft_model_path=heads["EAGLE"])
    expect = [o["token_ids"] for o in Engine(**common).generate(prompts, params)]
    runs = {}
    for backend in ("triton", "torch"):
        eng = Engine(**common, attention_backend=backend, **spec)
        drafter = eng.scheduler.worker.drafter
        assert isinstance(drafter.attn_backend, TritonAttnBackend) == (backend == "triton")
        tokens = [o["token_ids"] for o in eng.generate(prompts, params)]
        stats = eng.stats()
        runs[backend] = (tokens, stats.spec_accepted_per_position, stats.spec_verify_calls_total)
    assert runs["triton"][0] == expect, prompts
    assert runs["triton"] == runs["torch"], prompts  # the same drafts accepted at every depth
    assert sum(runs["triton"][1]) > 0  # the crafted head's drafts do get accepted

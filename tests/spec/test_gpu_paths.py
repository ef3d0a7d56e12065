"""On an accelerator (skipped without one): Triton attention and device graphs give the same
greedy tokens as the CPU path, target-only and with EAGLE chains and trees, overlap on."""

from __future__ import annotations

import pytest
import torch
from test_eagle_lossless import _params, _prompts, heads, reference, run_staggered, target_dir

from eagleserve import Engine

pytestmark = pytest.mark.skipif(
    not torch.accelerator.is_available(), reason="needs a GPU (run on a lent device)"
)
__all__ = ["heads", "reference", "target_dir"]  # module-scoped fixtures shared with the CPU test

SPEC_CASES = [
    (None, 1, 1, 1),
    ("EAGLE", 3, 1, 4),
    ("EAGLE", 5, 1, 6),
    ("EAGLE", 3, 2, 6),
    ("EAGLE3", 4, 1, 5),
    ("EAGLE3", 2, 4, 8),
]


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "no-graphs"])
@pytest.mark.parametrize(("algo", "steps", "topk", "ndt"), SPEC_CASES)
def test_gpu_greedy_equals_cpu(
    target_dir: str,
    heads: dict[str, str],
    reference: list[list[int]],
    algo: str | None,
    steps: int,
    topk: int,
    ndt: int,
    graphs: bool,
) -> None:
    kw = {}
    if algo:
        kw = dict(
            speculative_algorithm=algo,
            speculative_draft_model_path=heads[algo],
            speculative_num_steps=steps,
            speculative_eagle_topk=topk,
            speculative_num_draft_tokens=ndt,
        )
    eng = Engine(
        model=target_dir,
        device="cuda",
        dtype="float32",
        kv_cache_tokens=2048,
        max_running_requests=8,
        attention_backend="triton",
        cuda_graph_max_bs=8,
        disable_cuda_graph=not graphs,
        **kw,
    )
    runner = eng.scheduler.worker.runner if algo is None else eng.scheduler.worker.runner
    assert bool(runner.graphs) == graphs
    if algo:  # a chain drafts through one graph of all its steps (a failed capture fails here)
        assert bool(eng.scheduler.worker.drafter.loop_graphs) == (graphs and topk == 1)
    got = run_staggered(eng, _prompts(0), _params())
    assert got == reference

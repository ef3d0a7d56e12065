"""The chain draft loop's device graph is captured by running `DraftLoops.chain` once per bucket on
the static batch (GraphedForward.run_fn). Each of its k steps opens its own forward context,
and contexts do not nest, so the capture must not open one around the loop: on a GPU that
made every capture fail and every draft fall back to step-by-step replays.

The Triton backend (the one with static graph metadata) runs in the interpreter on a CPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from lossless_fixtures import heads, target_dir  # noqa: E402

from eagleserve import Engine  # noqa: E402

__all__ = ["heads", "target_dir"]  # module-scoped fixtures of lossless_fixtures


def test_loop_capture_runs_the_eager_chain_without_nesting(
    target_dir: str, heads: dict[str, str]
) -> None:
    steps = 3
    eng = Engine(
        model=target_dir,
        device="cuda" if torch.cuda.is_available() else "cpu",
        max_total_tokens=512,
        max_running_requests=2,
        attention_backend="triton",
        disable_cuda_graph=True,
        disable_overlap_schedule=True,
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=heads["EAGLE"],
        speculative_num_steps=steps,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=steps + 1,
    )
    drafter = eng.scheduler.worker.drafter
    dtype = next(drafter.head.parameters()).dtype
    graph = drafter.loops.graph(steps, 2, dtype, drafter.device)
    fb, extras = graph.bucket_batch(2)
    g = torch.Generator().manual_seed(3)
    extras["topk_index"].copy_(torch.randint(1, 60, extras["topk_index"].shape, generator=g))
    extras["hidden"].copy_(torch.randn(extras["hidden"].shape, generator=g).to(dtype))
    extras["topk_p"].fill_(1.0)
    fb.prefix_lens.copy_(torch.tensor([4, 9]))
    fb.req_pool_indices.copy_(torch.tensor([0, 1]))

    captured = [t.clone() for t in graph.run_fn(fb, extras)]  # what capture and warm-up run
    eager = drafter.loops.chain(fb, extras, steps)  # the loop as the eager path runs it
    assert all(torch.equal(a, b) for a, b in zip(captured, eager))
    assert captured[2].shape[0] == 2 and captured[2].numel() > 2  # k drafts for each request

    graph.own_context = True  # a context around the whole loop, as the capture used to open
    with pytest.raises(RuntimeError, match="does not nest"):
        graph.run_fn(fb, extras)

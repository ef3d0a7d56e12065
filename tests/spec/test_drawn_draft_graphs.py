"""A chain's drafts for sampled requests drawn inside the device graphs (spec/draft_extend.py
`GraphDraftDraw`, one draft-loop and seed-extend graph per draw mode), run on a CPU through the
graph stand-in (graph_standin.py) under the Triton interpreter: every verify sees the drafts the
eager path draws for the same batch, the graphs of each batch's mode replay (a batch whose
sampled requests have finished drafts in the argmax ones), and the output stays the target's
own for each seed."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
import torch

if torch.cuda.is_available():  # the real path runs there: tests/spec/test_gpu_paths.py
    pytest.skip("a CPU stand-in for a GPU's graphs", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
pytest.importorskip("triton")

from graph_standin import ReplayCount, graphs_on_cpu  # noqa: E402
from lossless_fixtures import (  # noqa: E402
    VOCAB,
    heads,
    run_drafts_recorded,
    sampled_batches,
    target_dir,
)

from eagleserve import Engine, SamplingParams  # noqa: E402
from eagleserve.kernels import cpu_ext, triton_top1  # noqa: E402
from eagleserve.model_executor import model_runner  # noqa: E402
from eagleserve.sampling import sampler  # noqa: E402
from eagleserve.spec import draft_extend  # noqa: E402

__all__ = ["heads", "target_dir"]  # module-scoped fixtures of lossless_fixtures

CHAIN3 = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)


@pytest.fixture
def graphs(monkeypatch: pytest.MonkeyPatch) -> Iterator[ReplayCount]:
    with graphs_on_cpu(monkeypatch) as count:
        yield count


def _engine(target_dir: str, **kw: object) -> Engine:
    """Rows of 48 tokens: the prompts here and their answers fit, and a start-up captures the
    prefill graphs of buckets 16 and 32 only (each capture a forward under the interpreter)."""
    eng = Engine(model=target_dir, device="cpu", max_total_tokens=256, max_running_requests=3,
                 attention_backend="triton", disable_overlap_schedule=True,
                 disable_radix_cache=True, context_length=48, **kw)  # fmt: skip
    worker = eng.scheduler.worker
    if hasattr(worker, "paths"):
        worker.paths.fixed_shape = True  # as on an accelerator: every path row runs
    return eng


def _target_tokens(
    target_dir: str, prompts: list[list[int]], params: list[SamplingParams]
) -> list[list[int]]:
    """Target-only's tokens, eagerly: the same kernels a graph replays."""
    eng = _engine(target_dir, disable_cuda_graph=True)
    return [o["token_ids"] for o in eng.generate(prompts, params)]


# The draw kernels: the C++ sampler's (a CPU's), and the Triton draws an accelerator's graphs
# run (kernels/triton_sample.py; kernels/triton_top1.py's `drawn_top1` for unfiltered drafts),
# here under the interpreter.
@pytest.mark.parametrize(("head", "kernel"), [("EAGLE", "cpu"), ("EAGLE3", "triton")])
def test_sampled_drafts_in_graphs_are_the_eager_draws(
    target_dir: str,
    heads: dict[str, str],
    graphs: ReplayCount,
    monkeypatch: pytest.MonkeyPatch,
    head: str,
    kernel: str,
) -> None:
    if kernel == "cpu" and not cpu_ext.load():
        pytest.skip("the C++ sampler does not build here")
    monkeypatch.setattr(model_runner, "draw_kernel", lambda device: kernel)
    launched: list[str] = []
    real_drawn_top1 = triton_top1.drawn_top1

    def count_drawn_top1(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        launched.append("drawn_top1")
        return real_drawn_top1(*args)

    monkeypatch.setattr(triton_top1, "drawn_top1", count_drawn_top1)
    rng = random.Random()
    prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(rng.randrange(3, 9))] for _ in range(3)]
    batches = sampled_batches()
    spec = dict(speculative_algorithm=head, speculative_draft_model_path=heads[head], **CHAIN3)
    target_only, _ = run_drafts_recorded(
        _engine(target_dir, disable_cuda_graph=True), prompts, batches, monkeypatch
    )
    eager, eager_drafts = run_drafts_recorded(
        _engine(target_dir, disable_cuda_graph=True, **spec), prompts, batches, monkeypatch
    )
    eng = _engine(target_dir, **spec)
    drafter = eng.scheduler.worker.drafter
    assert drafter.draw_modes == ("argmax", "drawn", "drawn_filtered")
    graphed, graphed_drafts = run_drafts_recorded(eng, prompts, batches, monkeypatch)
    assert eager == target_only and graphed == target_only  # each seed's own tokens
    assert len(graphed_drafts) >= 6 and graphed_drafts == eager_drafts
    assert drafter.extend_graphs is not None
    for mode, _ in batches:
        assert graphs.of(drafter.loop_graphs[3, mode]) > 0
        assert graphs.of(drafter.extend_graphs.graphs[4, mode]) > 0
    assert bool(launched) == (kernel == "triton")  # the one-launch draw drafted the "drawn" rows


def test_drawn_graphs_can_be_left_out(
    target_dir: str, heads: dict[str, str], graphs: ReplayCount, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EAGLESERVE_DISABLE_DRAWN_DRAFT_GRAPHS=1: only the argmax graphs are captured, and a
    sampled batch drafts in them (its output still the target's own)."""
    monkeypatch.setenv("EAGLESERVE_DISABLE_DRAWN_DRAFT_GRAPHS", "1")
    eng = _engine(target_dir, speculative_algorithm="EAGLE",
                  speculative_draft_model_path=heads["EAGLE"], **CHAIN3)  # fmt: skip
    drafter = eng.scheduler.worker.drafter
    assert sorted(drafter.loop_graphs) == [(3, "argmax")]
    _, params = sampled_batches()[0]
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    got = [o["token_ids"] for o in eng.generate(prompts, params)]
    want = _target_tokens(target_dir, prompts, params)
    assert got == want
    assert graphs.of(drafter.loop_graphs[3, "argmax"]) > 0


def test_a_drawn_graph_that_fails_to_capture_leaves_the_argmax_graphs(
    target_dir: str, heads: dict[str, str], graphs: ReplayCount, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drawn mode whose capture fails (its draw cannot run in a graph on this device) is
    dropped, with its graphs: the argmax graphs stay and serve every batch, a sampled one's
    output still the target's own. Before drawn graphs, such a failure would have cost the
    greedy graphs too."""
    real = sampler.sample_packed

    def broken(*args: object) -> torch.Tensor:
        if args[4]:  # filtered: the sort, say, cannot be captured here
            raise RuntimeError("not capturable")
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(draft_extend, "sample_packed", broken)
    eng = _engine(target_dir, speculative_algorithm="EAGLE",
                  speculative_draft_model_path=heads["EAGLE"], **CHAIN3)  # fmt: skip
    drafter = eng.scheduler.worker.drafter
    assert drafter.draw_modes == ("argmax", "drawn")
    assert sorted(drafter.loop_graphs) == [(3, "argmax"), (3, "drawn")]
    assert drafter.extend_graphs is not None
    assert {mode for _, mode in drafter.extend_graphs.graphs} == {"argmax", "drawn"}
    _, params = sampled_batches()[1]  # filtered: drafts in the argmax graphs now
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    got = [o["token_ids"] for o in eng.generate(prompts, params)]
    want = _target_tokens(target_dir, prompts, params)
    assert got == want
    assert graphs.of(drafter.loop_graphs[3, "argmax"]) > 0

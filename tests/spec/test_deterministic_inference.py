"""--enable-deterministic-inference: in bf16 on the Triton path, greedy EAGLE (chain and tree)
gives target-only's tokens exactly, with requests joining while others run (so the same row is
computed in batches of different sizes, as decode, verify and prefix-cached extend rows).

Without a GPU the kernels run in the Triton interpreter (slow: few, short requests)."""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from lossless_fixtures import heads, run_staggered, target_dir  # noqa: E402

from eagleserve import Engine, SamplingParams  # noqa: E402
from eagleserve.models.batch_invariant import BatchInvariantLinear  # noqa: E402

__all__ = ["heads", "target_dir"]  # module-scoped fixtures of lossless_fixtures
VOCAB_MAX = 90


def _engine(target_dir: str, **kw: object) -> Engine:
    return Engine(
        model=target_dir,
        device="cuda" if ON_GPU else "cpu",
        dtype="bfloat16",
        max_total_tokens=1024,
        max_running_requests=4,
        attention_backend="triton",
        enable_deterministic_inference=True,
        disable_overlap_schedule=True,
        **kw,  # type: ignore[arg-type]
    )


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, VOCAB_MAX, (n,), generator=g).tolist() for n in (5, 11, 3)]


def _params() -> list[SamplingParams]:
    n = 12 if ON_GPU else 4
    return [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for _ in range(3)]


@pytest.fixture(scope="module")
def reference(target_dir: str) -> list[list[int]]:
    eng = _engine(target_dir)
    model = eng.scheduler.worker.runner.model
    # The mode is on: every linear of the target runs the batch-invariant GEMM.
    assert isinstance(model.model.layers[0].mlp.down_proj, BatchInvariantLinear)
    assert model.batch_invariant
    return run_staggered(eng, _prompts(), _params())


@pytest.mark.parametrize(("steps", "topk", "ndt"), [(3, 1, 4), (2, 2, 4)], ids=["chain", "tree"])
def test_eagle_equals_target_only_in_bf16(
    target_dir: str, heads: dict[str, str], reference: list[list[int]], steps: int, topk: int,
    ndt: int,
) -> None:  # fmt: skip
    eng = _engine(
        target_dir,
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=heads["EAGLE"],
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=ndt,
    )
    assert run_staggered(eng, _prompts(), _params()) == reference

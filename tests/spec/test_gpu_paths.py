"""On an accelerator (skipped without one): Triton attention and device graphs (prefill graphs
among them) give the same greedy tokens as the CPU path, target-only and with EAGLE chains and
trees, overlap on; and in bf16, seeded sampling with speculation has the target-only
distribution."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from lossless_fixtures import (
    heads,
    params,
    prompts,
    reference,
    run_drafts_recorded,
    run_staggered,
    sampled_batches,
    target_dir,
)
from sampling_fixtures import N_SAMPLES, PROMPT, VOCAB, head_dir, small_target

from eagleserve import Engine, SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.accelerator.is_available(), reason="needs a GPU (run on a lent device)"
)
# module-scoped fixtures of lossless_fixtures and sampling_fixtures, shared with the CPU tests
__all__ = ["head_dir", "heads", "reference", "small_target", "target_dir"]

SPEC_CASES = [
    (None, 1, 1, 1),
    ("EAGLE", 3, 1, 4),
    ("EAGLE", 5, 1, 6),
    ("EAGLE", 3, 2, 6),
    ("EAGLE3", 4, 1, 5),
    ("EAGLE3", 2, 4, 8),
]


def gpu_engine(target_dir: str, heads: dict[str, str], algo: str | None, steps: int, topk: int,
               ndt: int, **kw: object) -> Engine:  # fmt: skip
    """A float32 engine of the tiny target on the GPU's Triton path, with the head of `algo`."""
    if algo:
        kw.update(speculative_algorithm=algo, speculative_draft_model_path=heads[algo],
                  speculative_num_steps=steps, speculative_eagle_topk=topk,
                  speculative_num_draft_tokens=ndt)  # fmt: skip
    return Engine(model=target_dir, device="cuda", dtype="float32", max_total_tokens=2048,
                  max_running_requests=8, attention_backend="triton", cuda_graph_max_bs=8,
                  **kw)  # fmt: skip


def test_gpu_sampled_drafts_in_graphs_are_the_eager_draws(
    target_dir: str, heads: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chain's sampled drafts drawn in the draft graphs of their draw mode (the one-launch
    draw for unfiltered rows) are the drafts the eager steps draw, in fp32, and each seed's
    output is target-only's (tests/spec/test_drawn_draft_graphs.py runs the same on a CPU).
    Three requests and graphs of at most three rows: no padding row changes a matmul's shape.
    First in the file: bench/gpu_check.py's tests stage may stop within it."""
    batches = sampled_batches(16)
    ps = prompts(1)[:3]
    kw = dict(model=target_dir, device="cuda", dtype="float32", max_total_tokens=2048,
              max_running_requests=3, cuda_graph_max_bs=3, attention_backend="triton")  # fmt: skip
    want, _ = run_drafts_recorded(Engine(**kw), ps, batches, monkeypatch)
    runs = []
    for graphs in (False, True):
        eng = Engine(**kw, speculative_algorithm="EAGLE3",
                     speculative_draft_model_path=heads["EAGLE3"], speculative_num_steps=3,
                     speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                     disable_cuda_graph=not graphs)  # fmt: skip
        drafter = eng.scheduler.worker.drafter
        assert {mode for _, mode in drafter.loop_graphs} == (
            {"argmax", "drawn", "drawn_filtered"} if graphs else set()
        )
        runs.append(run_drafts_recorded(eng, ps, batches, monkeypatch))
    (eager, eager_drafts), (graphed, graphed_drafts) = runs
    assert eager == want and graphed == want
    assert len(graphed_drafts) >= 10 and graphed_drafts == eager_drafts


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
    eng = gpu_engine(target_dir, heads, algo, steps, topk, ndt, disable_cuda_graph=not graphs)
    runner = eng.scheduler.worker.runner
    assert bool(runner.graphs) == graphs
    # Single prefills replay their bucket's graph (a failed capture, logged, fails here).
    assert (runner.prefill_graphs is not None) == graphs
    if algo:  # a draft of several steps runs as one graph (a failed capture fails here)
        assert bool(eng.scheduler.worker.drafter.loop_graphs) == (graphs and steps > 1)
    got = run_staggered(eng, prompts(0), params())
    assert got == reference


@pytest.mark.parametrize(("algo", "steps", "topk", "ndt"), [SPEC_CASES[0], SPEC_CASES[4]])
def test_gpu_greedy_with_pdl_equals_cpu(
    target_dir: str,
    heads: dict[str, str],
    reference: list[list[int]],
    algo: str | None,
    steps: int,
    topk: int,
    ndt: int,
) -> None:
    """--enable-pdl: the Triton kernels of every captured graph launched with programmatic
    dependencies give the CPU path's greedy tokens, target-only and with an EAGLE3 chain."""
    from eagleserve.kernels import pdl

    if not pdl.supported(torch.device("cuda")):
        pytest.skip("needs an NVIDIA GPU of compute capability 9.0 or later")
    try:
        eng = gpu_engine(target_dir, heads, algo, steps, topk, ndt, enable_pdl=True)
        assert pdl.launch_options(torch.device("cuda"))["launch_pdl"]
        assert run_staggered(eng, prompts(0), params()) == reference
    finally:
        pdl.configure(False, torch.device("cuda"))


def _joint_counts(eng: Engine, params: SamplingParams, n: int) -> np.ndarray:
    """Counts of the first three sampled tokens over n seeded requests of the same prompt."""
    seeded = [dataclasses.replace(params, seed=i) for i in range(n)]
    counts = np.zeros((VOCAB,) * 3)
    for o in eng.generate([PROMPT] * n, seeded):
        counts[tuple(o["token_ids"][:3])] += 1
    return counts / n


def two_sample_tv_threshold(p: np.ndarray, n: int, rng: np.random.Generator) -> float:
    """99.9th percentile of the TV distance between two independent n-sample histograms of p."""
    p = p.ravel() / p.sum()
    tvs = [0.5 * np.abs(rng.multinomial(n, p) - rng.multinomial(n, p)).sum() / n
           for _ in range(1000)]  # fmt: skip
    return float(np.quantile(tvs, 0.999))


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "default"])
@pytest.mark.parametrize(("steps", "topk", "ndt"), [(3, 1, 4), (3, 2, 6)], ids=["chain", "tree"])
def test_gpu_bf16_sampling_matches_target_only(
    small_target, head_dir, deterministic: bool, steps: int, topk: int, ndt: int
) -> None:
    """Seeded sampling in bf16 on the GPU: the joint of the first three tokens with speculation
    is the target-only joint of the same engine settings (a two-sample test: in bf16 the target's
    own distribution is the GPU's, not the fp32 reference's)."""
    path, _ = small_target
    params = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True)
    joints, rates = [], []
    for spec in (False, True):
        kw = dict(speculative_algorithm="EAGLE", speculative_draft_model_path=head_dir,
                  speculative_num_steps=steps, speculative_eagle_topk=topk,
                  speculative_num_draft_tokens=ndt) if spec else {}  # fmt: skip
        eng = Engine(model=path, device="cuda", dtype="bfloat16", max_total_tokens=32768,
                     max_running_requests=2048, attention_backend="triton",
                     enable_deterministic_inference=deterministic, **kw)  # fmt: skip
        joints.append(_joint_counts(eng, params, N_SAMPLES))
        if spec:
            stats = eng.stats()
            rates.append(stats.spec_accepted_tokens_total / stats.spec_verify_calls_total)
        eng.close()
    assert rates[0] > 1.2, "speculation accepted too little to test anything"
    threshold = two_sample_tv_threshold(joints[0], N_SAMPLES, np.random.default_rng(0))
    tv = 0.5 * np.abs(joints[1] - joints[0]).sum()
    assert tv < threshold, f"TV {tv:.4f} >= {threshold:.4f}"

"""Priority preemption changes no speculative token: requests decoding with EAGLE (chain, tree,
adaptive depth; overlap on and off) that a higher-priority request preempts resume from their
cached positions to the target's own greedy tokens, and so does a sampled request to its seeded
draws."""

from __future__ import annotations

import random

import pytest
import torch
from cache_engines import engine
from lossless_fixtures import VOCAB, heads, target_dir  # noqa: F401

from eagleserve import SamplingParams
from eagleserve.messages import GenerateReqInput

pytestmark = pytest.mark.usefixtures("torch_threads")


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("spec", ["chain", "tree", "adaptive"])
def test_preempted_speculating_requests_keep_their_tokens(
    target_dir: str,  # noqa: F811
    heads: dict[str, str],  # noqa: F811
    spec: str,
    overlap: bool,
) -> None:
    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB - 1, (n,), generator=g).tolist() for n in (9, 14, 6, 11)]
    params = [SamplingParams(max_new_tokens=18, temperature=0.0, ignore_eos=True)] * 3
    params.append(SamplingParams(max_new_tokens=18, temperature=0.9, seed=seed, ignore_eos=True))
    alone = engine(target_dir, heads["EAGLE"], "target", True, overlap)
    want = [alone.generate([p], sp)[0]["token_ids"] for p, sp in zip(prompts, params)]
    eng = engine(target_dir, heads["EAGLE"], spec, True, overlap, max_running_requests=2,
                 enable_priority_scheduling=True,
                 priority_scheduling_preemption_threshold=0)  # fmt: skip
    sched = eng.scheduler
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for out in sched.step():
            assert out.error is None, out.error
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)

    for i in (0, 1, 3):  # two decode; the sampled one waits
        sched.add_request(GenerateReqInput(f"r{i}", prompts[i], params[i], stream=True))
    while len(tokens.get("r1", [])) < 3:
        step()
    sched.add_request(GenerateReqInput("r2", prompts[2], params[2], priority=4))
    for _ in range(5000):
        if not sched.has_work():
            break
        step()
    assert sched.num_retracted >= 1, "nothing was preempted"
    assert [tokens[f"r{i}"] for i in range(4)] == want, f"seed {seed}"

"""scheduler/warmup.py: the start-up warm-up generates alone and in a batch of 16, then leaves
the scheduler as it found it (every slot free, nothing cached, statistics and the adaptive
probe rhythm unchanged), and the engine's output after it equals a fresh engine's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import track
from random_llama import head_dir, model_dir  # noqa: F401  (the fixtures)

from eagleserve import Engine, SamplingParams
from eagleserve.config import ServerArgs
from eagleserve.scheduler import warmup


def _engine(model: str, head: str, spec: bool) -> Engine:
    adaptive = dict(speculative_algorithm="EAGLE", speculative_draft_model_path=head,
                    speculative_num_steps=3, speculative_eagle_topk=1,
                    speculative_num_draft_tokens=4, speculative_adaptive=True,
                    speculative_adaptive_probe_interval=8)  # fmt: skip
    eng = Engine(model=model, device="cpu", max_total_tokens=2048, max_running_requests=16,
                 disable_overlap_schedule=False, **(adaptive if spec else {}))  # fmt: skip
    return track(eng)  # type: ignore[return-value]


@pytest.mark.parametrize("spec", [False, True], ids=["target-only", "eagle-adaptive"])
def test_the_warm_up_leaves_the_scheduler_as_it_found_it(
    model_dir: str,  # noqa: F811
    head_dir: str,  # noqa: F811
    spec: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    warm, fresh = _engine(model_dir, head_dir, spec), _engine(model_dir, head_dir, spec)
    sched = warm.scheduler
    controller = getattr(sched.worker, "controller", None)
    if controller is not None:
        controller.since_draft, controller.backoff = 3, 2
    before = sched.stats()
    seen: list[int] = []
    step = sched.step

    def counting_step():  # noqa: ANN202
        seen.append(sched.running_batch.batch_size if sched.running_batch else 0)
        return step()

    monkeypatch.setattr(sched, "step", counting_step)
    assert warmup.warm_up(sched) > 0
    monkeypatch.undo()
    assert max(seen) == 16 and 1 in seen  # alone, then a batch of 16
    assert sched.stats() == before
    assert sched.prefix_cache.cached_size == 0 and not sched.has_work()
    if controller is not None:
        assert (controller.since_draft, controller.backoff) == (3, 2)
        assert dataclasses.asdict(before)["spec_verify_calls_total"] == 0
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [torch.randint(1, 63, (int(n),)).tolist() for n in torch.randint(3, 20, (5,))]
    assert [o["token_ids"] for o in warm.generate(prompts, params)] == [
        o["token_ids"] for o in fresh.generate(prompts, params)
    ]


def test_the_warm_up_runs_on_an_accelerator_alone() -> None:
    args = ServerArgs(model="default")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert warmup.warm_up_needed(args, cuda) and not warmup.warm_up_needed(args, cpu)
    assert not warmup.warm_up_needed(dataclasses.replace(args, skip_server_warmup=True), cuda)
    assert not warmup.warm_up_needed(dataclasses.replace(args, tp_size=2), cuda)

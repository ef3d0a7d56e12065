"""An exception inside a forward fails only that batch's requests; the engine keeps serving."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import assert_kv_accounted
from random_llama import model_dir

from eagleserve import Engine, SamplingParams
from eagleserve.config import ModelConfig
from eagleserve.messages import GenerateReqInput
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.spec.head_loader import init_eagle_head, save_eagle_head

__all__ = ["model_dir"]  # the module-scoped fixture of random_llama


class _FailingCopy:
    """A device fault that surfaces when the host waits for a result's copies (to_host)."""

    def synchronize(self) -> None:
        raise RuntimeError("injected device fault")


@pytest.fixture(scope="module")
def head_dir(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    runner = ModelRunner(ModelConfig.from_dir(model_dir), model_dir, torch.device("cpu"),
                         torch.float32, 64, 1, 256)  # fmt: skip
    out = str(tmp_path_factory.mktemp("fault-head"))
    save_eagle_head(init_eagle_head("EAGLE", runner.model, seed=int(torch.randint(0, 99, ()))),
                    out)  # fmt: skip
    return out


@pytest.mark.parametrize(
    ("overlap", "site", "adaptive"),
    [(True, "forward", False), (False, "forward", False), (True, "copy", False),
     (True, "forward", True)],
    ids=["overlap", "no-overlap", "overlap-copy", "overlap-adaptive"],
)  # fmt: skip
def test_forward_exception_fails_only_its_batch(
    model_dir: str, head_dir: str, overlap: bool, site: str, adaptive: bool
) -> None:
    """With overlap, the batch launched after the faulty one already holds its requests: their
    slots stay theirs until that batch is done (an adaptive k = 0 decode holds its requests'
    head inputs by slot), and the healthy requests in it carry on."""
    spec = {} if not adaptive else dict(
        speculative_algorithm="EAGLE", speculative_draft_model_path=head_dir,
        speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
        speculative_adaptive=True,
    )  # fmt: skip
    eng = Engine(
        model=model_dir,
        device="cpu",
        max_total_tokens=1024,
        max_running_requests=8,
        disable_overlap_schedule=not overlap,
        **spec,
    )
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [torch.randint(1, 63, (n,)).tolist() for n in (5, 9, 3)]
    expected = [o["token_ids"] for o in eng.generate(prompts, params)]

    sched = eng.scheduler
    worker = sched.worker
    if adaptive:  # every decode the k = 0 path, as where drafting does not pay
        worker.controller.choose = lambda *args, **kwargs: 0
    real = worker.forward_batch_generation

    def is_bad(batch) -> bool:  # noqa: ANN001
        return any(r.rid == "bad" for r in batch.reqs) and batch.mode == "extend"

    def faulty(batch, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if is_bad(batch):
            raise RuntimeError("injected fault")
        if any(r.rid == "bad" for r in batch.reqs):
            # The batch launched after the fault: let the scheduler handle the fault first,
            # as a slow forward would.
            time.sleep(0.2)
        return real(batch, *args, **kwargs)

    if site == "forward":
        worker.forward_batch_generation = faulty
    else:  # the forward thread returns; the fault shows when the scheduler waits for its copies
        real_forward = sched.forwarder._forward

        def faulty_copy(batch):  # noqa: ANN001, ANN202
            result = real_forward(batch)
            if is_bad(batch):
                result.copy_done = _FailingCopy()
            return result

        sched.forwarder._forward = faulty_copy
    outs: dict[str, list] = {"good-0": [], "bad": [], "good-1": []}
    errors = {}
    sched.add_request(GenerateReqInput("good-0", prompts[0], params))
    for _ in range(3):  # good-0 decodes alone before the faulty one arrives
        for o in sched.step():
            outs[o.rid].extend(o.new_token_ids)
    sched.add_request(GenerateReqInput("bad", prompts[1], params))
    added, steps = False, 0
    while sched.has_work() or not added:
        # A few steps after the fault: the batch launched right after it decodes good-0 with
        # the failed request, whose slots are still in use there.
        if not added and steps >= 3:
            sched.add_request(GenerateReqInput("good-1", prompts[2], params))
            added = True
        steps += 1
        for o in sched.step():
            if o.error:
                errors[o.rid] = o.error_code
            outs[o.rid].extend(o.new_token_ids)
    assert errors == {"bad": 500}
    assert_kv_accounted(sched)
    # The engine keeps serving, with exact tokens, after the fault.
    worker.forward_batch_generation = real
    if site == "copy":
        del sched.forwarder._forward  # the class's method again
    again = [o["token_ids"] for o in eng.generate(prompts, params)]
    assert again == expected
    assert outs["good-0"] == expected[0]
    assert outs["good-1"] == expected[2]

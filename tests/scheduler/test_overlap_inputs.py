"""With the overlap scheduler the host prepares batch N+1 while the device may still run batch N
on the forward stream. A device tensor the host made for N (its slots, lengths, input ids) and
then dropped would go back to the allocator's pool of the host's stream, and N+1's inputs could
be given that block and written over it before N's kernels read it: the caching allocator orders
a freed block after the work of the stream that allocated it only. So every tensor a launched
batch holds stays referenced until that batch's result has been collected."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from random_llama import DEVICE, head_dir, model_dir  # noqa: F401  (the fixtures)

from eagleserve import Engine, SamplingParams
from eagleserve.scheduler.overlap import OverlapForwarder


@pytest.mark.parametrize("spec", [False, True], ids=["target-only", "eagle-chain3"])
def test_a_launched_batchs_tensors_live_until_its_result_is_collected(
    model_dir: str,  # noqa: F811
    head_dir: str,  # noqa: F811
    spec: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    chain = dict(speculative_algorithm="EAGLE", speculative_draft_model_path=head_dir,
                 speculative_num_steps=3, speculative_eagle_topk=1,
                 speculative_num_draft_tokens=4)  # fmt: skip
    eng = Engine(
        model=model_dir,
        device=DEVICE,
        max_total_tokens=1024,
        max_running_requests=8,
        disable_overlap_schedule=False,  # an accelerator's default
        **(chain if spec else {}),
    )
    fwd = eng.scheduler.forwarder
    assert fwd is not None
    held: dict[int, list[tuple[str, weakref.ref]]] = {}
    checked: list[int] = []
    launch, collect = fwd.launch, OverlapForwarder.collect

    def tracked_launch(batch: Any) -> Any:
        refs = [(k, weakref.ref(v)) for k, v in vars(batch).items() if isinstance(v, torch.Tensor)]
        fut = launch(batch)
        held[id(fut)] = refs
        return fut

    def checked_collect(fut: Any) -> Any:
        dead = [name for name, ref in held.pop(id(fut)) if ref() is None]
        assert not dead, f"freed before the batch's result was collected: {dead}"
        checked.append(len(dead))
        return collect(fut)

    monkeypatch.setattr(fwd, "launch", tracked_launch)
    monkeypatch.setattr(OverlapForwarder, "collect", staticmethod(checked_collect))
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [torch.randint(1, 63, (int(n),)).tolist() for n in torch.randint(3, 12, (3,))]
    outs = eng.generate(prompts, params)
    assert all(len(o["token_ids"]) == 10 for o in outs)
    assert len(checked) >= (4 if spec else 10)  # the prefill and every decode step

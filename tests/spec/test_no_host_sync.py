"""No forward reads a device value on the host: lengths flow down from the scheduler.

On an accelerator such a read (`.item()`, `.tolist()`, `int(t)`, `bool(t)`) waits for the device
and stalls the overlap scheduler every step. On the CPU the same reads are visible as
`aten._local_scalar_dense` calls and `Tensor.tolist`, so a dispatch mode around every target
forward, head extend and draft step catches them while real requests run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from host_reads import HostReadError, guarded, head_dir, no_host_reads

from eagleserve import Engine, SamplingParams
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.spec.draft_worker import EagleDraftWorker

__all__ = ["head_dir"]  # the module-scoped EAGLE3 head fixture of host_reads

pytestmark = pytest.mark.usefixtures("torch_threads")


def test_the_guard_catches_host_reads() -> None:
    lens = torch.tensor([3, 5])
    for read in (lambda: int(lens.max()), lambda: lens.tolist(), lambda: bool((lens > 1).all())):
        with pytest.raises(HostReadError), no_host_reads():
            read()


@pytest.mark.parametrize(
    "spec",
    [
        {},
        dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4),
        dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=5),
    ],
    ids=["target", "chain", "tree"],
)
@pytest.mark.parametrize("overlap", [False, True])
def test_forwards_read_no_device_values(
    tiny_model_dir: str,
    head_dir: str,
    make_engine: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
    spec: dict[str, Any],
    overlap: bool,
) -> None:
    if spec:
        spec = dict(spec, speculative_algorithm="EAGLE3", speculative_draft_model_path=head_dir)
    engine = make_engine(
        tiny_model_dir, max_running_requests=4, disable_overlap_schedule=not overlap, **spec
    )
    monkeypatch.setattr(ModelRunner, "forward", guarded(ModelRunner.forward))
    monkeypatch.setattr(EagleDraftWorker, "extend", guarded(EagleDraftWorker.extend))
    monkeypatch.setattr(EagleDraftWorker, "_step", guarded(EagleDraftWorker._step))
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 256, (int(n),), generator=gen).tolist() for n in (5, 17, 9)]
    params = [SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)] * 3
    out = engine.generate(prompts, params)
    assert [len(o["token_ids"]) for o in out] == [12, 12, 12]


def test_penalties_read_no_device_values() -> None:
    """The penalty glue a verify runs (path counts, bias, min_tokens, penalties, the commit of
    accepted tokens) and a decode's sampling with penalties stay on the device."""
    from eagleserve.core import Req
    from eagleserve.sampling.penalty_state import BatchPenalties, PenaltyState
    from eagleserve.sampling.sampler import sample_next
    from eagleserve.sampling.sampling_info import SamplingInfo

    vocab, bs, n = 32, 3, 5
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.3,
                             min_tokens=4, logit_bias={3: -5.0}, max_new_tokens=8),
              SamplingParams(temperature=0.7, logit_bias={1: 2.0}),
              SamplingParams(temperature=0.0, repetition_penalty=0.8)]  # fmt: skip
    reqs = [Req(f"r{i}", torch.randint(0, vocab, (6,)).tolist(), p, frozenset({2}))
            for i, p in enumerate(params)]  # fmt: skip
    for i, r in enumerate(reqs):
        r.req_pool_idx = 2 - i
        r.sampling_seed = None if r.sampling_params.is_greedy else int(torch.randint(0, 2**62, ()))
    slots = torch.tensor([2, 1, 0])
    state = PenaltyState(3, vocab, torch.device("cpu"))
    info = SamplingInfo.from_reqs(reqs, vocab, torch.device("cpu"), prefill_rows=len(reqs))
    pen = info.penalties
    assert isinstance(pen, BatchPenalties)
    tokens = torch.randint(0, vocab, (bs, n))
    chain = torch.ones(n, n, dtype=torch.bool).tril().expand(bs, n, n)
    with no_host_reads():
        at = torch.full((bs,), 6)
        sample_next(torch.randn(bs, vocab), reqs, info, at, state, slots, prefill=True)
        out = pen.verify_logits(torch.randn(bs, n, vocab), state, slots, tokens, chain,
                                torch.arange(n).expand(bs, n))  # fmt: skip
        pen.commit(state, slots, tokens, tokens > 3)
        sample_next(torch.randn(bs, vocab), reqs, info, at + 1, state, slots, prefill=False)
    assert out.shape == (bs, n, vocab)

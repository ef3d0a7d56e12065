"""Speculative greedy output equals target-only greedy output, token for token.

The target is a tiny random Llama whose attention and MLP outputs are scaled down, so its next
token depends mostly (not only) on the current one; an EAGLE-1 head whose fc passes the token
embedding through then predicts it well, which exercises long accepted runs, partial acceptance
and rejection. EAGLE-3 heads are random (mostly rejections) and use a reduced draft vocabulary.
"""

from __future__ import annotations

import random

import pytest
from lossless_fixtures import VOCAB, heads, params, prompts, reference, run_staggered, target_dir

from eagleserve import Engine, SamplingParams
from eagleserve.messages import GenerateReqInput

__all__ = ["heads", "reference", "target_dir"]  # module-scoped fixtures of lossless_fixtures


def test_overlap_target_only_matches(target_dir: str, reference: list[list[int]]) -> None:
    eng = Engine(model=target_dir, device="cpu", max_total_tokens=2048, max_running_requests=8,
                 disable_overlap_schedule=False)  # fmt: skip
    assert eng.scheduler.enable_overlap
    assert run_staggered(eng, prompts(0), params()) == reference


CASES = [
    # (head, num_steps, topk, num_draft_tokens)
    ("EAGLE", 1, 1, 2),
    ("EAGLE", 2, 1, 3),
    ("EAGLE", 3, 1, 4),
    ("EAGLE", 4, 1, 5),
    ("EAGLE", 5, 1, 6),
    ("EAGLE", 2, 2, 3),
    ("EAGLE", 3, 2, 6),
    ("EAGLE", 4, 3, 8),
    ("EAGLE", 5, 4, 12),
    ("EAGLE", 3, 4, 16),
    ("EAGLE", 2, 3, 4),
    ("EAGLE-random", 3, 1, 4),
    ("EAGLE-random", 3, 2, 5),
    ("EAGLE3", 1, 1, 2),
    ("EAGLE3", 4, 1, 5),
    ("EAGLE3", 3, 2, 6),
    ("EAGLE3", 2, 4, 8),
    ("EAGLE3-2layers", 3, 1, 4),
    ("EAGLE3-2layers", 3, 2, 6),
]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize(("head", "steps", "topk", "ndt"), CASES)
def test_greedy_lossless(
    target_dir: str,
    heads: dict[str, str],
    reference: list[list[int]],
    head: str,
    steps: int,
    topk: int,
    ndt: int,
    overlap: bool,
) -> None:
    algo = "EAGLE3" if head.startswith("EAGLE3") else "EAGLE"
    eng = Engine(
        model=target_dir,
        device="cpu",
        max_total_tokens=2048,
        max_running_requests=8,
        disable_overlap_schedule=not overlap,
        speculative_algorithm=algo,
        speculative_draft_model_path=heads[head],
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=ndt,
    )
    got = run_staggered(eng, prompts(0), params())
    for i, (g, r) in enumerate(zip(got, reference)):
        first = next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
        assert g == r, f"request {i}: first mismatch at token {first}"
    stats = eng.stats()
    assert stats.spec_verify_calls_total > 0
    if head == "EAGLE":
        # The crafted head must actually get drafts accepted, or this test proves little.
        assert stats.spec_accepted_tokens_total / stats.spec_verify_calls_total > 1.5


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize(("spec", "topk", "ndt"), [(None, 1, 1), ("EAGLE", 1, 4), ("EAGLE", 2, 6)])
def test_small_kv_pool_waits_and_retracts(
    target_dir: str,
    heads: dict[str, str],
    reference: list[list[int]],
    overlap: bool,
    spec: str | None,
    topk: int,
    ndt: int,
) -> None:
    """A pool far below the total demand: requests wait or get retracted, tokens stay exact."""
    kwargs = {}
    if spec:
        kwargs = dict(
            speculative_algorithm=spec,
            speculative_draft_model_path=heads["EAGLE"],
            speculative_num_steps=3,
            speculative_eagle_topk=topk,
            speculative_num_draft_tokens=ndt,
        )
    eng = Engine(
        model=target_dir,
        device="cpu",
        max_total_tokens=130,
        max_running_requests=8,
        disable_overlap_schedule=not overlap,
        **kwargs,
    )
    got = run_staggered(eng, prompts(0), params())
    assert got == reference
    assert eng.stats().num_retracted_total > 0, "the pool was meant to force retraction"


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize(("topk", "ndt"), [(1, 4), (2, 6)])
def test_a_request_of_the_whole_context_runs_to_its_end(
    target_dir: str, heads: dict[str, str], overlap: bool, topk: int, ndt: int
) -> None:
    """The pool bounds the context: a request of exactly the advertised context (prompt and new
    tokens) still finds the KV slots each speculative iteration reserves past its committed
    length, to its last token, and its tokens are the target's."""
    pool = 96
    eng = Engine(model=target_dir, device="cpu", max_total_tokens=pool, max_running_requests=2,
                 disable_overlap_schedule=not overlap, speculative_algorithm="EAGLE",
                 speculative_draft_model_path=heads["EAGLE"], speculative_num_steps=3,
                 speculative_eagle_topk=topk, speculative_num_draft_tokens=ndt)  # fmt: skip
    ctx = eng.scheduler.max_context_len
    assert ctx < pool  # the reserve comes off the context, not out of a full request's slots
    rng = random.Random()
    prompt = [rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(5, 30))]
    want = SamplingParams(max_new_tokens=ctx - len(prompt), temperature=0.0, ignore_eos=True)
    target = Engine(model=target_dir, device="cpu", max_total_tokens=pool, max_running_requests=2)
    ref = target.generate([prompt], [want])[0]
    got = eng.generate([prompt], [want])[0]
    assert got["finish_reason"] == "length" and got["token_ids"] == ref["token_ids"]
    assert eng.stats().kv_used_tokens == 0
    with pytest.raises(ValueError, match="maximum context length"):
        eng.generate([prompt], [SamplingParams(max_new_tokens=ctx - len(prompt) + 1)])


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["chain", "adaptive"])
def test_a_prefill_in_chunks_goes_back_when_a_running_request_needs_its_slots(
    target_dir: str, heads: dict[str, str], overlap: bool, adaptive: bool
) -> None:
    """A long prompt in chunks holds slots for all its positions while the running request
    drafts and verifies between its chunks; when the pool runs short, the part-way prefill is
    retracted (one running request is never the one to go), and both keep the target's tokens."""
    reserve = 8 if overlap else 4  # chain 3: a verify's 4 slots, twice under overlap
    eng = Engine(model=target_dir, device="cpu", max_total_tokens=104 + 2 * reserve,
                 max_running_requests=2, chunked_prefill_size=4,
                 disable_overlap_schedule=not overlap, speculative_algorithm="EAGLE",
                 speculative_draft_model_path=heads["EAGLE"], speculative_num_steps=3,
                 speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                 speculative_adaptive=adaptive)  # fmt: skip
    assert eng.scheduler.worker.decode_slots_per_req == reserve
    rng = random.Random()
    running, long = ([rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (40, 50))
    want = SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True)
    target = Engine(model=target_dir, device="cpu", max_total_tokens=512, max_running_requests=2)
    ref = [r["token_ids"] for r in target.generate([running, long], [want, want])]
    sched = eng.scheduler
    tokens: dict[str, list[int]] = {"running": [], "long": []}
    sched.add_request(GenerateReqInput("running", running, want, stream=True))
    while len(tokens["running"]) < 2:  # the long prompt then just fits the pool
        for out in sched.step():
            tokens[out.rid] += out.new_token_ids
    sched.add_request(GenerateReqInput("long", long, want))
    for _ in range(2000):
        if not sched.has_work():
            break
        for out in sched.step():
            assert out.error is None, out.error
            tokens[out.rid] += out.new_token_ids
    assert [tokens["running"], tokens["long"]] == ref
    assert eng.stats().num_retracted_total > 0, "the pool never ran short"
    assert eng.stats().kv_used_tokens == 0

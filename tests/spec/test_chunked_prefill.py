"""Chunked prefill gives the tokens a one-shot prefill gives (greedy and seeded; target-only,
EAGLE chains and trees; overlap on and off), with decode steps between the chunks; aborting a
request part-way through its prefill or its decode leaves the radix tree and the pools
consistent, and what it had computed is served from the cache afterwards."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cache_engines import engine
from conftest import assert_kv_accounted
from lossless_fixtures import VOCAB, heads, run_staggered, target_dir  # noqa: F401

from eagleserve import Engine, SamplingParams
from eagleserve.messages import GenerateReqInput

pytestmark = pytest.mark.usefixtures("torch_threads")

CHUNK = 24


def prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [70, 5, 130, 33, 90, 8, 61, 150]
    return [torch.randint(1, VOCAB - 1, (n,), generator=g).tolist() for n in lens]


def record_batches(eng: Engine) -> list[tuple[str, bool]]:
    """(mode, a prefill is part-way) of every batch the scheduler runs from now on."""
    sched = eng.scheduler
    seen: list[tuple[str, bool]] = []
    pick = sched.get_next_batch_to_run

    def recording() -> Any:
        batch = pick()
        if batch is not None:
            seen.append((batch.mode, sched.chunked_req is not None))
        return batch

    sched.get_next_batch_to_run = recording  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("spec", ["target", "chain", "tree"])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_chunked_prefill_gives_one_shot_tokens(
    target_dir: str,  # noqa: F811
    heads: dict[str, str],  # noqa: F811
    spec: str,
    overlap: bool,
    greedy: bool,
) -> None:
    seed = int(torch.randint(1 << 30, ()))
    ps = prompts(seed)
    params = [
        SamplingParams(
            max_new_tokens=12 + i, temperature=0.0 if greedy else 0.8, seed=seed + i,
            ignore_eos=True,
        )
        for i in range(len(ps))
    ]  # fmt: skip
    got = {}
    for chunk in (0, CHUNK):
        eng = engine(target_dir, heads["EAGLE"], spec, False, overlap, chunked_prefill_size=chunk)
        seen = record_batches(eng)
        got[chunk] = run_staggered(eng, ps, params)
        # Chunks ran, and running requests decoded between two chunks of one prefill.
        interleaved = any(a == ("extend", True) and b[0] == "decode" and b[1]
                          for a, b in zip(seen, seen[1:]))  # fmt: skip
        assert interleaved == (chunk > 0), seen
    assert got[CHUNK] == got[0]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("spec", ["target", "chain"])
def test_abort_mid_prefill_and_mid_decode_keeps_tree_and_pool_consistent(
    target_dir: str,  # noqa: F811
    heads: dict[str, str],  # noqa: F811
    spec: str,
    overlap: bool,
) -> None:
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    long_prompt = torch.randint(1, VOCAB - 1, (120,), generator=g).tolist()
    short = torch.randint(1, VOCAB - 1, (10,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    eng = engine(target_dir, heads["EAGLE"], spec, True, overlap, chunked_prefill_size=16)
    sched = eng.scheduler
    sched.add_request(GenerateReqInput("short", short, params))
    sched.step()
    sched.add_request(GenerateReqInput("long", long_prompt, params))
    for _ in range(4):  # two chunks of the long prompt, two decodes of the short one
        sched.step()
    assert sched.chunked_req is not None and sched.chunked_req.rid == "long"
    done = sched.chunked_req.kv_committed_len
    sched.abort_request("long")
    for _ in range(3):
        sched.step()
    sched.abort_request("short")  # mid-decode
    while sched.has_work():
        sched.step()
    assert_kv_accounted(sched)
    # What both had computed is cached: the long prompt's chunks, the short one's decode.
    (out,) = eng.generate([long_prompt], params)
    assert sched.prefix_cache.hit_tokens >= done - 1 >= 16
    fresh = engine(target_dir, heads["EAGLE"], spec, False, overlap)
    assert out["token_ids"] == fresh.generate([long_prompt], params)[0]["token_ids"]


@pytest.mark.parametrize("spec", ["chain", "tree"])
def test_kv_after_chunks_equals_one_shot(
    target_dir: str,  # noqa: F811
    heads: dict[str, str],  # noqa: F811
    spec: str,
) -> None:
    """The head's KV at a chunk's last position pairs it with the next prompt token (a one-shot
    prefill's pairing), not with the token sampled after the chunk."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    prompt = torch.randint(1, VOCAB - 1, (100,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    kv = {}
    for chunk in (0, 16):
        eng = engine(target_dir, heads["EAGLE"], spec, False, False, chunked_prefill_size=chunk)
        sched = eng.scheduler
        sched.add_request(GenerateReqInput("r", prompt, params))
        while sched.running_batch is None:
            sched.step()
        req = sched.running_batch.reqs[0]
        slots = sched.req_to_token_pool.req_to_token[req.req_pool_idx, : len(prompt)]
        kv[chunk] = [
            p.k_buffer[0][slots].clone() for p in (sched.kv_pool, sched.worker.drafter.kv_pool)
        ]
        sched.abort_request("r")
        while sched.has_work():
            sched.step()
    for name, a, b in zip(("target", "head"), kv[16], kv[0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)

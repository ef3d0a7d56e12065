"""The prefix cache changes no token: greedy and seeded output with the cache on equal output with
it off (target-only, EAGLE chains and trees, adaptive depth; overlap on and off), over shared
system prompts, multi-turn conversations, prefixes ending mid-way through an earlier request or
diverging right after a cached position, and a pool small enough to force eviction. After a hit
the target's and the head's KV equal what a full prefill writes. Uses the lossless tests' target
and crafted head (drafts get accepted, so verify slots are rejected and accepted alike)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cache_engines import engine
from conftest import assert_kv_accounted
from lossless_fixtures import VOCAB, heads, target_dir  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode

from eagleserve import Engine, SamplingParams
from eagleserve.mem_cache.prefix_cache import PrefixCache
from eagleserve.messages import GenerateReqInput

pytestmark = pytest.mark.usefixtures("torch_threads")


def conversation(eng: Engine, seed: int, params: SamplingParams) -> list[list[int]]:
    """Requests whose prompts share prefixes in every way a chat server sees; their tokens."""
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(1, VOCAB - 1, (n,), generator=g).tolist()

    def gen(prompts: list[list[int]]) -> list[list[int]]:
        return [o["token_ids"] for o in eng.generate(prompts, params)]

    system = rand(40)
    first = [system + rand(n) for n in (5, 9)]
    outs = gen(first)
    outs += gen([system + rand(n) for n in (3, 14, 1)])  # the system prompt is cached now
    turn = rand(20)
    for _ in range(3):  # multi-turn: each prompt is the whole conversation so far
        (out,) = gen([turn])
        outs.append(out)
        turn = turn + out + rand(6)
    # Ending mid-way through an earlier request's output, then going on differently; and a
    # prompt that diverges right after a cached position (its pair key differs there).
    mid = first[0] + outs[0][:5]
    outs += gen([mid + rand(4), first[1][:30] + rand(8), first[1] + outs[1]])
    return outs


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("spec", ["target", "chain", "tree", "adaptive"])
def test_greedy_tokens_identical_with_and_without_cache(
    target_dir: str,  # noqa: F811
    heads: dict[str, str],  # noqa: F811
    spec: str,
    overlap: bool,
) -> None:
    params = SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True)
    seed = int(torch.randint(1 << 30, ()))
    got = {}
    for cache in (False, True):
        eng = engine(target_dir, heads["EAGLE"], spec, cache, overlap)
        got[cache] = conversation(eng, seed, params)
        stats = eng.stats()
        assert (stats.prefix_cache_hit_tokens_total > 150) == cache, stats
    assert got[True] == got[False]


@pytest.mark.parametrize("spec", ["target", "chain"])
def test_seeded_sampling_identical_with_and_without_cache(
    target_dir: str,  # noqa: F811
    heads: dict[str, str],  # noqa: F811
    spec: str,
) -> None:
    seed = int(torch.randint(1 << 30, ()))
    params = SamplingParams(max_new_tokens=14, temperature=0.8, seed=seed, ignore_eos=True)
    got = [
        conversation(engine(target_dir, heads["EAGLE"], spec, cache, True), seed, params)
        for cache in (False, True)
    ]
    assert got[0] == got[1]


@pytest.mark.parametrize("spec", ["target", "chain", "tree"])
def test_small_pool_evicts_then_retracts_and_keeps_tokens(
    target_dir: str,  # noqa: F811
    heads: dict[str, str],  # noqa: F811
    spec: str,
) -> None:
    params = SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True)
    seed = int(torch.randint(1 << 30, ()))
    want = conversation(engine(target_dir, heads["EAGLE"], spec, False, True), seed, params)
    small = engine(target_dir, heads["EAGLE"], spec, True, True, max_total_tokens=190)
    assert conversation(small, seed, params) == want
    stats = small.stats()
    assert stats.prefix_cache_evicted_tokens_total > 0, stats
    assert stats.prefix_cache_hit_tokens_total > 0, stats


class _Touches(TorchDispatchMode):
    """Counts the ops that read or write a given tensor's storage."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.ptr, self.count = table.untyped_storage().data_ptr(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == self.ptr
               for t in flat):  # fmt: skip
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("spec", ["target", "chain", "tree", "adaptive"])
def test_a_finished_request_is_freed_and_cached_from_the_hosts_copy_of_its_slots(
    target_dir: str,  # noqa: F811
    heads: dict[str, str],  # noqa: F811
    spec: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On an accelerator, reading a finished request's req_to_token row back waits for the
    forward in flight. The host keeps its own copy of every row, which a release reads without
    touching the device table: it holds the device row's slots, and its committed prefix (what
    the tree caches) is the device's exactly; a tree's accepted paths, reordered on the device
    by each verify, are reordered on the host when the scheduler reads the verify's result."""
    releases: list[int] = []  # device table touches of each release
    release = PrefixCache.release

    def checked(self: PrefixCache, req: Any, cache: bool) -> None:
        pool, idx, n = self.req_to_token_pool, req.req_pool_idx, req.kv_allocated_len
        host, device = pool.req_to_token_host[idx, :n], pool.req_to_token[idx, :n]
        committed = req.kv_committed_len
        assert committed > 0 and torch.equal(host[:committed], device[:committed])
        # Past it, a verify launched before the finish was read may have reordered the device
        # row's last path, whose result the host never applies: the same slots.
        assert torch.equal(host.sort().values, device.sort().values)
        if spec != "tree":
            assert torch.equal(host, device)
        with _Touches(pool.req_to_token) as touches:
            release(self, req, cache)
        releases.append(touches.count)

    monkeypatch.setattr(PrefixCache, "release", checked)
    params = SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True)
    eng = engine(target_dir, heads["EAGLE"], spec, True, True)
    conversation(eng, int(torch.randint(1 << 30, ())), params)
    assert len(releases) == 11 and eng.stats().prefix_cache_hit_tokens_total > 150
    assert releases == [0] * 11


def prefilled_kv(eng: Engine, cached: list[int], prompt: list[int]) -> tuple[Any, ...]:
    """Runs `cached` to the end, then prefills `prompt`; returns the target's and the head's
    K of layer 0 at the prompt's positions, and how many prompt tokens came from the cache."""
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    eng.generate([cached], params)
    sched = eng.scheduler
    sched.add_request(GenerateReqInput("b", prompt, params))
    sched.step()  # the prefill (overlap off: done when step returns)
    req = sched.running_batch.reqs[0]
    slots = sched.req_to_token_pool.req_to_token[req.req_pool_idx, : len(prompt)]
    target = sched.kv_pool.k_buffer[0][slots].clone()
    head = sched.worker.drafter.kv_pool.k_buffer[0][slots].clone()
    sched.abort_request("b")
    while sched.has_work():
        sched.step()
    assert_kv_accounted(sched)
    return target, head, req.cached_tokens


@pytest.mark.parametrize("spec", ["chain", "tree"])
def test_kv_after_a_hit_equals_a_full_prefill(
    target_dir: str,  # noqa: F811
    heads: dict[str, str],  # noqa: F811
    spec: str,
) -> None:
    """`prompt` shares `shared` with a cached request and then differs: with a key of one token
    per position, the head's KV at the last shared position would be the one paired with the
    cached request's next token, not this prompt's."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    shared = torch.randint(1, VOCAB - 1, (30,), generator=g).tolist()
    a, b = torch.randperm(VOCAB - 2, generator=g)[:2].add(1).tolist()
    cached = shared + [a] + torch.randint(1, VOCAB - 1, (10,), generator=g).tolist()
    prompt = shared + [b] + torch.randint(1, VOCAB - 1, (7,), generator=g).tolist()
    runs = {
        cache: prefilled_kv(engine(target_dir, heads["EAGLE"], spec, cache, False), cached, prompt)
        for cache in (False, True)
    }
    assert runs[False][2] == 0
    assert runs[True][2] == len(shared) - 1  # the pair (shared[-1], b) is not cached
    for i, name in enumerate(("target", "head")):
        torch.testing.assert_close(runs[True][i], runs[False][i], atol=1e-5, rtol=1e-5, msg=name)

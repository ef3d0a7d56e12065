"""models/cpu_layers.py: a packed target's layers in one kernel call (kernels/cpu_layers.cpp).

What serving relies on: the one-call path gives what the module path gives, bit for bit —
logits, final hidden states and the aux hidden states an EAGLE-3 head reads — for prefill,
chain-verify, tree-verify and decode rows; and a model the kernel does not cover keeps the
module path.
"""

from __future__ import annotations

import pytest
import torch
from conftest import forward_tokens

from eagleserve.config import ModelConfig
from eagleserve.kernels import cpu_ext
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.models.cpu_layers import CpuLayers
from eagleserve.models.llama import ModelOutput
from eagleserve.models.loader import default_gguf_path

pytestmark = pytest.mark.skipif(not cpu_ext.load(), reason="the CPU kernels do not run here")

AUX = (1, 14, 26)  # the shipped EAGLE-3 head's


@pytest.fixture(scope="module")
def runner(smollm2_dir: str) -> ModelRunner:
    cfg = ModelConfig.from_dir(smollm2_dir)
    return ModelRunner(cfg, smollm2_dir, torch.device("cpu"), torch.float32, 512, 2, 512,
                       aux_layer_ids=AUX, gguf_path=default_gguf_path())  # fmt: skip


def both_paths(runner: ModelRunner, *args: torch.Tensor, **kw: torch.Tensor) -> list[ModelOutput]:
    """The same forward through the one-call kernel and through the modules (the K/V the
    forward writes is the same in both, so running it twice leaves the pool as once)."""
    fused = runner.model.cpu_layers
    assert fused is not None, "SmolLM2's packed layers are all of the kind the kernel covers"
    calls = []
    original = cpu_ext.decoder_layers

    def counting(*a: object, **k: object) -> object:
        calls.append(1)
        return original(*a, **k)  # type: ignore[arg-type]

    outs = []
    cpu_ext.decoder_layers = counting  # type: ignore[assignment]
    try:
        for layers in (fused, None):
            runner.model.cpu_layers = layers
            outs.append(forward_tokens(runner, *args, **kw))  # type: ignore[arg-type]
    finally:
        runner.model.cpu_layers = fused
        cpu_ext.decoder_layers = original
    assert len(calls) == 1, "the first forward ran the kernel, the second the modules"
    return outs


def assert_same(a: ModelOutput, b: ModelOutput) -> None:
    assert torch.equal(a.logits, b.logits)
    assert torch.equal(a.hidden_states, b.hidden_states)
    assert a.aux_hidden_states is not None and b.aux_hidden_states is not None
    assert torch.equal(a.aux_hidden_states, b.aux_hidden_states)


def test_one_call_equals_the_modules(runner: ModelRunner) -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    lens = [int(torch.randint(5, 120, (), generator=gen)) for _ in range(2)]
    ids = [torch.randint(0, 49152, (n + 5,), generator=gen) for n in lens]
    locs = [runner.token_to_kv_pool.alloc(n + 5) for n in lens]
    slots = [runner.req_to_token_pool.alloc() for _ in lens]
    for s, loc in zip(slots, locs):
        runner.req_to_token_pool.req_to_token[s, : loc.numel()] = loc
    rpi = torch.tensor(slots)
    try:
        # a prefill of both prompts in one batch
        cat = torch.cat([i[:n] for i, n in zip(ids, lens)])
        pos = torch.cat([torch.arange(n) for n in lens])
        loc = torch.cat([lc[:n] for lc, n in zip(locs, lens)])
        zeros = torch.zeros(2, dtype=torch.long)
        assert_same(*both_paths(runner, "extend", cat, pos, loc, rpi, zeros, torch.tensor(lens)))
        # a 4-token chain verify of each
        cat = torch.cat([i[n : n + 4] for i, n in zip(ids, lens)])
        pos = torch.cat([torch.arange(n, n + 4) for n in lens])
        loc = torch.cat([lc[n : n + 4] for lc, n in zip(locs, lens)])
        assert_same(*both_paths(runner, "verify", cat, pos, loc, rpi, torch.tensor(lens),
                                torch.tensor([4, 4])))  # fmt: skip
        # a tree verify: 4 nodes, the last two siblings under the second
        mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]).bool()
        depth = torch.tensor([0, 1, 2, 2])
        pos = torch.cat([n + depth for n in lens])
        assert_same(*both_paths(runner, "verify", cat, pos, loc, rpi, torch.tensor(lens),
                                torch.tensor([4, 4]), tree_mask=mask.expand(2, 4, 4)))  # fmt: skip
        # a decode of each
        cat = torch.stack([i[n] for i, n in zip(ids, lens)])
        loc = torch.stack([lc[n] for lc, n in zip(locs, lens)])
        assert_same(*both_paths(runner, "decode", cat, torch.tensor(lens), loc, rpi,
                                torch.tensor(lens), torch.ones(2, dtype=torch.long)))  # fmt: skip
    finally:
        for s, loc in zip(slots, locs):
            runner.req_to_token_pool.free(s)
            runner.token_to_kv_pool.free(loc)


def test_a_layer_the_kernel_does_not_cover_keeps_the_modules(runner: ModelRunner) -> None:
    layers = runner.model.model.layers
    i = int(torch.randint(0, len(layers), ()))
    attn = layers[i].self_attn
    attn.row_parallel = True  # as a tensor-parallel rank's (its output is a partial sum)
    try:
        assert CpuLayers.build(runner.model) is None
    finally:
        attn.row_parallel = False
    assert CpuLayers.build(runner.model) is not None


def test_the_heads_one_call_equals_its_modules(runner: ModelRunner) -> None:
    """An EAGLE-3 head beside the packed target (Q4 tiles, row kernels) runs its layer and
    lm_head in one call: the same logits, next features and head K/V as its modules, for an
    extend of two requests (target features), a draft step (the head's own features), and an
    extend after them that wants each request's last row alone (a seed extend after a verify:
    every row's K/V, the last rows' layer)."""
    from conftest import make_forward_batch

    from eagleserve.layers.attention import create_attn_backend
    from eagleserve.layers.forward_batch import forward_context
    from eagleserve.mem_cache.kv_cache import TokenToKVPool
    from eagleserve.models.quant import pack_head_linears
    from eagleserve.spec.head_loader import init_eagle_head

    seed = int(torch.randint(0, 2**31, ()))
    head = init_eagle_head("EAGLE3", runner.model, draft_vocab_size=1024, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms away from 1, so a norm left out would show
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(1 + 0.2 * torch.randn(p.shape, generator=g))
    head.fuse_projections()
    pack_head_linears(head)
    head.use_row_kernels()
    one_call = head.cpu_layer
    assert one_call is not None, "a packed EAGLE-3 head beside a packed target takes the kernel"
    hc = head.config
    pool = TokenToKVPool(96, 1, hc.num_key_value_heads, hc.head_dim, torch.float32, "cpu")
    r2t = torch.zeros(4, 64, dtype=torch.long)
    backend = create_attn_backend("auto", torch.device("cpu"), r2t, hc.head_dim**-0.5,
                                  shape_invariant=True)  # fmt: skip
    lens = [int(torch.randint(3, 26, (), generator=g)) for _ in range(2)]  # room for 5 more
    rpi = torch.tensor([2, 0])
    slots = (torch.randperm(95, generator=g) + 1)[: 2 * 32].view(2, 32)
    r2t[rpi, :32] = slots

    def both(mode: str, ids: torch.Tensor, feats: torch.Tensor, prefix: list[int],
             ext: list[int], last: torch.Tensor | None = None) -> None:  # fmt: skip
        pos = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, ext, strict=True)])
        loc = torch.cat([slots[i, p : p + e] for i, (p, e) in enumerate(zip(prefix, ext))])
        outs, kv = [], []
        for layer in (one_call, None):
            head.cpu_layer = layer
            fb = make_forward_batch(mode=mode, input_ids=ids, positions=pos, out_cache_loc=loc,
                                    req_pool_indices=rpi, prefix_lens=torch.tensor(prefix),
                                    extend_lens=torch.tensor(ext), kv_pool=pool,
                                    attn_backend=backend)  # fmt: skip
            with forward_context(fb):
                outs.append(head(ids, feats, pos, logit_rows=last))
            kv.append((pool.k_buffer[0][loc].clone(), pool.v_buffer[0][loc].clone()))
        head.cpu_layer = one_call
        for a, b in zip(*outs, strict=True):
            assert a.shape[0] == (ids.shape[0] if last is None else len(last))
            assert torch.equal(a, b)
        assert all(torch.equal(a, b) for a, b in zip(*kv, strict=True))

    n = sum(lens)
    both("extend", torch.randint(0, 49152, (n,), generator=g),
         torch.randn(n, head.feature_size, generator=g), [0, 0], lens)  # fmt: skip
    both("draft", torch.randint(0, 49152, (2,), generator=g),
         torch.randn(2, head.hidden_size, generator=g), lens, [1, 1])  # fmt: skip
    ext = [int(torch.randint(1, 5, (), generator=g)) for _ in range(2)]
    last = torch.cumsum(torch.tensor(ext), 0) - 1
    both("extend", torch.randint(0, 49152, (sum(ext),), generator=g),
         torch.randn(sum(ext), head.feature_size, generator=g), [m + 1 for m in lens], ext,
         last)  # fmt: skip


def test_phase_timers_see_each_phase_of_every_layer(runner: ModelRunner) -> None:
    """bench/forward_phases_cpu.py reads the one-call layers' phase timers by name: on, each
    phase once per layer and forward, with its time; off (the default), nothing."""
    from bench.forward_phases_cpu import LAYER_PHASES

    n = int(torch.randint(2, 6, ()))
    loc = runner.token_to_kv_pool.alloc(n)
    slot = runner.req_to_token_pool.alloc()
    runner.req_to_token_pool.req_to_token[slot, :n] = loc

    def forward() -> None:
        forward_tokens(runner, "extend", torch.randint(0, 49152, (n,)), torch.arange(n), loc,
                       torch.tensor([slot]), torch.tensor([0]), torch.tensor([n]))  # fmt: skip

    try:
        cpu_ext.phase_times(True)
        forward()
        forward()
        times = cpu_ext.phase_times(False)
        forward()
        assert cpu_ext.phase_times(False) == {}
    finally:
        cpu_ext.phase_times(False)
        runner.req_to_token_pool.free(slot)
        runner.token_to_kv_pool.free(loc)
    layers = runner.model.config.num_hidden_layers
    assert set(times) == {f"decoder_layers::{p}" for p in LAYER_PHASES}
    assert all(calls == 2 * layers and seconds > 0 for seconds, calls in times.values()), times

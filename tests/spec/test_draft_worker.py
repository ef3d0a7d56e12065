"""The head's extend runs the whole layer only on each request's last row: the KV it leaves and
the seed it returns equal those of the whole layer over every row. A fixed-shape path extend's
rejected rows are masked to token 0 and slot 0 before it runs."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from conftest import SPEC_VOCAB, make_forward_batch, save_spec_target

from eagleserve.config import ModelConfig
from eagleserve.layers.attention import TorchAttnBackend
from eagleserve.layers.forward_batch import ForwardBatch, HostLens, forward_context
from eagleserve.mem_cache.kv_cache import ReqToTokenPool, TokenToKVPool
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.spec.draft_extend import last_rows_forward, mask_path_rows
from eagleserve.spec.eagle_head import EagleHead
from eagleserve.spec.head_loader import init_eagle_head

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    path = save_spec_target(str(tmp_path_factory.mktemp("target")), 7, SPEC_VOCAB - 1, 0)
    return ModelRunner(ModelConfig.from_dir(path), path, CPU, torch.float32, 64, 1, 512)


def _extend(
    head: EagleHead, pool: TokenToKVPool, r2t: ReqToTokenPool, prefix: list[int], extend: list[int]
) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor]:
    """An extend after `prefix` cached positions per request, with random tokens and features."""
    ids = torch.randint(0, SPEC_VOCAB, (sum(extend),))
    feats = torch.randn(sum(extend), head.feature_size)
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, extend, strict=True)])
    rows = torch.arange(len(prefix)).repeat_interleave(torch.tensor(extend))
    fb = make_forward_batch(
        mode="extend",
        input_ids=ids,
        positions=positions,
        out_cache_loc=r2t.req_to_token[rows, positions],
        req_pool_indices=torch.arange(len(prefix)),
        prefix_lens=torch.tensor(prefix),
        extend_lens=torch.tensor(extend),
        kv_pool=pool,
        attn_backend=TorchAttnBackend(r2t.req_to_token, head.config.head_dim**-0.5),
    )
    return fb, feats, torch.cumsum(torch.tensor(extend), 0) - 1


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_last_rows_forward_equals_the_whole_layer(runner: ModelRunner, algorithm: str) -> None:
    head = init_eagle_head(algorithm, runner.model, seed=random.randrange(1000))
    cfg = head.config
    rng = random.Random()
    bs = 3
    prefix = [rng.randrange(1, 20) for _ in range(bs)]
    extend = [rng.randrange(1, 6) for _ in range(bs - 1)] + [rng.randrange(2, 6)]  # not all 1
    r2t = ReqToTokenPool(bs, 64, CPU)
    shape = (256, 1, cfg.num_key_value_heads, cfg.head_dim, torch.float32, CPU)
    pools = [TokenToKVPool(*shape), TokenToKVPool(*shape)]
    loc = pools[0].alloc(bs * 32)
    assert loc is not None and pools[1].alloc(bs * 32) is not None
    r2t.req_to_token[:, :32] = loc.view(bs, 32)
    cached = torch.randn(2, *pools[0].k_buffer[0].shape)
    for pool in pools:  # the same cached prefix (and stale slots) in both pools
        pool.k_buffer[0].copy_(cached[0])
        pool.v_buffer[0].copy_(cached[1])
    fb, feats, last = _extend(head, pools[0], r2t, prefix, extend)
    with torch.no_grad():
        with forward_context(fb):
            whole_logits, whole_feats = head(fb.input_ids, feats, fb.positions)
        other = dataclasses.replace(fb, kv_pool=pools[1], attn_metadata=None)
        logits, next_feats = last_rows_forward(head, other, feats, last)
    # fp32 matmuls round a row by the number of rows: the last rows' K/V (written again by
    # their own forward) may differ in the last bits.
    torch.testing.assert_close(pools[1].k_buffer[0], pools[0].k_buffer[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pools[1].v_buffer[0], pools[0].v_buffer[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(logits, whole_logits[last], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(next_feats, whole_feats[last], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_fused_projections_leave_a_packed_head_unchanged(
    runner: ModelRunner, algorithm: str
) -> None:
    """A head next to a packed target fuses q/k/v and gate/up before its 4-bit packing: each
    output column is its own Q4_1 row computed as before, so logits, next features and the K/V
    written (by a forward, and by write_kv through the K/V rows alone) are bit for bit those of
    the unfused head."""
    from eagleserve.kernels import cpu_ext
    from eagleserve.models.quant import pack_head_linears

    if not cpu_ext.load():
        pytest.skip("the CPU kernels do not run here")
    seed = random.randrange(1000)
    heads = [init_eagle_head(algorithm, runner.model, seed=seed) for _ in range(2)]
    heads[1].fuse_projections()
    attn = heads[1].attn
    assert attn.qkv_proj is not None and not hasattr(attn, "q_proj")
    for head in heads:
        pack_head_linears(head)
    cfg = heads[0].config
    r2t = ReqToTokenPool(2, 64, CPU)
    shape = (128, 1, cfg.num_key_value_heads, cfg.head_dim, torch.float32, CPU)
    pools = [TokenToKVPool(*shape), TokenToKVPool(*shape)]
    loc = pools[0].alloc(64)
    assert loc is not None and pools[1].alloc(64) is not None
    r2t.req_to_token[:, :32] = loc.view(2, 32)
    fb, feats, _ = _extend(heads[0], pools[0], r2t, [0, 0], [random.randrange(2, 9), 5])
    outs = []
    with torch.no_grad():
        for head, pool in zip(heads, pools, strict=True):
            with forward_context(dataclasses.replace(fb, kv_pool=pool, attn_metadata=None)):
                outs.append(head(fb.input_ids, feats, fb.positions))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert torch.equal(pools[0].k_buffer[0], pools[1].k_buffer[0])
    assert torch.equal(pools[0].v_buffer[0], pools[1].v_buffer[0])
    assert heads[0].kv_proj is None and heads[1].kv_proj is not None
    for pool in pools:  # write_kv over other slots, with other features
        pool.k_buffer[0].zero_()
        pool.v_buffer[0].zero_()
    feats = torch.randn_like(feats)
    loc = r2t.req_to_token[1, 20 : 20 + fb.input_ids.numel()]
    with torch.no_grad():
        for head, pool in zip(heads, pools, strict=True):
            with forward_context(dataclasses.replace(fb, kv_pool=pool, attn_metadata=None)):
                head.write_kv(fb.input_ids, feats, fb.positions, loc)
    assert bool(pools[0].k_buffer[0][loc].abs().sum() > 0)
    assert torch.equal(pools[0].k_buffer[0], pools[1].k_buffer[0])
    assert torch.equal(pools[0].v_buffer[0], pools[1].v_buffer[0])


def test_a_path_extend_is_masked_past_each_accept_length() -> None:
    """As the verify leaves it, a fixed-shape path extend holds every node: a rejected one has
    token -1 and its own slot. Masked, such a row has token 0 and slot 0 (never handed out),
    accepted rows are kept as they are, the last row of each request is its last accepted
    one, and masking a masked batch changes nothing."""
    bs, width = int(torch.randint(2, 6, ())), int(torch.randint(2, 6, ()))
    a = torch.randint(1, width + 1, (bs,))
    a[0] = 1  # at least one rejected node
    step = torch.arange(width)
    accepted = step[None, :] < a[:, None]
    tokens = torch.where(accepted, torch.randint(0, SPEC_VOCAB, (bs, width)), -1).reshape(-1)
    slots = (torch.randperm(500)[: bs * width] + 1).reshape(-1)
    prefix = torch.randint(0, 50, (bs,))
    fb = ForwardBatch(
        mode="extend",
        input_ids=tokens,
        positions=(prefix[:, None] + step[None, :]).reshape(-1),
        out_cache_loc=slots,
        req_pool_indices=torch.randperm(bs),
        prefix_lens=prefix,
        extend_lens=a,
        host=HostLens(width, int(prefix.max()) + width, width == 1),
        kv_pool=None,  # type: ignore[arg-type]
        attn_backend=None,  # type: ignore[arg-type]
    )
    masked, last_rows = mask_path_rows(fb)
    keep = accepted.reshape(-1)
    assert torch.equal(masked.input_ids[keep], tokens[keep])
    assert torch.equal(masked.out_cache_loc[keep], slots[keep])
    assert (masked.input_ids[~keep] == 0).all() and (masked.out_cache_loc[~keep] == 0).all()
    assert torch.equal(masked.positions, fb.positions)
    assert last_rows.tolist() == [b * width + int(a[b]) - 1 for b in range(bs)]
    again, rows_again = mask_path_rows(masked)
    assert torch.equal(again.input_ids, masked.input_ids)
    assert torch.equal(again.out_cache_loc, masked.out_cache_loc)
    assert torch.equal(rows_again, last_rows)

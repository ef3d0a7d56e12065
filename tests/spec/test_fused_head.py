"""An EAGLE3 head on the target's fused Triton kernels (spec/fused_head.py) computes what the
head on torch ops computes: logits, next features and the K/V it writes, over an extend and a
decode, fp32 and bf16, on the GEMV kernels and without; its K/V-only write too. And a head
step launches a fraction of the kernels: what makes the draft loop cheap on a GPU."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from triton_mode import DEVICE  # before triton is imported: picks the interpreter without a GPU

pytest.importorskip("triton")

from conftest import make_forward_batch  # noqa: E402
from graph_standin import LaunchCensus  # noqa: E402

from eagleserve.config import ModelConfig  # noqa: E402
from eagleserve.layers.attention import create_attn_backend  # noqa: E402
from eagleserve.layers.forward_batch import ForwardBatch, forward_context  # noqa: E402
from eagleserve.mem_cache.kv_cache import ReqToTokenPool, TokenToKVPool  # noqa: E402
from eagleserve.model_executor.model_runner import ModelRunner  # noqa: E402
from eagleserve.models.fused_forward import enable_fused_kernels  # noqa: E402
from eagleserve.spec.draft_extend import seed_from_logits  # noqa: E402
from eagleserve.spec.eagle_head import EagleHead  # noqa: E402
from eagleserve.spec.head_loader import init_eagle_head  # noqa: E402

SLOTS = 80


def tol(dtype: torch.dtype) -> dict[str, float]:
    # bf16: rounded where the torch ops round, except rotary (once instead of three times)
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.05}


def heads(path: str, dtype: torch.dtype, gemv_rows: int) -> tuple[EagleHead, EagleHead]:
    """(the head on torch ops, the same weights on the fused kernels) over a fused target."""
    r = ModelRunner(ModelConfig.from_dir(path), path, DEVICE, dtype, 96, 4, 64, "triton",
                    fused_kernels=True)  # fmt: skip
    if not r.model.fused_kernels:  # a CPU host: set up as the runner does on a GPU
        enable_fused_kernels(r.model, DEVICE)
    r.model.fused_gemv_max_rows = gemv_rows
    head = init_eagle_head("EAGLE3", r.model, draft_vocab_size=40, seed=random.randrange(1000))
    with torch.no_grad():  # norms off 1: a swapped or skipped norm weight shows
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    fused = copy.deepcopy(head)
    fused.__dict__["_target"] = head.target  # deepcopy copied the plain attribute too
    assert fused.use_fused_kernels() and not head.fused_kernels
    return head.eval(), fused.eval()


class HeadKV:
    """A head's KV pool and Triton backend, its request rows laid out over shuffled slots."""

    def __init__(self, head: EagleHead, dtype: torch.dtype, slots: torch.Tensor) -> None:
        cfg = head.config
        self.pool = TokenToKVPool(SLOTS, 1, cfg.num_key_value_heads, cfg.head_dim, dtype, DEVICE)
        r2t = ReqToTokenPool(2, 32, DEVICE)
        r2t.req_to_token[:, :] = slots.view(2, 32)
        self.r2t = r2t
        self.backend = create_attn_backend("triton", DEVICE, r2t.req_to_token, cfg.head_dim**-0.5)

    def batch(
        self, mode: str, prefix: list[int], extend: list[int], ids: torch.Tensor
    ) -> ForwardBatch:
        spans = list(zip(prefix, extend, strict=True))
        pos = torch.cat([torch.arange(p, p + e) for p, e in spans])
        loc = torch.cat([self.r2t.req_to_token[i, p : p + e] for i, (p, e) in enumerate(spans)])
        return make_forward_batch(
            mode=mode, input_ids=ids, positions=pos.to(DEVICE), out_cache_loc=loc,
            req_pool_indices=torch.arange(2, device=DEVICE),
            prefix_lens=torch.tensor(prefix, device=DEVICE),
            extend_lens=torch.tensor(extend, device=DEVICE),
            kv_pool=self.pool, attn_backend=self.backend,
        )  # fmt: skip


@pytest.mark.parametrize("gemv_rows", [0, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_matches_the_head_on_torch_ops(
    tiny_model_dir: str, dtype: torch.dtype, gemv_rows: int
) -> None:
    pair = heads(tiny_model_dir, dtype, gemv_rows)
    slots = torch.randperm(SLOTS - 1)[: 2 * 32] + 1  # slot 0 is the padding slot
    kvs = [HeadKV(h, dtype, slots.to(DEVICE)) for h in pair]
    lens = [7, 4]
    steps = [("extend", [0, 0], lens), ("decode", lens, [1, 1]),
             ("extend", [n + 1 for n in lens], [3, 2])]  # fmt: skip
    h = pair[0].hidden_size
    for mode, prefix, extend in steps:
        t = sum(extend)
        ids = torch.randint(3, 256, (t,), device=DEVICE)
        # A first extend fuses the target's three features; later steps feed back h wide.
        width = pair[0].feature_size if mode == "extend" and prefix == [0, 0] else h
        feats = torch.randn(t, width, device=DEVICE).to(dtype)
        outs = []
        for head, kv in zip(pair, kvs, strict=True):
            fb = kv.batch(mode, prefix, extend, ids)
            with torch.no_grad(), forward_context(fb):
                outs.append(head(ids, feats, fb.positions))
        (ref_logits, ref_next), (logits, nxt) = outs
        assert logits.dtype == dtype and ref_logits.dtype == torch.float32
        torch.testing.assert_close(logits.float(), ref_logits, **tol(dtype))
        torch.testing.assert_close(nxt, ref_next, **tol(dtype))
    for name in ("k_buffer", "v_buffer"):
        ref, got = (getattr(kv.pool, name)[0] for kv in kvs)
        torch.testing.assert_close(got, ref, **tol(dtype))
        assert ref[slots[:11]].abs().sum() > 0  # written where the rows were


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_write_kv_matches(tiny_model_dir: str, dtype: torch.dtype) -> None:
    pair = heads(tiny_model_dir, dtype, 16)
    slots = torch.randperm(SLOTS - 1)[: 2 * 32] + 1
    kvs = [HeadKV(h, dtype, slots.to(DEVICE)) for h in pair]
    ids = torch.randint(3, 256, (9,), device=DEVICE)
    feats = torch.randn(9, pair[0].feature_size, device=DEVICE).to(dtype)
    for head, kv in zip(pair, kvs, strict=True):
        fb = kv.batch("extend", [0, 0], [5, 4], ids)
        with torch.no_grad(), forward_context(fb):
            head.write_kv(ids, feats, fb.positions, fb.out_cache_loc)
    for name in ("k_buffer", "v_buffer"):
        ref, got = (getattr(kv.pool, name)[0] for kv in kvs)
        assert ref[slots[:9]].abs().sum() > 0
        torch.testing.assert_close(got, ref, **tol(dtype))


@pytest.mark.skipif(DEVICE.type != "cpu", reason="counts launches under the interpreter")
def test_a_fused_head_step_launches_a_fraction_of_the_kernels(tiny_model_dir: str) -> None:
    """A chain step (one row per request, the head's own features fed back) in bf16, the
    drafter's seed included (on the fused kernels its top-1 and the id map are one launch)."""
    pair = heads(tiny_model_dir, torch.bfloat16, 16)
    slots = torch.randperm(SLOTS - 1)[: 2 * 32] + 1
    counts = []
    for head in pair:
        head.freeze_vocab_map()  # as the drafter serves it
        kv = HeadKV(head, torch.bfloat16, slots)
        ids = torch.randint(3, 256, (2,))
        fb = kv.batch("decode", [5, 3], [1, 1], ids)
        feats = torch.randn(2, head.hidden_size).bfloat16()
        with torch.no_grad(), forward_context(fb):
            head(ids, feats, fb.positions)  # warm, as a graph's capture is
            with LaunchCensus().counting() as census:
                logits, hidden = head(ids, feats, fb.positions)
                seed_from_logits(head, logits, hidden, 1)
        counts.append(census.tally["host"])
    unfused, fused = (sum(c.values()) for c in counts)
    print(f"kernels per head step: torch ops {unfused} {dict(counts[0])}, "
          f"fused {fused} {dict(counts[1])}")  # fmt: skip
    assert fused <= 10 and 5 * fused <= unfused

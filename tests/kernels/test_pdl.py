"""Programmatic dependent launch (kernels/pdl.py): on only where asked for and supported, and on
a GPU that supports it, a decode layer's Triton kernels replayed from a device graph give the
same bits with it as without (each kernel waits for the one before it)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
from triton_mode import DEVICE  # before triton is imported: picks the interpreter without a GPU

pytest.importorskip("triton")

from gemv_inputs import layer_weights, randn, rotary  # noqa: E402

from eagleserve.kernels import gemv_config, pdl  # noqa: E402
from eagleserve.kernels import triton_decode as td  # noqa: E402
from eagleserve.kernels import triton_fused as tf  # noqa: E402
from eagleserve.kernels import triton_gemv as tg  # noqa: E402
from eagleserve.kernels import triton_qkv_rope as tq  # noqa: E402


@pytest.fixture(autouse=True)
def pdl_switch() -> Iterator[None]:
    saved = pdl._enabled
    yield
    pdl._enabled = saved


def test_asked_for_where_unsupported_it_stays_off_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="eagleserve.kernels.pdl"):
        assert not pdl.configure(True, cpu)
    assert "--enable-pdl" in caplog.text and "compute capability 9.0" in caplog.text
    assert pdl.launch_options(cpu) == {"PDL": False, "launch_pdl": False}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eagleserve.kernels.pdl"):
        assert not pdl.configure(False, DEVICE)  # not asked for: off, and nothing to say
    assert not caplog.text
    assert pdl.launch_options(DEVICE) == {"PDL": False, "launch_pdl": False}


@pytest.mark.skipif(
    DEVICE.type != "cuda" or not pdl.supported(DEVICE),
    reason="needs an NVIDIA GPU of compute capability 9.0 or later",
)
@pytest.mark.parametrize("settings", [{"split_k": 4, "block_k": 64}, {"block_k": 512}],
                         ids=["split-k", "one-tile"])  # fmt: skip
def test_a_decode_layer_replayed_with_pdl_gives_the_same_bits(settings: dict[str, int]) -> None:
    """The GEMV kernels (every K split as the tuner may pick it, or every K in one tile, whose
    weight tiles load before the wait), the decode attention and the per-op kernels, one after
    another as a layer runs them, captured in one graph with PDL and in one without: the
    replays' outputs and K/V writes are bitwise equal."""
    assert pdl.configure(True, DEVICE)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    dtype, rows, hidden, nh, nkv, d, inter = torch.bfloat16, 4, 256, 8, 2, 64, 512
    slots = 64
    x, res = randn(rows, hidden, gen=gen, dtype=dtype), randn(rows, hidden, gen=gen, dtype=dtype)
    norm_w, w_qkv, w_gate_up, w_down, w_o = layer_weights(gen, dtype, hidden, nh, nkv, d, inter)
    cos, sin = rotary(rows, d, gen, dtype)
    req_to_token = torch.randperm(slots, generator=gen).view(rows, -1).to(DEVICE)
    seq_lens = torch.tensor([16, 3, 9, 12], device=DEVICE)
    pool_rows = torch.arange(rows, device=DEVICE)
    loc = req_to_token[pool_rows, seq_lens - 1]
    kv_init = [randn(slots, nkv, d, gen=gen, dtype=dtype) for _ in range(2)]

    def layer(kv: list[torch.Tensor]) -> list[torch.Tensor]:
        qkv, stream = tq.norm_qkv_rope_store_kv(x, res, norm_w, 1e-5, w_qkv, None, nh, cos, sin,
                                                kv[0], kv[1], loc)  # fmt: skip
        attn = td.decode_attention(qkv[:, :nh].contiguous(), kv[0], kv[1], req_to_token,
                                   pool_rows, seq_lens, d**-0.5, 2)  # fmt: skip
        o = tg.gemm(attn.view(rows, -1), w_o)
        gate_up, stream2 = tg.norm_gemm(o, stream, norm_w, 1e-5, w_gate_up)
        down = tg.silu_mul_gemm(gate_up, w_down)
        normed, _ = tf.add_rms_norm(down, stream2, norm_w, 1e-5)
        return [qkv, attn, o, gate_up, stream2, down, normed, tf.silu_mul(gate_up)]

    def replayed(on: bool) -> list[torch.Tensor]:
        pdl.configure(on, DEVICE)
        kv = [t.clone() for t in kv_init]
        with gemv_config.overriding(**settings):
            layer(kv)  # compiles outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = layer(kv)
        for t, t0 in zip(kv, kv_init, strict=True):
            t.copy_(t0)
        graph.replay()
        torch.cuda.synchronize()
        return [o.clone() for o in out] + kv

    without, with_pdl = replayed(False), replayed(True)
    for a, b in zip(without, with_pdl, strict=True):
        assert torch.equal(a, b)

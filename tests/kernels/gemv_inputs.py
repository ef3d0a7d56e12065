"""Random inputs and tolerances of the fused-layer and GEMV kernel tests: `randn` (on DEVICE),
`close` (fp32 rounding-level, 16-bit one rounding step), the GEMV test `SHAPES`, `rotary` tables,
a decoder layer's random weights, and the check that a layer's rows do not depend on the batch.
test_triton_fused.py's and test_triton_gemv.py's, shared with test_gemv_config.py and
test_pdl.py. Import it after `pytest.importorskip("triton")`."""

from __future__ import annotations

import torch
from triton_mode import DEVICE  # before triton is imported: picks the interpreter without a GPU

from eagleserve.kernels import triton_gemv as tg
from eagleserve.kernels import triton_qkv_rope as tq

# (hidden, heads, kv heads, head_dim, intermediate): tiny (the interpreter is slow); hidden and
# intermediate not multiples of BLOCK_K, and a head_dim whose half is not a power of two.
SHAPES = ((96, 3, 1, 32, 80), (72, 2, 1, 24, 40))


def close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: rounding-level; 16-bit: within one rounding step of the reference's magnitude."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=2**-7)


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def rotary(rows: int, d: int, gen: torch.Generator, dtype: torch.dtype):  # noqa: ANN201
    """cos and signed sin [T, 1, D] of random positions, as RotaryEmbedding.at builds them."""
    pos = torch.randint(0, 4096, (rows,), generator=gen).float()
    freqs = pos[:, None] / (10000.0 ** (torch.arange(0, d, 2).float() / d))[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    sign = torch.cat((-torch.ones(d // 2), torch.ones(d // 2)))
    return emb.cos().to(dtype)[:, None].to(DEVICE), (emb.sin() * sign).to(dtype)[:, None].to(DEVICE)


def layer_weights(gen: torch.Generator, dtype: torch.dtype, hidden: int, nh: int, nkv: int,
                  d: int, inter: int) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """A decoder layer's random weights: (norm, qkv, gate_up, down, o), each projection scaled
    by 1 / sqrt(its K)."""
    heads = nh + 2 * nkv
    norm_w = 1 + 0.1 * randn(hidden, gen=gen, dtype=dtype)
    w_qkv = randn(heads * d, hidden, gen=gen, dtype=dtype) / hidden**0.5
    w_gate_up = randn(2 * inter, hidden, gen=gen, dtype=dtype) / hidden**0.5
    w_down = randn(hidden, inter, gen=gen, dtype=dtype) / inter**0.5
    w_o = randn(hidden, nh * d, gen=gen, dtype=dtype) / (nh * d) ** 0.5
    return norm_w, w_qkv, w_gate_up, w_down, w_o


def assert_rows_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    """The four kernels of a layer of shape SHAPES[0], with the settings in force."""
    hidden, nh, nkv, d, inter = SHAPES[0]
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    rows = 40
    x, res = randn(rows, hidden, gen=gen, dtype=dtype), randn(rows, hidden, gen=gen, dtype=dtype)
    norm_w, w_qkv, w_gate_up, w_down, w_o = layer_weights(gen, dtype, *SHAPES[0])
    cos, sin = rotary(rows, d, gen, dtype)
    loc = torch.randperm(rows + 9, generator=gen)[:rows].to(DEVICE)
    kv_bufs = [randn(rows + 9, nkv, d, gen=gen, dtype=dtype) for _ in range(2)]

    def layer(sel: slice) -> list[torch.Tensor]:
        k_buf, v_buf = (b.clone() for b in kv_bufs)
        qkv, stream = tq.norm_qkv_rope_store_kv(
            x[sel], res[sel], norm_w, 1e-5, w_qkv, None, nh, cos[sel], sin[sel], k_buf, v_buf,
            loc[sel],
        )  # fmt: skip
        gate_up, stream2 = tg.norm_gemm(qkv.view(qkv.shape[0], -1)[:, :hidden].contiguous(),
                                        stream, norm_w, 1e-5, w_gate_up)  # fmt: skip
        down = tg.silu_mul_gemm(gate_up, w_down)
        o = tg.gemm(qkv.view(qkv.shape[0], -1)[:, : nh * d].contiguous(), w_o)
        return [qkv, stream, gate_up, stream2, down, o, k_buf[loc[sel]], v_buf[loc[sel]]]

    full = layer(slice(0, rows))
    for m in (3, 16, 17, 33):  # m = 1 is i = 0 below
        for got, want in zip(layer(slice(0, m)), full, strict=True):
            assert torch.equal(got, want[:m]), m
    for i in (0, 15, 16, 39):  # a row alone, from any block and any place in it
        for got, want in zip(layer(slice(i, i + 1)), full, strict=True):
            assert torch.equal(got, want[i : i + 1]), i

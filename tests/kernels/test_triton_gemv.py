"""The small-batch fused GEMV kernels (kernels/triton_gemv.py) against the unfused sequence of
kernels/triton_fused.py and the torch Linear they replace, on fresh random inputs: the qkv
output, the residual, and the KV cache at random slots (other slots untouched)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_mode import DEVICE  # before triton is imported: picks the interpreter without a GPU

pytest.importorskip("triton")

from gemv_inputs import (  # noqa: E402
    SHAPES,
    assert_rows_do_not_depend_on_the_batch,
    close,
    layer_weights,
    randn,
    rotary,
)

from eagleserve.kernels import gemv_config  # noqa: E402
from eagleserve.kernels import triton_fused as tf  # noqa: E402
from eagleserve.kernels import triton_gemv as tg  # noqa: E402
from eagleserve.kernels import triton_qkv_rope as tq  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16)
ROWS = (1, 3, 16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_res", [True, False])
@pytest.mark.parametrize("split_k", [1, 3])
def test_norm_qkv_rope_store_kv_matches_unfused(
    dtype: torch.dtype, shape: tuple, rows: int, with_res: bool, split_k: int
) -> None:
    """split_k 3: the K of the projection in three ranges (the last shorter), their partials
    summed in order by the epilogue launch, which does the bias, rotary and stores."""
    hidden, nh, nkv, d, _ = shape
    bias_too = rows == 3  # Qwen2's q/k/v bias
    gen = torch.Generator().manual_seed(hidden * rows + nh + with_res)
    x = randn(rows, hidden, gen=gen, dtype=dtype)
    res = randn(rows, hidden, gen=gen, dtype=dtype) if with_res else None
    norm_w = 1 + 0.1 * randn(hidden, gen=gen, dtype=dtype)
    heads = nh + 2 * nkv
    w = randn(heads * d, hidden, gen=gen, dtype=dtype) / hidden**0.5
    bias = randn(heads * d, gen=gen, dtype=dtype) if bias_too else None
    cos, sin = rotary(rows, d, gen, dtype)
    slots = 2 * rows + 5
    k_buf, v_buf = (randn(slots, nkv, d, gen=gen, dtype=dtype) for _ in range(2))
    # A column of a [T, 2] slot table: a strided out_cache_loc is read by its stride.
    loc = torch.randperm(slots, generator=gen)[: 2 * rows].view(rows, 2)[:, 1].to(DEVICE)
    # Unfused: add_rms_norm, the Linear, rope_store_kv_.
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    normed, res_ref = tf.add_rms_norm(x, res, norm_w, 1e-5)
    qkv_ref = F.linear(normed, w, bias).view(rows, heads, d)
    tf.rope_store_kv_(qkv_ref, nh, cos, sin, k_ref, v_ref, loc)

    with split(split_k):
        qkv, new_res = tq.norm_qkv_rope_store_kv(x, res, norm_w, 1e-5, w, bias, nh, cos, sin,
                                                 k_buf, v_buf, loc)  # fmt: skip
    if res is None:
        assert new_res is x
    else:
        assert torch.equal(new_res, x + res)  # the model-dtype sum, bit for bit, written once
    close(qkv, qkv_ref)
    close(k_buf, k_ref)  # compared whole: the other slots are kept
    close(v_buf, v_ref)
    assert torch.equal(k_buf[loc], qkv[:, nh : nh + nkv])  # the cache holds what attention reads
    assert torch.equal(v_buf[loc], qkv[:, nh + nkv :])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("split_k", [1, 3])
def test_norm_gemm_matches_unfused(dtype: torch.dtype, shape: tuple, rows: int, split_k: int
                                   ) -> None:  # fmt: skip
    """split_k 3: each split writes the new residual over its own K range."""
    hidden, inter = shape[0], shape[4]
    gen = torch.Generator().manual_seed(hidden + inter * rows + split_k)
    x, res = randn(rows, hidden, gen=gen, dtype=dtype), randn(rows, hidden, gen=gen, dtype=dtype)
    norm_w = 1 + 0.1 * randn(hidden, gen=gen, dtype=dtype)
    w = randn(2 * inter, hidden, gen=gen, dtype=dtype) / hidden**0.5
    normed, res_ref = tf.add_rms_norm(x, res, norm_w, 1e-6)
    with split(split_k):
        out, new_res = tg.norm_gemm(x, res, norm_w, 1e-6, w)
    assert torch.equal(new_res, res_ref)
    close(out, F.linear(normed, w))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("split_k", [1, 3])
def test_gemm_matches_linear(dtype: torch.dtype, shape: tuple, rows: int, split_k: int) -> None:
    """o_proj: [T, H * D] @ W.T, K not a multiple of the K step."""
    hidden, nh, d = shape[0], shape[1], shape[3]
    gen = torch.Generator().manual_seed(hidden * rows + nh + split_k)
    x = randn(rows, nh * d, gen=gen, dtype=dtype)
    w = randn(hidden, nh * d, gen=gen, dtype=dtype) / (nh * d) ** 0.5
    with split(split_k):
        close(tg.gemm(x, w), F.linear(x, w))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("split_k", [1, 3])
def test_silu_mul_gemm_matches_unfused(
    dtype: torch.dtype, shape: tuple, rows: int, split_k: int
) -> None:
    """split_k 3 with K steps of 16: three K ranges (the last one shorter) summed in order."""
    hidden, inter = shape[0], shape[4]
    gen = torch.Generator().manual_seed(inter + hidden * rows + split_k)
    gate_up = randn(rows, 2 * inter, gen=gen, dtype=dtype)
    w = randn(hidden, inter, gen=gen, dtype=dtype) / inter**0.5
    with split(split_k):
        got = tg.silu_mul_gemm(gate_up, w)
    close(got, F.linear(tf.silu_mul(gate_up), w))


def split(split_k: int):  # noqa: ANN201
    """Every GEMV launch with its K cut into split_k ranges of 16-steps."""
    if split_k == 1:
        return gemv_config.overriding()
    return gemv_config.overriding(block_k=16, split_k=split_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k, chunked", [(1, False), (3, False), (3, True), (0, False)])
def test_rows_do_not_depend_on_the_batch(
    dtype: torch.dtype, split_k: int, chunked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch-invariant mode runs these kernels at every size: each output row (and its K/V
    write) is bitwise the same alone, at the front of a batch of 1..40 rows (one to three row
    blocks) and anywhere inside it; with every kernel's K split too, with the partials of a
    split launch capped to one row block (a long batch then runs block after block), and
    (split_k 0 here) with every K read in one tile."""
    if chunked:
        monkeypatch.setattr(tg, "_MAX_PARTIALS", 1)
        assert len(tg.row_chunks(40, 3, 8)) == 3
    with split(split_k) if split_k else gemv_config.overriding(block_k=128):
        assert_rows_do_not_depend_on_the_batch(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_one_tile_of_k_gives_the_loops_bits(
    dtype: torch.dtype, shape: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A K step of 128 covers these shapes' K: the kernels read the row and the weight tile at
    once (no K loop), and give bit for bit what the K loop gives with the same setting (the
    row's sum of squares and every rounding the same), the new residual and K/V included."""
    hidden, nh, nkv, d, inter = shape
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    rows = 5
    x, res = randn(rows, hidden, gen=gen, dtype=dtype), randn(rows, hidden, gen=gen, dtype=dtype)
    norm_w, w_qkv, w_gate_up, _, w_o = layer_weights(gen, dtype, *shape)
    cos, sin = rotary(rows, d, gen, dtype)
    loc = torch.randperm(rows + 3, generator=gen)[:rows].to(DEVICE)
    kv_bufs = [randn(rows + 3, nkv, d, gen=gen, dtype=dtype) for _ in range(2)]
    attn = randn(rows, nh * d, gen=gen, dtype=dtype)
    launches: list[bool] = []

    def outputs() -> list[torch.Tensor]:
        k_buf, v_buf = (b.clone() for b in kv_bufs)
        qkv, stream = tq.norm_qkv_rope_store_kv(x, res, norm_w, 1e-5, w_qkv, None, nh, cos, sin,
                                                k_buf, v_buf, loc)  # fmt: skip
        gate_up, stream2 = tg.norm_gemm(x, res, norm_w, 1e-5, w_gate_up)
        return [qkv, stream, gate_up, stream2, tg.gemm(attn, w_o), k_buf, v_buf]

    def spy(k_dim: int, cfg: gemv_config.GemvConfig, splits: int) -> bool:
        launches.append(decide(k_dim, cfg, splits))
        return launches[-1]

    decide = tg.one_tile
    monkeypatch.setattr(tg, "one_tile", spy)
    monkeypatch.setattr(tq, "one_tile", spy)
    with gemv_config.overriding(block_k=128):
        one_tile = outputs()
        assert launches == [True] * 3
        decide = lambda *_: False  # noqa: E731  (the K loop, one step of 128)
        looped = outputs()
    for a, b in zip(one_tile, looped, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("split_k", [1, 3])
def test_norm_qkv_rope_store_kv_reads_the_tables_at_the_positions(rows: int, split_k: int
                                                                  ) -> None:  # fmt: skip
    """Given [P, 1, D] tables and the rows' positions, the launch writes the bits it writes
    from the rows gathered at those positions (split or not: the epilogue reads them too)."""
    hidden, nh, nkv, d, _ = SHAPES[0]
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    table_cos, table_sin = rotary(64, d, gen, dtype)
    positions = torch.randint(0, 64, (rows,), generator=gen).to(DEVICE)
    x, res = (randn(rows, hidden, gen=gen, dtype=dtype) for _ in range(2))
    norm_w = 1 + 0.1 * randn(hidden, gen=gen, dtype=dtype)
    w = randn((nh + 2 * nkv) * d, hidden, gen=gen, dtype=dtype) / hidden**0.5
    slots = 2 * rows + 5
    bufs = [randn(slots, nkv, d, gen=gen, dtype=dtype) for _ in range(2)]
    loc = torch.randperm(slots, generator=gen)[:rows].to(DEVICE)
    want_bufs = [b.clone() for b in bufs]
    with split(split_k):
        want, _ = tq.norm_qkv_rope_store_kv(x, res, norm_w, 1e-5, w, None, nh,
                                            table_cos[positions], table_sin[positions],
                                            *want_bufs, loc)  # fmt: skip
        got, _ = tq.norm_qkv_rope_store_kv(x, res, norm_w, 1e-5, w, None, nh, table_cos,
                                           table_sin, *bufs, loc, positions)  # fmt: skip
    assert torch.equal(got, want)
    assert all(torch.equal(b, wb) for b, wb in zip(bufs, want_bufs))

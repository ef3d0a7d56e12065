"""The fused layer kernels (kernels/triton_fused.py) against the unfused torch path of
models/llama.py, on fresh random inputs: fp32 to fp32 rounding, 16-bit to one rounding step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_mode import DEVICE  # before triton is imported: picks the interpreter without a GPU

pytest.importorskip("triton")

from gemv_inputs import close, randn  # noqa: E402

from eagleserve.config import ModelConfig  # noqa: E402
from eagleserve.kernels import triton_fused as tf  # noqa: E402
from eagleserve.models.llama import RMSNorm, RotaryEmbedding  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16)
# (hidden, intermediate, heads, kv heads, head_dim): SmolLM2-135M, Llama-3-8B, an odd head_dim.
SHAPES = ((576, 1536, 9, 3, 64), (4096, 14336, 32, 8, 128), (320, 864, 4, 2, 80))


def norm_module(weight: torch.Tensor, eps: float) -> RMSNorm:
    norm = RMSNorm(weight.shape[0], eps).to(device=weight.device, dtype=weight.dtype)
    norm.weight.data.copy_(weight)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 3])
def test_add_rms_norm_matches_unfused(dtype: torch.dtype, shape: tuple, rows: int) -> None:
    hidden = shape[0]
    gen = torch.Generator().manual_seed(hidden + rows)
    x, res = randn(rows, hidden, gen=gen, dtype=dtype), randn(rows, hidden, gen=gen, dtype=dtype)
    w = 1 + 0.1 * randn(hidden, gen=gen, dtype=dtype)
    norm = norm_module(w, 1e-5)
    with torch.no_grad():
        out, new_res = tf.add_rms_norm(x, res, w, 1e-5)
        # The residual is the model-dtype sum, bit for bit; the norm is RMSNorm's of it.
        assert torch.equal(new_res, x + res)
        close(out, norm(x + res))
        # Without a residual: plain RMSNorm, the input passed through as the residual.
        out, same = tf.add_rms_norm(x, None, w, 1e-5)
        assert same is x
        close(out, norm(x))


def test_add_rms_norm_strided_rows() -> None:
    """Rows of a wider buffer (a logits_indices gather is not needed: any row stride works)."""
    gen = torch.Generator().manual_seed(7)
    big = randn(4, 1200, gen=gen, dtype=torch.float32)
    x, w = big[:, :576], randn(576, gen=gen, dtype=torch.float32)
    out, _ = tf.add_rms_norm(x, None, w, 1e-6)
    close(out, norm_module(w, 1e-6)(x).detach())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 3])
def test_silu_mul_matches_unfused(dtype: torch.dtype, shape: tuple, rows: int) -> None:
    inter = shape[1]
    gen = torch.Generator().manual_seed(inter + rows)
    gate_up = randn(rows, 2 * inter, gen=gen, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    close(tf.silu_mul(gate_up), F.silu(gate) * up)


def model_config(heads: int, kv_heads: int, head_dim: int, llama3: bool) -> ModelConfig:
    scaling = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
               ("original_max_position_embeddings", 64), ("rope_type", "llama3"))  # fmt: skip
    return ModelConfig(
        vocab_size=32, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=1e-5, rope_theta=500000.0 if llama3 else 10000.0,
        max_position_embeddings=512, tie_word_embeddings=False,
        rope_scaling=scaling if llama3 else None,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 5])
def test_rope_store_kv_matches_unfused(dtype: torch.dtype, shape: tuple, rows: int) -> None:
    _, _, nh, nkv, d = shape
    gen = torch.Generator().manual_seed(nh * d + rows)
    rotary = RotaryEmbedding(model_config(nh, nkv, d, llama3=d == 128), 512).to(DEVICE)
    positions = torch.randint(0, 512, (rows,), generator=gen).to(DEVICE)
    bound = rotary.at(positions, dtype)
    qkv = randn(rows, nh + 2 * nkv, d, gen=gen, dtype=dtype)
    slots = 3 * rows + 4
    k_buf, v_buf = (
        randn(slots, nkv, d, gen=gen, dtype=dtype),
        randn(slots, nkv, d, gen=gen, dtype=dtype),
    )
    # A column of a [T, 2] slot table: a strided out_cache_loc is read by its stride.
    loc = torch.randperm(slots, generator=gen)[: 2 * rows].view(rows, 2)[:, 1].to(DEVICE)
    # Unfused: rotate q and k, then the pool's set_kv.
    q_ref, k_ref = bound(positions, qkv[:, :nh], qkv[:, nh : nh + nkv])
    v_ref = qkv[:, nh + nkv :].clone()
    k_buf_ref, v_buf_ref = k_buf.clone(), v_buf.clone()
    k_buf_ref[loc], v_buf_ref[loc] = k_ref, v_ref

    tf.rope_store_kv_(qkv, nh, bound.cos, bound.signed_sin, k_buf, v_buf, loc)
    close(qkv[:, :nh], q_ref)
    close(qkv[:, nh : nh + nkv], k_ref)
    assert torch.equal(qkv[:, nh + nkv :], v_ref)  # v untouched
    close(k_buf, k_buf_ref)  # other slots kept: compared whole
    assert torch.equal(v_buf, v_buf_ref)
    assert torch.equal(k_buf[loc], qkv[:, nh : nh + nkv])  # the cache holds what attention reads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 6])
def test_rope_store_kv_reads_the_tables_at_the_positions(dtype: torch.dtype, rows: int) -> None:
    """Given the rotary tables and the positions (no gather before the launch, as the fused
    forwards call it), the kernel writes the bits it writes from the gathered rows."""
    _, _, nh, nkv, d = SHAPES[0]
    gen = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    rotary = RotaryEmbedding(model_config(nh, nkv, d, llama3=False), 512).to(DEVICE)
    positions = torch.randint(0, 512, (rows,), generator=gen).to(DEVICE)
    bound = rotary.at(positions, dtype)
    qkv = randn(rows, nh + 2 * nkv, d, gen=gen, dtype=dtype)
    slots = 2 * rows + 3
    bufs = [randn(slots, nkv, d, gen=gen, dtype=dtype) for _ in range(2)]
    loc = torch.randperm(slots, generator=gen)[:rows].to(DEVICE)
    want_qkv, want_bufs = qkv.clone(), [b.clone() for b in bufs]
    tf.rope_store_kv_(want_qkv, nh, bound.cos, bound.signed_sin, *want_bufs, loc)
    tf.rope_store_kv_(qkv, nh, bound.cos_table, bound.sin_table, *bufs, loc, positions)
    assert torch.equal(qkv, want_qkv)
    assert all(torch.equal(b, w) for b, w in zip(bufs, want_bufs))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7])
def test_embed_norm_pair_is_a_lookup_and_two_norms(dtype: torch.dtype, rows: int) -> None:
    """One launch writes the bits of an embedding lookup and two add_rms_norm launches into
    the halves of one row (an EAGLE3 head's attention input)."""
    n, vocab = SHAPES[0][0], 300
    gen = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    table = randn(vocab, n, gen=gen, dtype=dtype)
    ids = torch.randint(0, vocab, (rows,), generator=gen).to(DEVICE)
    g = randn(rows, n, gen=gen, dtype=dtype)
    w1, w2 = (1 + 0.1 * randn(n, gen=gen, dtype=dtype) for _ in range(2))
    want = torch.empty(rows, 2 * n, dtype=dtype, device=DEVICE)
    tf.add_rms_norm(table[ids], None, w1, 1e-5, out=want[:, :n])
    tf.add_rms_norm(g, None, w2, 1e-6, out=want[:, n:])
    got = tf.embed_norm_pair(ids, table, g, (w1, w2), (1e-5, 1e-6))
    assert torch.equal(got, want)

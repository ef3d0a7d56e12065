"""kernels/cpu_pointwise.cpp: the packed CPU target's rotary and SiLU gate in one call each.

The rotary must give BoundRotary's bits (prefill rows of a packed target meet decode rows that
went through either), and both must compute a row the same way whatever rows are beside it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eagleserve.config import ModelConfig
from eagleserve.kernels import cpu_ext
from eagleserve.models.llama import RotaryEmbedding

pytestmark = pytest.mark.skipif(
    not cpu_ext.load(), reason="the AVX2 kernels do not run here (no AVX2/FMA or compiler)"
)


def test_rope_rotates_q_and_k_heads_as_bound_rotary_does() -> None:
    cfg = ModelConfig(
        vocab_size=64, hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=float(torch.randint(10**3, 10**6, ())), max_position_embeddings=4096,
        tie_word_embeddings=True,
    )  # fmt: skip
    rotary = RotaryEmbedding(cfg, 4096)
    t, nh, nkv, d = 5, 9, 3, cfg.head_dim
    positions = torch.randint(0, 4096, (t,))
    bound = rotary.at(positions, torch.float32)
    qkv = torch.randn(t, nh + 2 * nkv, d) * 3
    expected = torch.cat([bound.apply(qkv[:, : nh + nkv]), qkv[:, nh + nkv :]], dim=1)
    got = qkv.clone()
    cpu_ext.rope_(got, bound.cos, bound.signed_sin, nh + nkv)
    assert torch.equal(got, expected)  # v heads untouched, q/k rotated bit for bit


def test_silu_mul_matches_the_composite_and_keeps_rows_apart() -> None:
    gate_up = torch.randn(6, 2 * 1536) * torch.rand(6, 1) * 12  # tails where e^g under/overflows
    gate_up[0, :8] = torch.tensor([-200.0, -88.0, -30.0, -1e-8, 0.0, 1e-8, 30.0, 200.0])
    out = cpu_ext.silu_mul(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    ref = F.silu(gate) * up
    torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=1e-6)
    for i in range(6):
        assert torch.equal(cpu_ext.silu_mul(gate_up[i : i + 1].clone())[0], out[i])

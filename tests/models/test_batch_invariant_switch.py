"""--enable-deterministic-inference at load: which attention backend a device gets, and the
model's linears and norms switched to the batch-invariant kernels (same parameters)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from eagleserve.config import ModelConfig  # noqa: E402
from eagleserve.layers.attention import TorchAttnBackend, create_attn_backend  # noqa: E402
from eagleserve.layers.triton_backend import TritonAttnBackend  # noqa: E402
from eagleserve.models.batch_invariant import (  # noqa: E402
    BatchInvariantLinear,
    BatchInvariantRMSNorm,
    make_batch_invariant,
)
from eagleserve.models.llama import LlamaForCausalLM  # noqa: E402


def test_backend_choice() -> None:
    r2t = torch.zeros(2, 8, dtype=torch.long)
    gpu = torch.device("cuda")
    be = create_attn_backend("auto", gpu, r2t, 0.1, deterministic=True)
    assert isinstance(be, TritonAttnBackend) and be.deterministic
    # A packed (shape-invariant) target may run the mode on Triton too.
    be = create_attn_backend("triton", gpu, r2t, 0.1, shape_invariant=True, deterministic=True)
    assert be.deterministic
    with pytest.raises(ValueError, match="triton"):
        create_attn_backend("torch", gpu, r2t, 0.1, deterministic=True)
    cpu = create_attn_backend("auto", torch.device("cpu"), r2t, 0.1, deterministic=True)
    assert isinstance(cpu, TorchAttnBackend) and cpu.compute_dtype == torch.float64
    assert not create_attn_backend("triton", gpu, r2t, 0.1).deterministic


def test_make_batch_invariant_keeps_weights_and_matches_linear() -> None:
    cfg = ModelConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=50, tie_word_embeddings=True, head_dim=8,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, 64)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    down = model.model.layers[1].mlp.down_proj
    w = down.weight
    x = torch.randn(5, 64)
    want = down(x)
    # 2 layers x (4 attention + 3 MLP linears + 2 norms) + the final norm.
    assert make_batch_invariant(model) == 2 * 9 + 1
    assert type(down) is BatchInvariantLinear and down.weight is w
    assert type(model.model.norm) is BatchInvariantRMSNorm and model.batch_invariant
    torch.testing.assert_close(down(x), want, atol=1e-4, rtol=1e-4)
    h = torch.randn(3, 32)
    torch.testing.assert_close(
        model.compute_logits(h), h @ model.model.embed_tokens.weight.T, atol=1e-4, rtol=1e-4
    )

"""Packed GGUF linears (eagleserve.models.quant) against de-quantized fp32 references.

Blocks are random GGUF-style Q4_0 / Q4_1 / Q8_0 bytes (random d, m, q), de-quantized by
`gguf.quants.dequantize` itself, so the reference is llama.cpp's definition of the weight.
"""

from __future__ import annotations

import pytest
import torch
from conftest import forward_tokens
from gguf_blocks import gguf_reference, random_blocks  # skips this module without gguf
from torch import nn

from eagleserve.kernels import cpu_ext
from eagleserve.models.gguf_weights import QuantTensor, quantize_q4_1, unpack_blocks
from eagleserve.models.quant import (
    BF16Linear,
    Int4Linear,
    Int8Linear,
    Q8Int4Linear,
    pack_head_linears,
    pack_quant,
)

# (N out, K in): K a multiple of 32; the last is lm_head-like (576 x 49152, narrower).
SHAPES = [(32, 32), (96, 64), (192, 576), (576, 1536), (4099, 576)]
BF16_EPS = 2.0**-8  # bf16 unit roundoff is 2^-9; eps (spacing at 1) is 2^-8


def bf16_tol(t: QuantTensor, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Bound [M, N] on |packed(x) - x @ w.T| from bf16 unit roundoff u = eps/2 and dot length K.

    Terms: x rounded to bf16 (u|x||w|); the weight, if materialized in bf16 (u|w|); bf16 scale
    and zero: int4 w' = (q-8)*bf16(d) + bf16(z) is off by <= u(|q-8|d + |z|), int8 q*bf16(s) by
    <= u|w|; fp32 accumulation (K * 2^-24 |x||w|); output rounded to bf16 (u|y|).
    """
    u, k = BF16_EPS / 2, x.shape[-1]
    if t.qtype == "Q8_0":
        scale_err = w.abs()
    else:
        z = t.m + 8 * t.d if t.m is not None else torch.zeros_like(t.d)
        q8 = (t.q.float() - 8).abs() if t.qtype != "Q8_0" else t.q.float().abs()
        scale_err = q8 * t.d.repeat_interleave(32, 1) + z.abs().repeat_interleave(32, 1)
    xa = x.abs()
    bound = (
        u * (xa @ (2 * w.abs() + scale_err).t()) + u * y.abs() + k * 2.0**-24 * (xa @ w.abs().t())
    )
    return 1.25 * bound + 1e-7


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_unpack_matches_gguf_dequantize(qtype: str) -> None:
    n, k = 40, 96
    raw = random_blocks(qtype, n, k, seed=1)
    t = unpack_blocks(raw, qtype, n, k)
    assert torch.equal(t.dequantize(), gguf_reference(raw, qtype, n, k))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_int4_mapping_is_bit_exact(qtype: str, shape: tuple[int, int]) -> None:
    n, k = shape
    raw = random_blocks(qtype, n, k, seed=n + k)
    lin = pack_quant(unpack_blocks(raw, qtype, n, k))  # Q8_0: two int4 halves (q8_0="int4x2")
    assert isinstance(lin, Q8Int4Linear if qtype == "Q8_0" else Int4Linear)
    assert torch.equal(lin.dequantize(), gguf_reference(raw, qtype, n, k))


@pytest.mark.parametrize("mode", ["Q4_0", "Q4_1", "Q8_0:int8", "Q8_0:bf16", "Q8_0:int4x2"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("m", [1, 5])
def test_packed_linear_close_to_fp32(mode: str, shape: tuple[int, int], m: int) -> None:
    qtype, _, q8_0 = mode.partition(":")
    n, k = shape
    raw = random_blocks(qtype, n, k, seed=3 * n + k)
    w = gguf_reference(raw, qtype, n, k)
    t = unpack_blocks(raw, qtype, n, k)
    lin = pack_quant(t, q8_0=q8_0 or "int8")
    kind = {"int8": Int8Linear, "bf16": BF16Linear, "int4x2": Q8Int4Linear}.get(q8_0, Int4Linear)
    assert isinstance(lin, kind)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    ref = x @ w.t()
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    tol = bf16_tol(t, w, x, ref)
    if q8_0 == "int8":
        # Per-channel requantization adds <= half an int8 step (absmax/254) per weight.
        tol = tol + (x.abs().sum(-1, keepdim=True) * w.abs().amax(1) / 254)
    assert bool(((y - ref).abs() <= tol).all()), float(((y - ref).abs() / tol).max())
    assert lin(x.view(m, 1, k)).shape == (m, 1, n)  # any leading dims
    if issubclass(kind, Int4Linear):
        # fp32 compute: exact weights, only the fp32 summation order differs.
        lin.compute_dtype = torch.float32
        err = 1e-5 * (x.abs() @ w.abs().t()) + 1e-6
        assert bool(((lin(x) - ref).abs() <= err).all())


def test_int4_bias_and_dtype() -> None:
    raw = random_blocks("Q4_1", 64, 64, seed=7)
    t = unpack_blocks(raw, "Q4_1", 64, 64)
    b = torch.randn(64)
    lin = Int4Linear.from_quant(t, b)
    x = torch.randn(3, 64).bfloat16()
    y = lin(x)
    assert y.dtype == torch.bfloat16
    ref = x.float() @ t.dequantize().t() + b
    assert torch.allclose(y.float(), ref, atol=0.05, rtol=0.02)


def _prefill_logits(runner: object, ids: torch.Tensor) -> torch.Tensor:
    n = ids.numel()
    loc = runner.token_to_kv_pool.alloc(n)  # type: ignore[attr-defined]
    runner.req_to_token_pool.req_to_token[0, :n] = loc  # type: ignore[attr-defined]
    out = forward_tokens(
        runner,
        "extend",
        ids,
        torch.arange(n),
        loc,
        torch.tensor([0]),
        torch.tensor([0]),
        torch.tensor([n]),
    )
    runner.token_to_kv_pool.free(loc)  # type: ignore[attr-defined]
    return out.logits


def test_smollm2_quantized_close_to_fp32(smollm2_dir: str) -> None:
    from transformers import AutoTokenizer

    from eagleserve.config import ModelConfig
    from eagleserve.model_executor.model_runner import ModelRunner
    from eagleserve.models.loader import default_gguf_path
    from eagleserve.models.packed_model import quantize_model_from_gguf

    cfg = ModelConfig.from_dir(smollm2_dir)
    runner = ModelRunner(cfg, smollm2_dir, torch.device("cpu"), torch.float32, 256, 1, 256)
    text = "The capital of France is Paris. The capital of Germany is"
    ids = torch.tensor(AutoTokenizer.from_pretrained(smollm2_dir).encode(text))
    ref = _prefill_logits(runner, ids)  # [T, vocab] fp32
    # Keep the transformers-dequantized weights to check the packed ones are the same.
    fp = {k: v.clone() for k, v in runner.model.state_dict().items() if k.endswith("proj.weight")}
    quantize_model_from_gguf(runner.model, default_gguf_path())
    mods = dict(runner.model.named_modules())
    assert isinstance(mods["model.layers.0.self_attn.qkv_proj"], Int4Linear)  # fused q/k/v
    assert "model.layers.0.self_attn.q_proj" not in mods  # nothing can call the unfused weight
    assert isinstance(mods["lm_head"], Q8Int4Linear)  # token_embd is Q8_0, tied; q8_0="int4x2"
    attn, mlp = "model.layers.7.self_attn", "model.layers.29.mlp"
    expect = {
        f"{attn}.qkv_proj": torch.cat([fp[f"{attn}.{p}_proj.weight"] for p in "qkv"]),
        f"{mlp}.gate_up_proj": torch.cat([fp[f"{mlp}.{p}_proj.weight"] for p in ("gate", "up")]),
        f"{mlp}.down_proj": fp[f"{mlp}.down_proj.weight"],
    }
    expect["lm_head"] = runner.model.model.embed_tokens.weight  # the Q8_0 table, de-quantized
    # Through the kernel, one identity row per input column: 64 random columns of each, every
    # output row (the whole lm_head's 576 identity rows were most of this test's time).
    for name, weight in expect.items():
        cols = torch.randperm(weight.shape[1])[:64]
        assert torch.equal(mods[name].dequantize(cols), weight[:, cols]), name
    out = _prefill_logits(runner, ids)
    # Inside a forward the packed linears run the AVX2 kernels where they load (activations
    # quantized to int8 per 32-block, as llama.cpp): observed over 4 prompts, max |diff|
    # 2.8-3.6 and mean 0.45-0.53 at logits up to ~40, argmax agreeing at 82-100 % of the
    # positions and at every last one (torch's bf16 path: max 0.64-0.93, mean ~0.08).
    diff = (out - ref).abs()
    bound = 5.0 if cpu_ext.load() else 1.5
    assert float(diff.max()) < bound and float(diff.mean()) < bound / 5, float(diff.max())
    agree = (out.argmax(-1) == ref.argmax(-1)).float().mean()
    assert float(agree) >= 0.8, float(agree)  # near-ties may flip
    assert out.argmax(-1)[-1] == ref.argmax(-1)[-1]


def test_q4_1_blocks_of_a_float_weight() -> None:
    """The draft head's weights as Q4_1 blocks: every weight within half a step (and the d / 64
    an m near 0 may move) of its value, the step and minimum fp16 values, and m + 8d exact in
    fp32 (what Int4Linear's tiles take); blocks near zero and blocks away from it."""
    w = torch.randn(48, 96) * torch.rand(48, 1) * 3 + torch.randn(48, 1)
    w[:4, :32] = torch.linspace(0, 1.5e-2, 32) + torch.rand(4, 1) * 1e-5  # m < d / 64: 0
    w[4:8, :32] = -100.0 + torch.rand(4, 32) * 1e-5  # a range far under the offset's fp16 step
    t = quantize_q4_1(w)
    assert t.qtype == "Q4_1" and t.m is not None and t.q.dtype == torch.uint8
    assert int(t.q.max()) <= 15 and bool((t.m[:4, 0] == 0).all())
    d = t.d.repeat_interleave(32, dim=1)
    assert ((t.dequantize() - w).abs() <= d / 2 + d / 64 + 1e-6).all()
    for s in (t.d, t.m):  # stored as ggml stores them (the kernels read fp16)
        assert torch.equal(s.half().float(), s)
    assert torch.equal(t.m.double() + 8 * t.d.double(), (t.m + 8 * t.d).double())  # exact


def test_head_linears_keep_a_head_close() -> None:
    """A head's linears in 4 bits next to a packed target: Q4_1 tiles where the kernels run,
    outputs within the 4-bit rounding of the float head's."""
    head = nn.Sequential(nn.Linear(96, 64), nn.SiLU(), nn.Linear(64, 160, bias=False)).eval()
    x = torch.randn(5, 96)
    want = head(x)
    pack_head_linears(head)
    kind = Int4Linear if cpu_ext.load() else Int8Linear
    assert isinstance(head[0], kind) and isinstance(head[2], kind)
    err = (head(x).float() - want).abs()
    assert err.max() < 0.2 * want.abs().max() and err.mean() < 0.2 * want.abs().mean()

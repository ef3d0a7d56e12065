"""The blocked kernels (kernels/cpu_gemv.cpp; AVX2, AVX-512 VNNI and AMX-INT8 where the CPU
has them) against llama.cpp's de-quantized weights.

What serving relies on: the exact block weights against x quantized to int8 per 32-block (within
the bound that rounding implies of x @ W.T in fp64), and a row's result that does not depend on
the rows computed beside it — the property that makes a k-token verify reproduce k decodes bit
for bit.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from conftest import forward_tokens
from gguf_blocks import gguf_reference, random_blocks

from eagleserve.kernels import cpu_ext
from eagleserve.models.gguf_weights import unpack_blocks
from eagleserve.models.quant import Int4Linear, Q8Int4Linear, pack_quant

pytestmark = pytest.mark.skipif(
    not cpu_ext.load(), reason="the AVX2 kernel does not run here (no AVX2/FMA or compiler)"
)

SHAPES = [(16, 32), (37, 96), (576, 1536), (1000, 576)]
ISAS = ["avx2", "avx512_vnni", "amx"]  # each includes the one before


def available_isas() -> list[str]:
    return ISAS[: ISAS.index(cpu_ext.gemv_isa("auto")) + 1]


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each ISA's micro-kernels this CPU can run; the default restored after."""
    if request.param not in available_isas():
        pytest.skip(f"this CPU has no {request.param}")
    cpu_ext.gemv_isa(request.param)
    try:
        yield request.param
    finally:
        cpu_ext.gemv_isa("auto")


TEXTS = [
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Water boils at 100 degrees Celsius at sea level, and it freezes at",
    "Once upon a time, in a small village by the sea, there lived an old",
]


def int8_part(raw: np.ndarray, qtype: str, w: torch.Tensor) -> torch.Tensor:
    """The part of each weight that the int8 activations multiply: d * q. A Q4 block's offset
    (-8d for Q4_0, m for Q4_1) multiplies the block's fp32 sum of x instead, as in llama.cpp."""
    if qtype == "Q8_0":
        return w
    n, k = w.shape
    blocks = raw.reshape(n, k // 32, -1)  # per block: d (fp16), [m (fp16)], nibbles
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float64)
    off = -8 * d if qtype == "Q4_0" else blocks[..., 2:4].copy().view(np.float16).astype(np.float64)
    return w - torch.from_numpy(np.repeat(off, 32, axis=-1).reshape(n, k))


def _matmul(lin: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    assert lin.blocked is not None
    return lin._blocked_mm(x)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("shape", SHAPES)
def test_close_to_the_exact_product(qtype: str, shape: tuple[int, int], isa: str) -> None:
    n, k = shape
    seed = int(torch.randint(0, 2**31, ()))
    raw = random_blocks(qtype, n, k, seed)
    lin = pack_quant(unpack_blocks(raw, qtype, n, k))
    assert isinstance(lin, Q8Int4Linear if qtype == "Q8_0" else Int4Linear)
    w = gguf_reference(raw, qtype, n, k).double()
    x = torch.randn(7, k)
    ref = x.double() @ w.t()
    err = (_matmul(lin, x).double() - ref).abs()
    # x rounded to multiples of d_x = max|x_block| / 127 (error <= d_x / 2 per element, times
    # the d * q it multiplies), plus fp32 accumulation: a few ulps of the sum of magnitudes.
    xb = x.double().view(7, k // 32, 32)
    half_step = (xb.abs().amax(-1, keepdim=True) / 254).expand_as(xb).reshape(7, k)
    bound = (1.001 * half_step @ int8_part(raw, qtype, w).abs().t()
             + k * 2.0**-23 * (x.double().abs() @ w.abs().t()))  # fmt: skip
    assert bool((err <= bound + 1e-6).all()), float((err / bound).max())
    if k >= 96:  # rounding errors mostly cancel (a one-block row has too few to average)
        assert float(err.mean()) < 0.25 * float(bound.mean())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_every_isa_gives_the_same_bits(qtype: str) -> None:
    """AVX2, AVX-512 VNNI and AMX's tile multiplies group the exact integer dots differently
    and run the same fp32 operations, so a host's results do not depend on which it has."""
    isas = available_isas()
    if len(isas) == 1:
        pytest.skip("this CPU has AVX2 only")
    n, k = 333, 1536
    raw = random_blocks(qtype, n, k, int(torch.randint(0, 2**31, ())))
    lin = pack_quant(unpack_blocks(raw, qtype, n, k))
    x = torch.randn(41, k) * torch.rand(41, 1) * 4  # two AMX passes of 16 rows, 9 rows after
    try:
        out = {}
        for isa in isas:
            cpu_ext.gemv_isa(isa)
            out[isa] = _matmul(lin, x)
        assert all(torch.equal(out[isa], out["avx2"]) for isa in isas), isas
    finally:
        cpu_ext.gemv_isa("auto")


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_a_row_does_not_depend_on_its_batch(qtype: str, isa: str) -> None:
    # 333 columns: full 16-column tiles, then a part tile padded with zero columns.
    n, k = 333, 576
    raw = random_blocks(qtype, n, k, int(torch.randint(0, 2**31, ())))
    lin = pack_quant(unpack_blocks(raw, qtype, n, k))
    x = torch.randn(64, k) * torch.rand(64, 1) * 4
    alone = torch.cat([_matmul(lin, x[i : i + 1].clone()) for i in range(64)])
    # Every pass size (4 rows share a pass; AMX's 16) and remainders.
    for m in (1, 2, 3, 4, 5, 16, 17, 35, 64):
        start = int(torch.randint(0, 64 - m + 1, ()))
        part = _matmul(lin, x[start : start + m].clone())
        assert torch.equal(part, alone[start : start + m]), m
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:  # nor on how columns and rows split across threads
        assert torch.equal(_matmul(lin, x), alone)
    finally:
        torch.set_num_threads(threads)


def test_smollm2_prefill_rows_equal_their_decodes(smollm2_dir: str, isa: str) -> None:
    """The served model: prefill and decode rows both go through the kernels (int8 activations,
    fp32 row attention), close to the de-quantized fp32 model; the last row of a one-shot
    prefill, of a chunked one and a decode at that position give the same logits bit for bit."""
    from transformers import AutoTokenizer

    from eagleserve.config import ModelConfig
    from eagleserve.layers.attention import create_attn_backend
    from eagleserve.model_executor.model_runner import ModelRunner
    from eagleserve.models.loader import default_gguf_path
    from eagleserve.models.packed_model import quantize_model_from_gguf

    cfg = ModelConfig.from_dir(smollm2_dir)
    runner = ModelRunner(cfg, smollm2_dir, torch.device("cpu"), torch.float32, 256, 1, 256)
    # Text, not random ids: int8 activations are llama.cpp's trade, judged on what it serves.
    text = TEXTS[int(torch.randint(0, len(TEXTS), ()))]
    ids = torch.tensor(AutoTokenizer.from_pretrained(smollm2_dir).encode(text))
    n = ids.numel() - 1
    loc = runner.token_to_kv_pool.alloc(n + 1)
    runner.req_to_token_pool.req_to_token[0, : n + 1] = loc
    rpi = torch.tensor([0])

    def extend(start: int, end: int) -> torch.Tensor:  # tokens [start, end) after a cached prefix
        mode = "decode" if end - start == 1 else "extend"
        return forward_tokens(runner, mode, ids[start:end], torch.arange(start, end),
                              loc[start:end], rpi, torch.tensor([start]),
                              torch.tensor([end - start])).logits[-1]  # fmt: skip

    def decode() -> torch.Tensor:
        extend(0, n)
        return extend(n, n + 1)

    ref = decode()  # dense fp32 weights, as transformers de-quantizes them
    quantize_model_from_gguf(runner.model, default_gguf_path())
    # The modules, whose kernel calls are counted below; the one-call layers give the same bits
    # (tests/models/test_cpu_layers.py).
    runner.model.cpu_layers = None
    runner.attn_backend = create_attn_backend(
        "torch", torch.device("cpu"), runner.req_to_token_pool.req_to_token,
        cfg.head_dim**-0.5, shape_invariant=True,
    )  # fmt: skip
    rows: list[int] = []
    original = cpu_ext.q4_matmul

    def counting(*args: torch.Tensor) -> torch.Tensor:
        rows.append(args[0].shape[0])
        return original(*args)

    cpu_ext.q4_matmul = counting
    try:
        one_shot = extend(0, n + 1)
        assert set(rows) == {n + 1}, "a prefill runs the kernel on all its rows"
        cut = int(torch.randint(1, n - 1, ()))
        extend(0, cut)
        chunked = extend(cut, n + 1)
        one_step = decode()
    finally:
        cpu_ext.q4_matmul = original
        runner.token_to_kv_pool.free(loc)
    assert torch.equal(one_shot, one_step) and torch.equal(chunked, one_step)
    # int8 activations in every prompt row (llama.cpp's trade) against the fp32 model, observed
    # over the four texts: max |diff| 1.6-2.5, mean 0.24-0.68 (bf16 activations: ~0.3, ~0.1).
    diff = (one_step - ref).abs()
    assert float(diff.max()) < 4.0 and float(diff.mean()) < 1.0, (diff.max(), diff.mean())
    # Some texts end where the fp32 model's best logits lie closer than that noise (two within
    # 0.3-0.4, or four within 1.0, as at the end of "Once upon a time ..."), and which of them
    # wins turns on the last bits of any fp32 sum: the pick must be a token the fp32 model scores
    # within twice the mean difference of its best, and its best where no other one is.
    noise = 2 * float(diff.mean())
    pick, top = int(one_step.argmax()), ref.topk(2)
    assert float(top.values[0] - ref[pick]) <= noise, (pick, top, float(ref[pick]), noise)
    if float(top.values[0] - top.values[1]) > noise:
        assert pick == top.indices[0]


def test_scales_that_are_not_fp16_values_are_refused() -> None:
    """The tiles hold block scales as fp16 (ggml's own precision): a scale fp16 cannot hold
    exactly is an error at packing, never silently rounded into other weights."""
    n, k = 48, 64
    d = (torch.rand(n, k // 32) * 0.01).half().float()
    nibbles = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    cpu_ext.pack_q4(nibbles, d, -8 * d)  # ggml's values pack
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    cpu_ext.pack_q8(q8, d)
    off = d.clone()
    off[int(torch.randint(0, n, ())), 0] *= 1 + 2**-15  # between two fp16 values
    with pytest.raises(ValueError, match="fp16"):
        cpu_ext.pack_q4(nibbles, off, -8 * d)
    with pytest.raises(ValueError, match="fp16"):
        cpu_ext.pack_q8(q8, off)

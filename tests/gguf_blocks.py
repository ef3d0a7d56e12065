"""Random GGUF-style Q4_0 / Q4_1 / Q8_0 blocks (`random_blocks`) and their fp32 weights as
llama.cpp's own `gguf.quants.dequantize` gives them (`gguf_reference`): test_quant.py's (in
tests/models), shared with tests/kernels/test_cpu_gemv.py. Importing it skips the importing
test module where the gguf package is missing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")


def random_blocks(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """Raw ggml bytes [N, bytes_per_row] with realistic scales: d ~ 1e-3..2e-2, m ~ -8d."""
    rng = np.random.default_rng(seed)
    g = k // 32
    d = rng.uniform(1e-3, 2e-2, (n, g, 1)).astype(np.float16)
    parts = [d.view(np.uint8)]
    if qtype == "Q4_1":
        m = (-8 * d.astype(np.float32) * rng.uniform(0.5, 1.5, (n, g, 1))).astype(np.float16)
        parts.append(m.view(np.uint8))
    if qtype == "Q8_0":
        parts.append(rng.integers(-128, 128, (n, g, 32), dtype=np.int8).view(np.uint8))
    else:
        parts.append(rng.integers(0, 256, (n, g, 16), dtype=np.uint8))
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def gguf_reference(raw: np.ndarray, qtype: str, n: int, k: int) -> torch.Tensor:
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.asarray(w, dtype=np.float32).reshape(n, k))

"""One transformer layer's decode kernels as bench/tune_gemv.py tunes them: the layer's shape,
random inputs for up to a number of rows, and each GEMV kernel's launch beside the per-op
fused kernels and cuBLAS doing the same work (what runs without the GEMVs)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu import llama3_8b_config  # noqa: E402
from bench.gpu_kernels import smollm2_135m_config, tiny_config  # noqa: E402
from eagleserve.kernels import triton_fused as tf  # noqa: E402
from eagleserve.kernels import triton_gemv as tg  # noqa: E402
from eagleserve.kernels import triton_qkv_rope as tq  # noqa: E402

SHAPES = {"smollm2-135m": smollm2_135m_config, "llama3-8b": llama3_8b_config, "tiny": tiny_config}


@dataclass(frozen=True)
class Layer:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, shape: str) -> Layer:
        c = SHAPES[shape](1)
        d = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
        return cls(c["hidden_size"], c["intermediate_size"], c["num_attention_heads"],
                   c["num_key_value_heads"], d)  # fmt: skip

    def weight(self, kernel: str) -> tuple[int, int]:
        """The kernel's weight [N, K]."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        shapes = {
            "norm_qkv_rope": (qkv, self.hidden),
            "norm_gemm": (2 * self.intermediate, self.hidden),
            "gemm": (self.hidden, self.heads * self.head_dim),  # o_proj
            "silu_mul_gemm": (self.hidden, self.intermediate),
        }
        return shapes[kernel]


class Inputs:
    """Random inputs of one layer shape for up to max(ROWS) rows, fixed for every candidate."""

    def __init__(self, layer: Layer, dtype: torch.dtype, device: torch.device, rows: int) -> None:
        g = torch.Generator().manual_seed(layer.hidden * 7 + layer.intermediate)

        def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (scale * torch.randn(*shape, generator=g)).to(dtype).to(device)

        h, i, d = layer.hidden, layer.intermediate, layer.head_dim
        heads = layer.heads + 2 * layer.kv_heads
        self.layer = layer
        self.x, self.res = randn(rows, h), randn(rows, h)
        self.norm_w = 1 + randn(h, scale=0.1)
        self.w_qkv = randn(heads * d, h, scale=h**-0.5)
        self.w_gate_up = randn(2 * i, h, scale=h**-0.5)
        self.w_down = randn(h, i, scale=i**-0.5)
        self.gate_up = randn(rows, 2 * i)
        self.attn_out = randn(rows, layer.heads * d)
        self.w_o = randn(h, layer.heads * d, scale=(layer.heads * d) ** -0.5)
        angle = torch.rand(rows, d // 2, generator=g) * 6.28
        emb = torch.cat((angle, angle), dim=-1)
        sign = torch.cat((-torch.ones(d // 2), torch.ones(d // 2)))
        self.cos, self.sin = emb.cos().to(dtype).to(device), (emb.sin() * sign).to(dtype).to(device)
        slots = 2 * rows + 3
        self.k_buf, self.v_buf = randn(slots, layer.kv_heads, d), randn(slots, layer.kv_heads, d)
        self.loc = torch.randperm(slots, generator=g)[:rows].to(device)


def launch(kernel: str, inp: Inputs, rows: int) -> list[torch.Tensor]:
    """The GEMV kernel over the first `rows` rows (what is timed); its outputs."""
    r = slice(0, rows)
    if kernel == "norm_qkv_rope":
        return list(tq.norm_qkv_rope_store_kv(
            inp.x[r], inp.res[r], inp.norm_w, 1e-5, inp.w_qkv, None, inp.layer.heads,
            inp.cos[r], inp.sin[r], inp.k_buf, inp.v_buf, inp.loc[r],
        ))  # fmt: skip
    if kernel == "norm_gemm":
        return list(tg.norm_gemm(inp.x[r], inp.res[r], inp.norm_w, 1e-5, inp.w_gate_up))
    if kernel == "gemm":
        return [tg.gemm(inp.attn_out[r], inp.w_o)]
    return [tg.silu_mul_gemm(inp.gate_up[r], inp.w_down)]


def outputs(kernel: str, inp: Inputs, rows: int) -> list[torch.Tensor]:
    """What a launch produces, the K/V rows it wrote included (what is checked)."""
    out = launch(kernel, inp, rows)
    if kernel == "norm_qkv_rope":
        loc = inp.loc[:rows]
        out += [inp.k_buf[loc], inp.v_buf[loc]]
    return out


def launch_fused(kernel: str, inp: Inputs, rows: int) -> None:
    """The same work on the per-op fused kernels and cuBLAS (what runs without the GEMVs)."""
    r = slice(0, rows)
    if kernel == "norm_qkv_rope":
        x, _ = tf.add_rms_norm(inp.x[r], inp.res[r], inp.norm_w, 1e-5)
        qkv = F.linear(x, inp.w_qkv).view(rows, -1, inp.layer.head_dim)
        tf.rope_store_kv_(qkv, inp.layer.heads, inp.cos[r], inp.sin[r], inp.k_buf, inp.v_buf,
                          inp.loc[r])  # fmt: skip
    elif kernel == "norm_gemm":
        x, _ = tf.add_rms_norm(inp.x[r], inp.res[r], inp.norm_w, 1e-5)
        F.linear(x, inp.w_gate_up)
    elif kernel == "gemm":
        F.linear(inp.attn_out[r], inp.w_o)
    else:
        F.linear(tf.silu_mul(inp.gate_up[r]), inp.w_down)

"""Reading a llama-family GGUF with the `gguf` package, keeping Q4_0 / Q4_1 / Q8_0 blocks packed.

Names are mapped to the HF names of `eagleserve.models.llama`, and llama.cpp's rope permutation
of attn_q / attn_k rows is undone exactly as transformers' GGUF loader does
(`LlamaTensorProcessor._reverse_permute_weights`), so that de-quantizing a `QuantTensor` gives
transformers' fp32 weight bit for bit. The permutation only moves whole rows (output features),
and every block lies inside one row, so it is applied to the block fields, not to fp weights.

Block layouts (ggml, 32 weights per block along a row, K = in_features):
- Q4_0, 18 bytes: d fp16, 16 bytes of nibbles; w = d * (q - 8), q in 0..15.
- Q4_1, 20 bytes: d fp16, m fp16, 16 bytes of nibbles; w = d * q + m.
- Q8_0, 34 bytes: d fp16, 32 x int8 q; w = d * q.
Byte j of the nibbles holds weight j (low nibble) and weight j + 16 (high nibble).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name of a llama-family GGUF tensor; None for tensors we do not map."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLK_RE.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


@dataclass
class QuantTensor:
    """One quantized [N, K] weight, blocks unpacked into fields (rows already un-permuted)."""

    qtype: str  # "Q4_0" | "Q4_1" | "Q8_0"
    q: torch.Tensor  # [N, K] uint8 in 0..15 (Q4_*) or int8 (Q8_0)
    d: torch.Tensor  # [N, K // 32] fp32, exactly the fp16 block scale
    m: torch.Tensor | None  # [N, K // 32] fp32 block minimum (Q4_1 only)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    def dequantize(self) -> torch.Tensor:
        """[N, K] fp32 computed like `gguf.quants.dequantize` (one rounding: d*q is exact)."""
        d = self.d.repeat_interleave(BLOCK, dim=1)
        if self.qtype == "Q4_1":
            assert self.m is not None
            return d * self.q.float() + self.m.repeat_interleave(BLOCK, dim=1)
        if self.qtype == "Q4_0":
            return d * (self.q.to(torch.int8) - 8).float()
        return self.q.float() * d


def quantize_q4_1(weight: torch.Tensor) -> QuantTensor:
    """An fp weight [N, K] (K a multiple of 32) as Q4_1 blocks: per 32 weights, m = the least
    and d = (greatest - least) / 15, both rounded to fp16 as ggml stores them, and q =
    round((w - m) / d) in 0..15 against those stored values. m + 8d is kept exact in fp32, as
    Int4Linear's layout needs: an m below d / 64 in size is 0 (error <= d/2 + d/64), and d is at
    least |m| / 4096 (a block whose range is that small next to its offset is steps of fp16's
    own rounding of m anyway)."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // BLOCK, BLOCK)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    m = lo.half().float()
    d = ((hi - m) / 15.0).half().float().clamp(min=2.0**-24)  # fp16's least
    m = torch.where(m.abs() < d / 64, 0.0, m)
    d = torch.maximum(d, (m.abs() * 2.0**-12).half().float())
    q = torch.round((w - m[..., None]) / d[..., None]).clamp(0, 15).to(torch.uint8)
    return QuantTensor("Q4_1", q.reshape(n, k), d.contiguous(), m.contiguous())


def unpack_blocks(raw: np.ndarray, qtype: str, n: int, k: int) -> QuantTensor:
    """`raw` [N, bytes_per_row] uint8 as stored by ggml -> QuantTensor with [N, K] fields."""
    if k % BLOCK:
        raise ValueError(f"{qtype} row length {k} is not a multiple of {BLOCK}")
    g = k // BLOCK
    head = 4 if qtype == "Q4_1" else 2
    nbytes = head + (BLOCK if qtype == "Q8_0" else BLOCK // 2)
    blocks = np.ascontiguousarray(raw).reshape(n, g, nbytes)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    m = None
    if qtype == "Q4_1":
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    body = blocks[..., head:]
    if qtype == "Q8_0":
        q = torch.from_numpy(body.copy().view(np.int8).reshape(n, k))
    else:
        lo, hi = body & 0x0F, body >> 4  # [N, G, 16] each: weights 0..15 and 16..31
        q = torch.from_numpy(np.concatenate([lo, hi], axis=-1).reshape(n, k))
    return QuantTensor(qtype, q, d, m)


def reverse_permute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row index so that `w[idx]` undoes llama.cpp's q/k rope permutation (as transformers)."""
    half = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, half, 2).transpose(1, 2).reshape(-1)


def permute_quant_rows(t: QuantTensor, idx: torch.Tensor) -> QuantTensor:
    m = None if t.m is None else t.m[idx].contiguous()
    return QuantTensor(t.qtype, t.q[idx].contiguous(), t.d[idx].contiguous(), m)


def iter_gguf(
    path: str, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, QuantTensor | torch.Tensor]]:
    """Yields (HF name, QuantTensor for Q4_0/Q4_1/Q8_0, else an fp32 tensor de-quantized by gguf).

    Tensor shapes follow torch ([out, in]); q/k rows are un-permuted for both kinds.
    """
    import gguf

    reader = gguf.GGUFReader(path)
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        qtype = t.tensor_type.name
        # GGUF shapes list the fastest dimension first: [K, N] for a torch [N, K] weight.
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        value: QuantTensor | torch.Tensor
        if qtype in QUANT_TYPES and len(shape) == 2:
            value = unpack_blocks(t.data, qtype, shape[0], shape[1])
        else:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            value = torch.from_numpy(np.array(arr, dtype=np.float32).reshape(shape))
        n_head = num_heads if ".q_proj." in name else num_kv_heads
        if ".q_proj." in name or ".k_proj." in name:
            idx = reverse_permute_rows(shape[0], n_head)
            if isinstance(value, QuantTensor):
                value = permute_quant_rows(value, idx)
            else:
                value = value[idx].contiguous()
        yield name, value

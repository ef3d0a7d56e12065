"""Packed 4-bit / 8-bit linears for CPU, fed straight from a GGUF's Q4_0 / Q4_1 / Q8_0 blocks.

- `Int4Linear`: `aten._weight_int4pack_mm_for_cpu`, group size 32 (= the ggml block), which
  computes w = (q - 8) * scale + zero per group. Q4_1 (w = d*q + m) maps with scale = d,
  zero = m + 8d; Q4_0 (w = d*(q - 8)) with scale = d, zero = 0. In fp32 this is bit-exact:
  (q - 8)*d is exact (11-bit d times 4-bit q), so both sides round the same real number once,
  provided m + 8d is exact in fp32 (checked at pack time; true for every SmolLM2 block).
  The fast kernel needs bf16 activations AND bf16 scales/zeros, so the compute path rounds
  d and m + 8d to bf16 (a relative weight error <= 2^-9, the same order as a bf16 model).
- `Int8Linear`: `torch._weight_int8pack_mm` takes one scale per output channel, not per
  32-block, so Q8_0 is de-quantized and re-quantized per channel (symmetric, absmax / 127):
  NOT bit-exact to the GGUF. A block-exact bmm over bf16 q, the exact alternative, was much slower.
- models/packed_model.py puts these in a model's place (fused q/k/v and gate/up), and
  models/weight_cache.py keeps the packed modules across starts.
- Model forwards (prefill, decode, verify, draft steps) of Int4Linear / Q8Int4Linear run
  `kernels/cpu_gemv.cpp` where the CPU has AVX2 + FMA: the exact block weights against
  activations quantized to int8 per block (llama.cpp's computation), and a per-row result that
  does not depend on the number of rows, so a k-token verify gives each row what a decode
  would, and a one-shot, chunked or prefix-cached prefill the same KV. Outside a forward
  (direct calls) the modules keep torch's int4 kernel in their compute dtype.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from eagleserve.kernels import cpu_ext
from eagleserve.layers.forward_batch import in_forward
from eagleserve.models.gguf_weights import BLOCK, QuantTensor, quantize_q4_1

logger = logging.getLogger(__name__)


class Int4Linear(nn.Module):
    """y = x @ W.T (+ b) with W [N, K] stored as int4pack (uint8 [N, K/2]) + per-32 scale/zero."""

    def __init__(
        self,
        q: torch.Tensor,  # [N, K] integer in 0..15
        scale: torch.Tensor,  # [N, K // 32] fp32
        zero: torch.Tensor,  # [N, K // 32] fp32
        bias: torch.Tensor | None = None,  # [N]
        compute_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        n, k = q.shape
        if k % BLOCK or scale.shape != (n, k // BLOCK) or zero.shape != scale.shape:
            raise ValueError(f"bad int4 shapes q {tuple(q.shape)} scale {tuple(scale.shape)}")
        self.in_features, self.out_features = k, n
        self.compute_dtype = compute_dtype
        # The packing op needs N % 16 == 0: pad with zero rows (scale = zero = 0), sliced off.
        pad = -n % 16
        q, scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in (q.to(torch.int32), scale, zero))
        # The op packs an int32 [N, K] in 0..15 into its own CPU layout (uint8 [N, K/2]).
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.register_buffer("qweight", packed)
        # scales_and_zeros [K // 32, N_pad, 2]: [..., 0] = scale, [..., 1] = zero; fp32 exact.
        sz = torch.stack([scale.float().t(), zero.float().t()], dim=-1).contiguous()
        self.register_buffer("scales_and_zeros", sz)
        self.register_buffer("sz_compute", sz.to(compute_dtype), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.blocked: tuple[torch.Tensor, ...] | None = None
        if cpu_ext.load():  # ggml's nibble layout, w = d*q + m (exact: zero - 8d is m)
            qb = q[:n].to(torch.uint8).view(n, k // BLOCK, BLOCK)
            nibbles = (qb[..., :16] | (qb[..., 16:] << 4)).reshape(n, k // 2).contiguous()
            d = scale[:n].float()
            self.blocked = cpu_ext.pack_q4(nibbles, d, zero[:n].float() - 8 * d)

    @classmethod
    def from_quant(
        cls, t: QuantTensor, bias: torch.Tensor | None = None, **kw: object
    ) -> Int4Linear:
        if t.qtype == "Q4_1":
            assert t.m is not None
            zero = t.m + 8 * t.d
            exact = zero.double() == t.m.double() + 8 * t.d.double()
            if not bool(exact.all()):
                logger.warning("%d Q4_1 blocks: m + 8d is not exact in fp32", int((~exact).sum()))
        elif t.qtype == "Q4_0":
            zero = torch.zeros_like(t.d)
        else:
            raise ValueError(f"Int4Linear cannot hold {t.qtype}")
        return cls(t.q, t.d, zero, bias, **kw)  # type: ignore[arg-type]

    def _mm(self, x2: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        # x2 [M, K] -> [M, N] (padding rows dropped)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, BLOCK, sz)
        return y if y.shape[1] == self.out_features else y[:, : self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., K] any float dtype -> [..., N] in x.dtype; the matmul runs in compute_dtype.
        # (Few ops on purpose: at batch 1 each costs as much as a small layer's matmul.)
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self.blocked is not None and in_forward():
            y = self._blocked_mm(x2.float()).to(x.dtype)
        else:
            sz = self.sz_compute if self.compute_dtype != torch.float32 else self.scales_and_zeros
            y = self._mm(self._kernel_input(x2.to(self.compute_dtype)), sz).to(x.dtype)
        if x.dim() != 2:
            y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _kernel_input(self, x2: torch.Tensor) -> torch.Tensor:
        return x2  # [M, K] as the packed weight reads it

    def _blocked_mm(self, x2: torch.Tensor) -> torch.Tensor:
        assert self.blocked is not None
        return cpu_ext.q4_matmul(x2, *self.blocked, self.out_features)

    @torch.no_grad()
    def dequantize(self, cols: torch.Tensor | None = None) -> torch.Tensor:
        """[N, K] fp32 weight, read back through the kernel itself (fp32 path, identity input);
        with `cols`, only those input columns ([N, len(cols)]: one kernel row each)."""
        eye = torch.eye(self.in_features, dtype=torch.float32, device=self.qweight.device)
        rows = eye if cols is None else eye[cols]
        return self._mm(self._kernel_input(rows), self.scales_and_zeros).t().contiguous()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, compute={self.compute_dtype}"


class Q8Int4Linear(Int4Linear):
    """Q8_0 (w = d*q, q in -128..127, 32 per block) as ONE int4pack matmul of [x, x] with [Wh, Wl].

    q = 16*hi + lo with hi = q >> 4 in -8..7 and lo = q & 15. The kernel's (q4 - 8)*scale + zero
    gives 16d*hi for q4 = hi + 8, scale = 16d, zero = 0, and d*lo for q4 = lo, scale = d,
    zero = 8d; the two halves of K sum to d*q in the kernel's fp32 accumulator. With bf16 scales
    the weight is bf16(d)*q (relative error <= 2^-9 per block, as a bf16 copy of the weight has
    per element), read at 1 byte per weight instead of bf16's 2, which halves a memory-bound
    GEMV's time (bench/cpu_vs_llamacpp.py --gemv measures it).
    """

    def __init__(
        self,
        q: torch.Tensor,  # [N, K] int8
        d: torch.Tensor,  # [N, K // 32] fp32
        bias: torch.Tensor | None = None,
        compute_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        q8 = q
        q = q.to(torch.int16)
        hi, lo = (q >> 4) + 8, q & 15  # both in 0..15
        super().__init__(
            torch.cat([hi, lo], dim=1),
            torch.cat([16 * d, d], dim=1),
            torch.cat([torch.zeros_like(d), 8 * d], dim=1),
            bias,
            compute_dtype,
        )
        self.in_features = q.shape[1]
        if self.blocked is not None:
            self.blocked = cpu_ext.pack_q8(q8.to(torch.int8), d.float())

    def _blocked_mm(self, x2: torch.Tensor) -> torch.Tensor:
        assert self.blocked is not None
        return cpu_ext.q8_matmul(x2, *self.blocked, self.out_features)

    @classmethod
    def from_quant(
        cls, t: QuantTensor, bias: torch.Tensor | None = None, **kw: object
    ) -> Q8Int4Linear:
        if t.qtype != "Q8_0":
            raise ValueError(f"Q8Int4Linear holds Q8_0, not {t.qtype}")
        return cls(t.q, t.d, bias, **kw)  # type: ignore[arg-type]

    def _kernel_input(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.cat([x2, x2], dim=1)  # [M, 2K]: the hi and the lo half read the same x


class Int8Linear(nn.Module):
    """y = x @ W.T (+ b) with W [N, K] int8 and one fp scale per output channel."""

    def __init__(
        self,
        qweight: torch.Tensor,  # [N, K] int8
        scales: torch.Tensor,  # [N]
        bias: torch.Tensor | None = None,
        compute_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.compute_dtype = compute_dtype
        self.register_buffer("qweight", qweight.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.register_buffer("scales_compute", self.scales.to(compute_dtype), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, **kw: object
    ) -> Int8Linear:
        """Symmetric per-channel quantization of an fp weight [N, K] (absmax / 127)."""
        w = weight.float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scales, bias, **kw)  # type: ignore[arg-type]

    @classmethod
    def from_quant(
        cls, t: QuantTensor, bias: torch.Tensor | None = None, **kw: object
    ) -> Int8Linear:
        # Per-channel requantization of the exact de-quantized Q8_0 weight (see module doc).
        return cls.from_float(t.dequantize(), bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(self.compute_dtype)
        s = self.scales_compute if self.compute_dtype != torch.float32 else self.scales
        y = torch._weight_int8pack_mm(x2, self.qweight, s)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, compute={self.compute_dtype}"


class BF16Linear(nn.Module):
    """y = x @ W.T (+ b) with W [N, K] in bf16; for Q8_0 this is the exact fp32 weight rounded
    once to bf16 (rel. error <= 2^-9, vs ~1% for the per-channel int8 requantization)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.to(torch.bfloat16).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()


PackedLinear = Int4Linear | Int8Linear | BF16Linear  # Q8Int4Linear is an Int4Linear


def pack_quant(
    t: QuantTensor,
    bias: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.bfloat16,
    q8_0: str = "int4x2",
) -> PackedLinear:
    """Q4_0 / Q4_1 -> Int4Linear (exact mapping); Q8_0 -> Q8Int4Linear (q8_0="int4x2"),
    BF16Linear ("bf16") or Int8Linear ("int8", per-channel requantized)."""
    if t.qtype == "Q8_0" and q8_0 == "int4x2":
        return Q8Int4Linear.from_quant(t, bias, compute_dtype=compute_dtype)
    if t.qtype == "Q8_0" and q8_0 == "bf16":
        return BF16Linear(t.dequantize(), bias)
    if t.qtype == "Q8_0":
        return Int8Linear.from_quant(t, bias, compute_dtype=compute_dtype)
    return Int4Linear.from_quant(t, bias, compute_dtype=compute_dtype)


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, module)


@torch.no_grad()
def head_linears(module: nn.Module) -> dict[str, nn.Module]:
    """A 4-bit module for every nn.Linear below `module`, by name (`module` is only read), for a
    draft head next to a packed target: Q4_1 blocks on the CPU kernels where they load, else
    per-channel Int8Linear. A draft step reads every weight of the head, from memory after a
    verify has streamed the target's; Q4_1 reads 0.6x the bytes of Q8_0. The draft's numerics
    do not affect the output (verify decides), only its speed and acceptance
    (eagleserve/assets/smollm2-135m-eagle/TRAINING.md, "The head's weights in 4 bits")."""
    out: dict[str, nn.Module] = {}
    for name, old in module.named_modules():
        if not isinstance(old, nn.Linear):
            continue
        bias = None if old.bias is None else old.bias.detach()
        w = old.weight.detach()
        out[name] = (
            Int4Linear.from_quant(quantize_q4_1(w), bias)
            if cpu_ext.load() and w.shape[1] % BLOCK == 0
            else Int8Linear.from_float(w, bias)
        )
    return out


def pack_head_linears(module: nn.Module) -> None:
    """Replaces every nn.Linear below `module` by its `head_linears` module, in place."""
    for name, new in head_linears(module).items():
        set_module(module, name, new)

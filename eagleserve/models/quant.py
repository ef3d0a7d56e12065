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
  NOT bit-exact to the GGUF. A block-exact bmm over bf16 q was 7x slower than this (measured).
- Model forwards (prefill, decode, verify, draft steps) of Int4Linear / Q8Int4Linear run
  `kernels/cpu_gemv.cpp` where the CPU has AVX2 + FMA: the exact block weights against
  activations quantized to int8 per block (llama.cpp's computation), and a per-row result that
  does not depend on the number of rows, so a k-token verify gives each row what a decode
  would, and a one-shot, chunked or prefix-cached prefill the same KV. Outside a forward
  (direct calls) the modules keep torch's int4 kernel in their compute dtype.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from eagleserve.kernels import cpu_ext
from eagleserve.layers.forward_batch import in_forward
from eagleserve.models.cpu_layers import CpuLayers
from eagleserve.models.gguf_weights import BLOCK, QuantTensor, iter_gguf, quantize_q8_0
from eagleserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, RMSNorm

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
    def dequantize(self) -> torch.Tensor:
        """[N, K] fp32 weight, read back through the kernel itself (fp32 path, identity input)."""
        eye = torch.eye(self.in_features, dtype=torch.float32, device=self.qweight.device)
        return self._mm(self._kernel_input(eye), self.scales_and_zeros).t().contiguous()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, compute={self.compute_dtype}"


class Q8Int4Linear(Int4Linear):
    """Q8_0 (w = d*q, q in -128..127, 32 per block) as ONE int4pack matmul of [x, x] with [Wh, Wl].

    q = 16*hi + lo with hi = q >> 4 in -8..7 and lo = q & 15. The kernel's (q4 - 8)*scale + zero
    gives 16d*hi for q4 = hi + 8, scale = 16d, zero = 0, and d*lo for q4 = lo, scale = d,
    zero = 8d; the two halves of K sum to d*q in the kernel's fp32 accumulator. With bf16 scales
    the weight is bf16(d)*q (relative error <= 2^-9 per block, as a bf16 copy of the weight has
    per element), read at 1 byte per weight instead of bf16's 2 (the 576x49152 lm_head GEMV at
    batch 1 on 2 cores: 1.6 ms against 3.2 in bf16; bench/cpu_vs_llamacpp.py --gemv).
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


# Projections reading the same input: one packed matmul instead of three (two) saves the int4
# kernel's fixed cost per call (measured per layer at batch 1: 546 -> 453 us).
FUSED_GROUPS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
FUSED_MEMBERS = {m for members in FUSED_GROUPS.values() for m in members}


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, module)


def _fuse_siblings(
    model: nn.Module,
    pending: dict[str, tuple[QuantTensor, torch.Tensor | None]],
    compute_dtype: torch.dtype,
) -> dict[str, tuple[QuantTensor, torch.Tensor | None]]:
    """Packs each complete same-type group of `pending` as one fused module (rows stacked in
    member order); returns what could not be fused, to be packed one by one."""
    left = dict(pending)
    parents = {name.rpartition(".")[0] for name in pending}
    for parent in sorted(parents):
        for fused, members in FUSED_GROUPS.items():
            names = [f"{parent}.{m}" for m in members]
            parts = [pending.get(n) for n in names]
            if any(p is None for p in parts):
                continue
            if len({p[0].qtype for p in parts}) != 1:  # type: ignore[index]
                continue
            values = [p[0] for p in parts]  # type: ignore[index]
            biases = [p[1] for p in parts]  # type: ignore[index]
            if any(b is None for b in biases) and not all(b is None for b in biases):
                continue
            qt = values[0].qtype
            cat = QuantTensor(
                qt,
                torch.cat([v.q for v in values]),
                torch.cat([v.d for v in values]),
                None if qt != "Q4_1" else torch.cat([v.m for v in values]),  # type: ignore[misc]
            )
            bias = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
            _set_module(model, f"{parent}.{fused}", pack_quant(cat, bias, compute_dtype))
            for m in members:  # gone, so that nothing can call the unfused weights by mistake
                delattr(model.get_submodule(parent), m)
                del left[f"{parent}.{m}"]
    return left


@torch.no_grad()
def linears_to_int8(module: nn.Module) -> None:
    """Replaces every nn.Linear below `module` by an 8-bit one, in place: Q8_0 blocks on the
    CPU kernels where they load (the target's own GEMM, fast for a prefill's many rows as for
    one), else per-channel Int8Linear. For the draft head next to a packed target: the draft's
    numerics do not affect the output (verify decides), only its speed and acceptance."""
    names = [n for n, m in module.named_modules() if isinstance(m, nn.Linear)]
    for name in names:
        old = module.get_submodule(name)
        bias = None if old.bias is None else old.bias.detach()
        w = old.weight.detach()
        new: nn.Module = (
            Q8Int4Linear.from_quant(quantize_q8_0(w), bias)
            if cpu_ext.load() and w.shape[1] % BLOCK == 0
            else Int8Linear.from_float(w, bias)
        )
        _set_module(module, name, new)


def _packed_compute_logits(self: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    head = self.lm_head  # the kernel in a forward or not: prompt scores = the sampled rows'
    if getattr(head, "blocked", None) is not None and hidden.dim() == 2:
        return head._blocked_mm(hidden.float())
    return head(hidden).float()


@torch.no_grad()
def quantize_model_from_gguf(
    model: LlamaForCausalLM,
    gguf_path: str,
    compute_dtype: torch.dtype = torch.bfloat16,
    q8_0: str = "int4x2",
    shard: Callable[[str, QuantTensor], QuantTensor] | None = None,
) -> None:
    """Replaces, in place, every nn.Linear whose GGUF tensor is Q4_0 / Q4_1 / Q8_0 by a packed
    module under the same HF name. Other types (F32, F16, K-quants) keep their fp weights.
    q8_0: how Q8_0 tensors run: "int4x2" (Q8Int4Linear), "bf16" or "int8" (see pack_quant).
    shard(module name, tensor): the blocks this module holds (a tensor-parallel rank's).

    Tied embeddings: the fp `embed_tokens` table stays for lookups; when `token_embd` is
    quantized (Q8_0 in SmolLM2's GGUF, which has no `output.weight`), the logits matmul uses
    a packed `lm_head` built from it. `compute_logits` is overridden on this instance only,
    since LlamaForCausalLM.compute_logits reads `lm_head_weight` (still the fp table, which
    EAGLE-3 head init copies rows from).
    """
    cfg = model.config
    modules = dict(model.named_modules())
    tied = cfg.tie_word_embeddings
    counts: dict[str, int] = {}
    pending: dict[str, tuple[QuantTensor, torch.Tensor | None]] = {}
    for name, value in iter_gguf(gguf_path, cfg.num_attention_heads, cfg.num_key_value_heads):
        if not isinstance(value, QuantTensor):
            continue
        mod_name = name.rsplit(".", 1)[0]
        if name == "model.embed_tokens.weight":
            if not tied or "lm_head" in modules:
                continue  # untied: output.weight carries the lm_head
            mod_name = "lm_head"
        elif not isinstance(modules.get(mod_name), nn.Linear):
            continue
        old = modules.get(mod_name)
        if shard is not None:
            value = shard(mod_name, value)
        if old is not None and tuple(old.weight.shape) != value.shape:
            raise ValueError(f"{name}: GGUF shape {value.shape} != {tuple(old.weight.shape)}")
        dev = (old.weight if old is not None else model.model.embed_tokens.weight).device
        if dev.type != "cpu":
            raise ValueError("packed GGUF linears run on CPU only")
        bias = None if old is None or old.bias is None else old.bias.detach()
        if value.qtype in ("Q4_0", "Q4_1") and mod_name.rsplit(".", 1)[-1] in FUSED_MEMBERS:
            pending[mod_name] = (value, bias)  # packed below, fused with its siblings
            continue
        _set_module(model, mod_name, pack_quant(value, bias, compute_dtype, q8_0))
        counts[value.qtype] = counts.get(value.qtype, 0) + 1
    unfused = _fuse_siblings(model, pending, compute_dtype)
    if len(unfused) < len(pending):
        counts["fused from Q4"] = len(pending) - len(unfused)
    for mod_name, (value, bias) in unfused.items():
        _set_module(model, mod_name, pack_quant(value, bias, compute_dtype, q8_0))
        counts[value.qtype] = counts.get(value.qtype, 0) + 1
    if tied and isinstance(getattr(model, "lm_head", None), PackedLinear):
        model.compute_logits = types.MethodType(_packed_compute_logits, model)  # type: ignore
    if cpu_ext.load():  # its forwards: the one-call norm, rotary, SiLU gate and layers as well
        for module in model.modules():
            if isinstance(module, (RMSNorm, LlamaMLP)):
                module.row_kernel = True
            elif isinstance(module, LlamaAttention):  # the rotary kernel's vector width
                module.row_kernel = module.head_dim % 16 == 0
        model.cpu_layers = CpuLayers.build(model)
    logger.info("packed GGUF linears: %s", counts)

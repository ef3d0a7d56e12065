"""A model's linears as packed GGUF blocks (models/quant.py): built from the file, put in place.

Building (`pack_gguf_linears`) reads the GGUF and packs every Q4_0 / Q4_1 / Q8_0 linear, q/k/v
and gate/up fused into one module each; installing (`install_packed`) puts those modules in
the model under their HF names. The two are apart so that models/weight_cache.py can keep the
built modules and install them on a later start without reading or packing the file again.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable

import torch
from torch import nn

from eagleserve.kernels import cpu_ext
from eagleserve.models.cpu_layers import CpuLayers
from eagleserve.models.gguf_weights import QuantTensor, iter_gguf
from eagleserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, RMSNorm
from eagleserve.models.quant import PackedLinear, pack_quant, set_module

logger = logging.getLogger(__name__)

# Projections reading the same input: one packed matmul instead of three (two) saves the int4
# kernel's fixed cost per call (its threads' start and the input's quantization).
FUSED_GROUPS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
FUSED_MEMBERS = {m for members in FUSED_GROUPS.values() for m in members}


def _fuse_siblings(
    pending: dict[str, tuple[QuantTensor, torch.Tensor | None]],
    compute_dtype: torch.dtype,
) -> tuple[dict[str, nn.Module], dict[str, tuple[QuantTensor, torch.Tensor | None]]]:
    """Packs each complete same-type group of `pending` as one fused module (rows stacked in
    member order); returns those and what could not be fused, to be packed one by one."""
    left = dict(pending)
    fused_modules: dict[str, nn.Module] = {}
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
            fused_modules[f"{parent}.{fused}"] = pack_quant(cat, bias, compute_dtype)
            for name in names:
                del left[name]
    return fused_modules, left


@torch.no_grad()
def pack_gguf_linears(
    model: LlamaForCausalLM,
    gguf_path: str,
    compute_dtype: torch.dtype = torch.bfloat16,
    q8_0: str = "int4x2",
    shard: Callable[[str, QuantTensor], QuantTensor] | None = None,
) -> dict[str, nn.Module]:
    """The packed module of every nn.Linear of `model` whose GGUF tensor is Q4_0 / Q4_1 / Q8_0,
    by HF module name (a fused group under its fused name: `...self_attn.qkv_proj`); `model`
    is only read (its linears' shapes, devices and biases). Other types (F32, F16, K-quants)
    keep their fp weights. q8_0: how Q8_0 tensors run: "int4x2" (Q8Int4Linear), "bf16" or
    "int8" (see pack_quant). shard(module name, tensor): the blocks this module holds (a
    tensor-parallel rank's).

    Tied embeddings: when `token_embd` is quantized (Q8_0 in SmolLM2's GGUF, which has no
    `output.weight`), a packed `lm_head` is built from it (install_packed says how it is used).
    """
    cfg = model.config
    modules = dict(model.named_modules())
    tied = cfg.tie_word_embeddings
    packed: dict[str, nn.Module] = {}
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
        packed[mod_name] = pack_quant(value, bias, compute_dtype, q8_0)
    fused, unfused = _fuse_siblings(pending, compute_dtype)
    packed.update(fused)
    for mod_name, (value, bias) in unfused.items():
        packed[mod_name] = pack_quant(value, bias, compute_dtype, q8_0)
    return packed


def _packed_compute_logits(self: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    head = self.lm_head  # the kernel in a forward or not: prompt scores = the sampled rows'
    if getattr(head, "blocked", None) is not None and hidden.dim() == 2:
        return head._blocked_mm(hidden.float())
    return head(hidden).float()


def install_packed(model: LlamaForCausalLM, packed: dict[str, nn.Module]) -> None:
    """Puts `packed` (pack_gguf_linears) in `model`, in place. A fused module replaces its
    members, which are removed so that nothing can call the unfused weights by mistake.

    A packed `lm_head` serves the logits matmul: `compute_logits` is overridden on this
    instance only, since LlamaForCausalLM.compute_logits reads `lm_head_weight`: with tied
    embeddings the fp `embed_tokens` table (kept for lookups, and EAGLE-3 head init copies
    rows from it), untied a `.weight` the packed module does not have.
    """
    counts: dict[str, int] = {}
    for mod_name, module in packed.items():
        parent, _, attr = mod_name.rpartition(".")
        for member in FUSED_GROUPS.get(attr, ()):
            parent_module = model.get_submodule(parent)
            if hasattr(parent_module, member):
                delattr(parent_module, member)
        set_module(model, mod_name, module)
        kind = type(module).__name__ + (" (fused)" if attr in FUSED_GROUPS else "")
        counts[kind] = counts.get(kind, 0) + 1
    if isinstance(getattr(model, "lm_head", None), PackedLinear):
        model.compute_logits = types.MethodType(_packed_compute_logits, model)  # type: ignore
    if cpu_ext.load():  # its forwards: the one-call norm, rotary, SiLU gate and layers as well
        for module in model.modules():
            if isinstance(module, (RMSNorm, LlamaMLP)):
                module.row_kernel = True
            elif isinstance(module, LlamaAttention):  # the rotary kernel's vector width
                module.row_kernel = module.head_dim % 16 == 0
        model.cpu_layers = CpuLayers.build(model)
    logger.info("packed GGUF linears: %s", counts)


def quantize_model_from_gguf(
    model: LlamaForCausalLM,
    gguf_path: str,
    compute_dtype: torch.dtype = torch.bfloat16,
    q8_0: str = "int4x2",
    shard: Callable[[str, QuantTensor], QuantTensor] | None = None,
) -> None:
    """Replaces, in place, every nn.Linear whose GGUF tensor is Q4_0 / Q4_1 / Q8_0 by a packed
    module under the same HF name (pack_gguf_linears, then install_packed; no cache)."""
    install_packed(model, pack_gguf_linears(model, gguf_path, compute_dtype, q8_0, shard))

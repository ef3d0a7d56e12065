"""The decoder layers on the fused Triton kernels (GPU path; also runs under TRITON_INTERPRET=1).

Per layer: add+RMSNorm, qkv GEMM, rotary+KV write, attention (decode: 2 kernels), o GEMM,
add+RMSNorm, gate_up GEMM, SiLU*mul, down GEMM. The residual stream travels beside the layer
output and is added inside the next norm, as in SGLang; each value is rounded to the model dtype
where the unfused path in models/llama.py rounds it (tests/models/test_fused_forward.py).

In the batch-invariant mode a small model (`model.gemv_capable`) runs the GEMV kernels of
kernels/triton_gemv.py instead, at every size, which fold the pointwise ops into the GEMMs:
[add+RMSNorm+qkv+rotary+KV write], attention, o GEMM (a GEMV kernel too), [add+RMSNorm+gate_up],
[SiLU*mul+down]. Their rows do not depend on the batch, and a verify row must run the kernels its
decode runs.
Outside the mode they run forwards of at most `model.fused_gemv_max_rows` rows: as many as
bench/tune_gemv.py measured them faster than the per-op kernels on this device for this layer
shape (kernels/gemv_config.py), 0 on a device it has not measured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from eagleserve.kernels.gemv_config import gemv_max_rows
from eagleserve.kernels.triton_fused import add_rms_norm, rope_store_kv_, silu_mul
from eagleserve.kernels.triton_gemv import gemm, norm_gemm, silu_mul_gemm
from eagleserve.kernels.triton_qkv_rope import norm_qkv_rope_store_kv
from eagleserve.layers.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from eagleserve.models.llama import (
        BoundRotary,
        LlamaAttention,
        LlamaDecoderLayer,
        LlamaForCausalLM,
    )

_GEMV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _stacked(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output rows are `parts`' rows in order (each output column unchanged)."""
    w = parts[0].weight
    bias = parts[0].bias is not None
    out = nn.Linear(w.shape[1], sum(p.weight.shape[0] for p in parts), bias=bias,
                    device=w.device, dtype=w.dtype)  # fmt: skip
    with torch.no_grad():
        out.weight.copy_(torch.cat([p.weight for p in parts]))
        if bias:
            out.bias.copy_(torch.cat([p.bias for p in parts]))  # type: ignore[misc]
    return out


def merge_projections(model: LlamaForCausalLM) -> None:
    """q/k/v as one qkv_proj and gate/up as one gate_up_proj per layer (the parts are freed)."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is None:
            attn.qkv_proj = _stacked([attn.q_proj, attn.k_proj, attn.v_proj])
            del attn.q_proj, attn.k_proj, attn.v_proj
        if mlp.gate_up_proj is None:
            mlp.gate_up_proj = _stacked([mlp.gate_proj, mlp.up_proj])
            del mlp.gate_proj, mlp.up_proj


def enable_fused_kernels(model: LlamaForCausalLM, device: torch.device) -> None:
    """The layers on the fused kernels (projections merged), with the GEMV kernels for forwards
    of at most as many rows as this device measured them faster for the model's layer shape."""
    merge_projections(model)
    model.fused_kernels = True
    cfg, dtype = model.config, model.model.embed_tokens.weight.dtype
    model.fused_gemv_max_rows = gemv_max_rows(cfg.hidden_size, cfg.intermediate_size, dtype, device)


def _attention(attn: LlamaAttention, x: torch.Tensor, fb: ForwardBatch, rotary: BoundRotary):  # noqa: ANN202
    t, nh, nkv = x.shape[0], attn.num_heads, attn.num_kv_heads
    assert attn.qkv_proj is not None, "merge_projections first"
    qkv = attn.qkv_proj(x).view(t, nh + 2 * nkv, attn.head_dim)
    pool = fb.kv_pool
    rope_store_kv_(qkv, nh, rotary.cos_table, rotary.sin_table, pool.k_buffer[attn.layer_id],
                   pool.v_buffer[attn.layer_id], fb.out_cache_loc, rotary.positions)  # fmt: skip
    return attend(attn, qkv, fb)


def attend(
    attn: LlamaAttention, qkv: torch.Tensor, fb: ForwardBatch, gemv: bool = False
) -> torch.Tensor:
    """Attention of the rotated qkv [T, H + 2Hkv, D] (k, v already in the pool), then o_proj
    (on the GEMV kernel with the others, where it has no bias)."""
    nh, nkv = attn.num_heads, attn.num_kv_heads
    q, k, v = qkv[:, :nh], qkv[:, nh : nh + nkv], qkv[:, nh + nkv :]
    out = fb.attn_backend.forward(q, k, v, attn.layer_id, fb, kv_stored=True)
    rows = out.reshape(qkv.shape[0], -1)
    if gemv and attn.o_proj.bias is None:
        return gemm(rows, attn.o_proj.weight)
    return attn.o_proj(rows)


def use_gemv(model: LlamaForCausalLM, rows: int, dtype: torch.dtype) -> bool:
    """The GEMV kernels for a forward of `rows` rows of a plain float dtype. In the
    batch-invariant mode every forward of a small model (gemv_capable) does: one kernel per op
    for any batch keeps a row's bits the same in a decode of one row, a verify of many and a
    prefill (the logits run the batch-invariant GEMM); a large one never does (its prefills
    would run them too). Outside the mode, forwards of at most `fused_gemv_max_rows` rows, for
    a model of any size: as many as the device's tuned table says beat cuBLAS."""
    if dtype not in _GEMV_DTYPES:
        return False
    if model.batch_invariant:
        return model.gemv_capable
    return rows <= model.fused_gemv_max_rows


def _gemv_layer(
    layer: LlamaDecoderLayer,
    h: torch.Tensor,
    residual: torch.Tensor | None,
    fb: ForwardBatch,
    rotary: BoundRotary,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(layer output, residual stream, the stream entering the layer) in four launches besides
    attention (one more for each kernel whose K is split)."""
    attn, mlp, pool = layer.self_attn, layer.mlp, fb.kv_pool
    qkv_proj, gate_up_proj = attn.qkv_proj, mlp.gate_up_proj
    assert isinstance(qkv_proj, nn.Linear) and isinstance(gate_up_proj, nn.Linear)
    assert gate_up_proj.bias is None and mlp.down_proj.bias is None
    norm = layer.input_layernorm
    qkv, entering = norm_qkv_rope_store_kv(
        h, residual, norm.weight, norm.eps, qkv_proj.weight, qkv_proj.bias, attn.num_heads,
        rotary.cos_table, rotary.sin_table, pool.k_buffer[attn.layer_id],
        pool.v_buffer[attn.layer_id], fb.out_cache_loc, rotary.positions,
    )  # fmt: skip
    h = attend(attn, qkv, fb, gemv=True)
    norm = layer.post_attention_layernorm
    gate_up, residual = norm_gemm(h, entering, norm.weight, norm.eps, gate_up_proj.weight)
    return silu_mul_gemm(gate_up, mlp.down_proj.weight), residual, entering


def fused_layers(
    model: LlamaForCausalLM,
    h: torch.Tensor,
    fb: ForwardBatch,
    rotary: BoundRotary,
    aux_layer_ids: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(final normed hidden [T, hidden], aux states [T, k * hidden] or None) from embeddings h.
    An aux state, the stream entering its layer (as the unfused loop keeps it), is the sum that
    layer's first kernel writes anyway: no launch of its own."""
    residual: torch.Tensor | None = None
    aux: list[torch.Tensor] = []
    gemv = use_gemv(model, h.shape[0], h.dtype)
    for i, layer in enumerate(model.model.layers):
        if gemv:
            h, residual, entering = _gemv_layer(layer, h, residual, fb, rotary)
        else:
            norm = layer.input_layernorm
            x, entering = add_rms_norm(h, residual, norm.weight, norm.eps)
            h = _attention(layer.self_attn, x, fb, rotary)
            norm, mlp = layer.post_attention_layernorm, layer.mlp
            x, residual = add_rms_norm(h, entering, norm.weight, norm.eps)
            assert mlp.gate_up_proj is not None, "merge_projections first"
            h = mlp.down_proj(silu_mul(mlp.gate_up_proj(x)))
        if i in aux_layer_ids:
            aux.append(entering)
    final = model.model.norm
    out, _ = add_rms_norm(h, residual, final.weight, final.eps)
    return out, torch.cat(aux, dim=-1) if aux else None

"""An EAGLE3 head's layer on the target's fused Triton kernels (models/fused_forward.py), beside
a target that runs them (a GPU with Triton attention; the interpreter in tests).

Unfused in 16 bits, a head step launches some sixty kernels: each of its four RMSNorms is eight
ops (upcast, square, mean, add, rsqrt, two products, the cast back), rotary four per tensor, and
q, k, v, gate and up are GEMMs of their own. On these kernels a step is about ten:
- the embedding lookup and the two input norms, written into the halves of one [T, 2h] row;
- the qkv GEMM, then rotary and the K/V write in one launch;
- attention and o_proj, as a target layer runs them;
- [add + post norm + gate_up], [SiLU*mul + down] and [add + final norm + lm_head] on the GEMV
  kernels for forwards of at most as many rows as the target takes them for
  (`fused_forward.use_gemv`), per-op fused kernels around cuBLAS GEMMs above that.
Values are rounded where the unfused head rounds them (rotary: once, not three times), so the
drafts match the unfused head's up to 16-bit rounding; they only propose tokens, and the verify
decides what is committed. Logits stay in the model dtype: the draft's softmax upcasts them
as it reads them (`top_candidates`; a chain's top-1 is one more launch, kernels/triton_top1.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from eagleserve.kernels.triton_fused import add_rms_norm, embed_norm_pair, rope_store_kv_, silu_mul
from eagleserve.kernels.triton_gemv import gemm, norm_gemm, silu_mul_gemm
from eagleserve.models.fused_forward import attend, use_gemv

if TYPE_CHECKING:
    from eagleserve.layers.forward_batch import ForwardBatch
    from eagleserve.models.llama import BoundRotary
    from eagleserve.spec.eagle_head import EagleHead


def _project(x: torch.Tensor, linear: nn.Module, gemv: bool) -> torch.Tensor:
    assert isinstance(linear, nn.Linear) and linear.bias is None
    return gemm(x, linear.weight) if gemv else linear(x)


def attention_input(head: EagleHead, input_ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """cat(input_layernorm(embed(input_ids)), hidden_norm(g)) [T, 2h] in one launch."""
    m = head.midlayer
    norms = (m.input_layernorm, m.hidden_norm)
    return embed_norm_pair(input_ids, head.target.model.embed_tokens.weight, g,
                           (norms[0].weight, norms[1].weight),
                           (norms[0].eps, norms[1].eps))  # fmt: skip


def layer_forward(
    head: EagleHead,
    input_ids: torch.Tensor,
    g: torch.Tensor,
    fb: ForwardBatch,
    rotary: BoundRotary,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft logits [T, draft_vocab] in the model dtype, next features [T, h]) of rows with
    these tokens and fused features g, their K/V written to the forward's slots."""
    m = head.midlayer
    attn, mlp, post, final = m.self_attn, m.mlp, m.post_attention_layernorm, head.norm
    t = g.shape[0]
    gemv = use_gemv(head.target, t, g.dtype)
    qkv = _project(attention_input(head, input_ids, g), attn.qkv_proj, gemv)
    qkv = qkv.view(t, attn.num_heads + 2 * attn.num_kv_heads, attn.head_dim)
    pool = fb.kv_pool
    rope_store_kv_(qkv, attn.num_heads, rotary.cos_table, rotary.sin_table,
                   pool.k_buffer[attn.layer_id], pool.v_buffer[attn.layer_id],
                   fb.out_cache_loc, rotary.positions)  # fmt: skip
    o = attend(attn, qkv, fb, gemv)
    assert isinstance(mlp.gate_up_proj, nn.Linear)
    if gemv:  # the residual stream (x = g + o, then out = x + mlp) is added inside the norms
        gate_up, x = norm_gemm(o, g, post.weight, post.eps, mlp.gate_up_proj.weight)
        down = silu_mul_gemm(gate_up, mlp.down_proj.weight)
        return norm_gemm(down, x, final.weight, final.eps, head.lm_head.weight)
    normed, x = add_rms_norm(o, g, post.weight, post.eps)
    down = mlp.down_proj(silu_mul(mlp.gate_up_proj(normed)))
    normed, out = add_rms_norm(down, x, final.weight, final.eps)
    return head.lm_head(normed), out


def write_kv(
    head: EagleHead,
    input_ids: torch.Tensor,
    g: torch.Tensor,
    rotary: BoundRotary,
    fb: ForwardBatch,
    out_cache_loc: torch.Tensor,
) -> None:
    """The K/V of rows with these tokens and fused features, rotated, into their slots of the
    forward's pool: three launches."""
    attn, t = head.midlayer.self_attn, g.shape[0]
    assert head.kv_proj is not None
    x = attention_input(head, input_ids, g)
    kv = _project(x, head.kv_proj, use_gemv(head.target, t, g.dtype))
    pool = fb.kv_pool
    rope_store_kv_(kv.view(t, 2 * attn.num_kv_heads, attn.head_dim), 0, rotary.cos_table,
                   rotary.sin_table, pool.k_buffer[attn.layer_id],
                   pool.v_buffer[attn.layer_id], out_cache_loc, rotary.positions)  # fmt: skip

"""The EAGLE head unrolled over draft depths on padded batches ("training-time test").

Depth 0 at row j pairs token x[j+1] with the target's feature of position j (position j), as the
worker's draft extend does. Depth s >= 1 at row j is the s-th draft step after a verify that
committed j+1 tokens: input token x[j+s+1], the head's own depth s-1 output as feature, position
j+s. Its attention sees exactly what the draft KV pool holds then: the depth-0 keys of rows
<= j (the committed context) plus the depth 1..s keys of row j itself (its own chain).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagleserve.spec.eagle_head import EagleHead

KV = tuple[torch.Tensor, torch.Tensor]  # k, v [B, Hkv, T, D] after rotary
TTT_ATTENTION = ("dense", "sdpa")


def chain_mask(t: int, n_chain: int, device: torch.device) -> torch.Tensor:
    """[t, (1 + n_chain) * t] bool over keys [context; chain depth 1; ...]: row j sees the
    context keys <= j and, in every chain block, its own key only."""
    row = torch.arange(t, device=device)[:, None]
    col = torch.arange((1 + n_chain) * t, device=device)[None, :]
    return torch.where(col < t, col <= row, col % t == row)


def _sdpa_chain(q: torch.Tensor, chain: list[KV], rep: int) -> torch.Tensor:
    """The depth >= 1 attention as one fused SDPA call over the concatenated keys and a
    boolean mask: no [T, T] scores kept for the backward (memory O(T) per row on a GPU)."""
    k = torch.cat([kk for kk, _ in chain], dim=2).repeat_interleave(rep, 1)
    v = torch.cat([vv for _, vv in chain], dim=2).repeat_interleave(rep, 1)
    mask = chain_mask(q.shape[2], len(chain) - 1, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _attention(
    attn: torch.nn.Module,
    head: EagleHead,
    x: torch.Tensor,
    positions: torch.Tensor,
    past: list[KV],
    impl: str = "dense",
) -> tuple[torch.Tensor, KV]:
    """x [B, T, in] -> [B, T, h]; `past` = keys/values of depths 0..s-1 (empty at depth 0).
    `impl` (TTT_ATTENTION) picks how depths >= 1 compute the same attention: "dense" builds
    the [T, T] scores and the chain's diagonal terms, "sdpa" one masked SDPA call."""
    bsz, t, _ = x.shape
    nh, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = attn.q_proj(x).reshape(bsz * t, nh, d)
    k = attn.k_proj(x).reshape(bsz * t, nkv, d)
    v = attn.v_proj(x).reshape(bsz, t, nkv, d).transpose(1, 2)
    q, k = head.rotary_emb(positions.reshape(-1), q, k)
    q = q.reshape(bsz, t, nh, d).transpose(1, 2)  # [B, H, T, D]
    k = k.reshape(bsz, t, nkv, d).transpose(1, 2)
    scale = d**-0.5
    if not past:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nh != nkv)
    elif impl == "sdpa":
        o = _sdpa_chain(q, [*past, (k, v)], nh // nkv)
    else:
        rep = nh // nkv
        k0, v0 = (z.repeat_interleave(rep, dim=1) for z in past[0])
        s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, H, T, T] over committed context
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        s0 = s0.masked_fill(~causal, float("-inf"))
        chain = [
            (kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)) for kk, vv in past[1:]
        ]
        chain.append((k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
        diag = [(q * kk).sum(-1, keepdim=True) * scale for kk, _ in chain]  # [B, H, T, 1] each
        p = torch.softmax(torch.cat([s0, *diag], dim=-1), dim=-1)
        o = p[..., :t] @ v0
        for i, (_, vv) in enumerate(chain):
            o = o + p[..., t + i : t + i + 1] * vv
    o = o.transpose(1, 2).reshape(bsz, t, nh * d)
    return attn.o_proj(o), (k, v)


def head_step(
    head: EagleHead,
    input_ids: torch.Tensor,
    features: torch.Tensor,
    positions: torch.Tensor,
    past: list[KV],
    attention: str = "dense",
) -> tuple[torch.Tensor, torch.Tensor, KV]:
    """One depth over [B, T] rows, the math of `EagleHead.forward`. Returns (pre-lm_head
    hidden [B, T, h] (normed for EAGLE3, raw for EAGLE), next features [B, T, h], this depth's
    k/v)."""
    emb = head.target.model.embed_tokens(input_ids)  # frozen, no grad
    if head.algorithm == "EAGLE":
        layer = head.layers[0]
        x = head.fc(torch.cat((emb, features.to(emb.dtype)), dim=-1))
        a, kv = _attention(layer.self_attn, head, x, positions, past, attention)
        x = x + a
        out = x + layer.mlp(layer.post_attention_layernorm(x))
        return out, out, kv
    feats = features.to(emb.dtype)
    g = head.fc(feats) if feats.shape[-1] != head.hidden_size else feats
    m = head.midlayer
    attn_in = torch.cat((m.input_layernorm(emb), m.hidden_norm(g)), dim=-1)
    a, kv = _attention(m.self_attn, head, attn_in, positions, past, attention)
    x = g + a
    out = x + m.mlp(m.post_attention_layernorm(x))
    return head.norm(out), out, kv


def lm_head_weight(head: EagleHead) -> torch.Tensor:
    """[draft_vocab, h]: EAGLE3's own head (trained); EAGLE reads the target's (frozen)."""
    if head.algorithm == "EAGLE3":
        return head.lm_head.weight
    return head.target.lm_head_weight.detach()

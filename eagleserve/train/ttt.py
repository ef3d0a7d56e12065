"""The EAGLE head unrolled over draft depths on padded batches ("training-time test").

Depth 0 at row j pairs token x[j+1] with the target's feature of position j (position j), as the
worker's draft extend does. Depth s >= 1 at row j is the s-th draft step after a verify that
committed j+1 tokens: input token x[j+s+1], the head's own depth s-1 output as feature, position
j+s. Its attention sees exactly what the draft KV pool holds then: the depth-0 keys of rows
<= j (the committed context) plus the depth 1..s keys of row j itself (its own chain).

Three forms of that depth >= 1 attention compute the same values (TTT_ATTENTION):
- "dense": the [T, T] context scores and the chain's diagonal terms, one softmax;
- "sdpa": one SDPA call over every depth's keys with a boolean mask: no [T, T] kept for the
  backward, but a masked call does the work of (1 + s) full [T, T] products;
- "merge": a causal SDPA over the context alone (the flash kernels' half [T, T]) and the
  chain's s diagonal terms, merged by their softmax weights (`merge_chain`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagleserve.spec.eagle_head import EagleHead

KV = tuple[torch.Tensor, torch.Tensor]  # k, v [B, Hkv, T, D] after rotary
TTT_ATTENTION = ("dense", "sdpa", "merge")


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


def context_with_sink(
    q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, sink: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, H, T, D] and the context k0, v0 [B, Hkv, T, D] widened for one causal SDPA that
    also reports the context's softmax mass: a sink key at row 0 that query i scores
    `sink[b, h, i]` (q's column D holds sink / scale, the sink key a 1 there; q's row 0 is a
    dummy) and two value columns, D (1 at the sink) and D + 1 (1 at every context key). The
    width is rounded up to a multiple of 8 (the fused kernels' head sizes). Row i + 1 of the
    output is then [A_i Z_i, e^sink_i, Z_i] / (e^sink_i + Z_i), with A_i the causal attention
    of query i and Z_i its context's sum of exp(score). `sink` must be exact in q's dtype once
    divided by `scale` (the caller rounds it)."""
    d = q.shape[-1]
    width = -(-(d + 2) // 8) * 8
    col = (sink / scale).to(q.dtype)[..., None]
    qs = F.pad(torch.cat([q, col], -1), (0, width - d - 1, 1, 0))
    marks = torch.zeros(k0.shape[2] + 1, width, dtype=v0.dtype, device=v0.device)
    marks[0, d] = 1  # the sink's key and value
    ks = F.pad(k0, (0, width - d, 1, 0)) + marks.to(k0.dtype)
    marks[1:, d + 1] = 1  # the context's values
    vs = F.pad(v0, (0, width - d, 1, 0)) + marks
    return qs, ks, vs


def _einsum_input(x: torch.Tensor) -> torch.Tensor:
    """x as an einsum here reads it: fp32, except under autocast, which runs the product in its
    own dtype (an fp32 copy would only be cast back, both ways, at every depth)."""
    return x if torch.is_autocast_enabled(x.device.type) else x.float()


def _chain_scores(q: torch.Tensor, chain: list[KV], scale: float) -> torch.Tensor:
    """[B, H, T, n] (fp32; autocast's dtype under autocast): query i against its own key of
    each chain depth."""
    bsz, nh, t, d = q.shape
    nkv = chain[0][0].shape[1]
    qg = _einsum_input(q).reshape(bsz, nkv, nh // nkv, t, d)
    keys = torch.stack([_einsum_input(kk) for kk, _ in chain], 3)  # [B, Hkv, T, n, D]
    return torch.einsum("bgrtd,bgtnd->bgrtn", qg, keys).reshape(bsz, nh, t, -1) * scale


def merge_chain(
    o_sink: torch.Tensor, scores: torch.Tensor, sink: torch.Tensor, chain: list[KV]
) -> torch.Tensor:
    """The attention over [context; chain] from the sink SDPA's output rows o_sink
    [B, H, T, width] (`context_with_sink`, dummy row dropped), the chain scores e_j
    (`_chain_scores`), the sink's scores and the chain's values [B, Hkv, T, D]. With
    a = A Z / (e^sink + Z), s = e^sink / (e^sink + Z), r = Z / (e^sink + Z), the softmax over
    all keys is (a + s sum_j e^(e_j - sink) u_j) / (r + s sum_j e^(e_j - sink)), in fp32 (the
    sum over u_j in autocast's dtype under autocast). With
    the sink at the chain's largest score no exponent overflows, and whichever side
    underflows (s or r) carries less than e^-87 of the mass."""
    bsz, nh, t, _ = scores.shape
    nkv = chain[0][1].shape[1]
    d = chain[0][1].shape[-1]
    o = o_sink.float()
    a, s, r = o[..., :d], o[..., d], o[..., d + 1]
    wts = (scores - sink[..., None]).exp() * s[..., None]  # [B, H, T, n]
    vals = torch.stack([_einsum_input(vv) for _, vv in chain], 3)  # [B, Hkv, T, n, D]
    chain_out = torch.einsum("bgrtn,bgtnd->bgrtd", wts.reshape(bsz, nkv, nh // nkv, t, -1), vals)
    return (a + chain_out.reshape(bsz, nh, t, d)) / (r + wts.sum(-1))[..., None]


def _merged_chain(
    q: torch.Tensor, chain: list[KV], scale: float, gqa: bool, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """The depth >= 1 attention as a causal SDPA over the context (`context_with_sink`) and the
    chain's diagonal terms (`merge_chain`). The result does not depend on the sink's score
    (numerator and denominator scale alike), so it is a detached, dtype-exact shift. `gqa`:
    fewer key heads than query heads, from the module's counts (one read off the tensors' shapes
    is symbolic under a dynamic-shape compile, which SDPA's flag refuses: a graph break).
    `valid` [n] bool: which of chain[1:] count (`padded_chain`); the last, this depth's, must."""
    k0, v0 = chain[0]
    scores = _chain_scores(q, chain[1:], scale)
    if valid is not None:  # a padding entry weighs exp(-inf) = 0 in the merge
        scores = scores.masked_fill(~valid, float("-inf"))
    sink = (scores.detach().amax(-1) / scale).to(q.dtype).float() * scale
    qs, ks, vs = context_with_sink(q, k0, v0, sink, scale)
    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
    return merge_chain(o[:, :, 1:], scores, sink, chain[1:]).to(q.dtype)


def _autocast_input(x: torch.Tensor) -> torch.Tensor:
    """x in autocast's dtype where autocast is on: the cast each linear reading x would make,
    made once for all of them (q/k/v, gate/up), forward and backward."""
    dev = x.device.type
    return x.to(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else x


def _mlp(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return mlp(_autocast_input(x))


def _attention(
    attn: torch.nn.Module,
    head: EagleHead,
    x: torch.Tensor,
    positions: torch.Tensor,
    past: list[KV],
    impl: str = "dense",
    chain_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, KV]:
    """x [B, T, in] -> [B, T, h]; `past` = keys/values of depths 0..s-1 (empty at depth 0).
    `impl` (TTT_ATTENTION) picks how depths >= 1 compute the same attention; "merge" also
    takes a `padded_chain` past with its `chain_valid`."""
    bsz, t, _ = x.shape
    nh, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    x = _autocast_input(x)
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
    elif impl == "merge":
        o = _merged_chain(q, [*past, (k, v)], scale, nh != nkv, chain_valid)
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
    past: list[list[KV]],
    attention: str = "dense",
    chain_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[KV]]:
    """One depth over [B, T] rows, the math of `EagleHead.forward`. `past[i]`: layer i's
    keys/values of the depths before (an empty list, or no lists at all, at depth 0). Returns
    (pre-lm_head hidden [B, T, h] (normed for EAGLE3, raw for EAGLE), next features [B, T, h],
    this depth's k/v of each layer). `chain_valid`: with "merge" attention, the mask of a
    `padded_chain` past (the same for every layer)."""
    emb = head.target.model.embed_tokens(input_ids)  # frozen, no grad
    layer_past = past or [[] for _ in range(head.config.num_hidden_layers)]
    if head.algorithm == "EAGLE":
        layer = head.layers[0]
        x = head.fc(torch.cat((emb, features.to(emb.dtype)), dim=-1))
        a, kv = _attention(layer.self_attn, head, x, positions, layer_past[0], attention,
                           chain_valid)  # fmt: skip
        x = x + a
        out = x + _mlp(layer.mlp, layer.post_attention_layernorm(x))
        return out, out, [kv]
    feats = features.to(emb.dtype)
    g = head.fc(feats) if feats.shape[-1] != head.hidden_size else feats
    m = head.midlayer
    attn_in = torch.cat((m.input_layernorm(emb), m.hidden_norm(g)), dim=-1)
    a, kv = _attention(m.self_attn, head, attn_in, positions, layer_past[0], attention, chain_valid)
    x = g + a
    out = x + _mlp(m.mlp, m.post_attention_layernorm(x))
    kvs = [kv]
    for upper, seen in zip(head.upper_layers, layer_past[1:], strict=True):
        a, kv = _attention(upper.self_attn, head, upper.input_layernorm(out), positions, seen,
                           attention, chain_valid)  # fmt: skip
        x = out + a
        out = x + _mlp(upper.mlp, upper.post_attention_layernorm(x))
        kvs.append(kv)
    return head.norm(out), out, kvs


def padded_chain(past: list[KV], length: int) -> tuple[list[KV], torch.Tensor]:
    """One layer's `past` (depths 0..s-1, s >= 1) widened to `length` entries with zero keys and
    values, and the [length] mask of the chain entries the merge attention then sees (past[1:],
    the padding, then this depth's own, always valid). Every depth >= 1 then has one structure:
    a compiled step traces one graph for them where an unpadded past of a new length traces
    another."""
    k, v = past[-1]
    # Distinct tensors (inputs aliasing each other are a guard of their own) that require grad
    # as the keys they stand in for do (a mismatch is a guard too).
    pads = [
        (torch.zeros_like(k).requires_grad_(k.requires_grad),
         torch.zeros_like(v).requires_grad_(v.requires_grad))
        for _ in range(length - len(past))
    ]  # fmt: skip
    valid = torch.arange(length, device=k.device) < len(past) - 1
    valid[-1] = True
    return [*past, *pads], valid


def prime_rotary(head: EagleHead, device: torch.device) -> None:
    """Makes the rotary tables in the dtype a step's queries have (autocast's, else the head's)
    before a compiled step runs: made inside its first graph, they are a guard that recompiles
    that graph once they exist."""
    dev = device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    dtype = dtype or next(head.parameters()).dtype
    head.rotary_emb.at(torch.zeros(1, dtype=torch.long, device=device), dtype)


def lm_head_weight(head: EagleHead) -> torch.Tensor:
    """[draft_vocab, h]: EAGLE3's own head (trained); EAGLE reads the target's (frozen)."""
    if head.algorithm == "EAGLE3":
        return head.lm_head.weight
    return head.target.lm_head_weight.detach()

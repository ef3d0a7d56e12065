"""What an EAGLE/EAGLE3 head's forward must give: a dense plain-torch re-implementation of the
published architectures over one sequence, the head's own paged forward over the same inputs
(two extends over one KV pool), and a save -> load that changes neither."""

from __future__ import annotations

import math

import torch
from conftest import make_forward_batch
from eagle_head_formats import CPU, HEAD_THETA, NH, NKV, SPLIT, D, H, T, Tensors, V

from eagleserve.layers.attention import TorchAttnBackend
from eagleserve.layers.forward_batch import forward_context
from eagleserve.mem_cache.kv_cache import ReqToTokenPool, TokenToKVPool
from eagleserve.models.llama import LlamaForCausalLM
from eagleserve.spec.eagle_head import EagleHead
from eagleserve.spec.head_loader import load_eagle_head, save_eagle_head


def ref_rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


def ref_rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    # x [T, heads, D]
    inv = 1.0 / HEAD_THETA ** (torch.arange(0, D, 2).float() / D)
    ang = pos.float()[:, None] * inv[None, :]
    cos, sin = torch.cat((ang, ang), -1).cos()[:, None], torch.cat((ang, ang), -1).sin()[:, None]
    rot = torch.cat((-x[..., D // 2 :], x[..., : D // 2]), -1)
    return x * cos + rot * sin


def ref_layer_attn(w: Tensors, pre: str, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Dense causal GQA attention over one sequence; x [T, in]."""
    n = x.shape[0]
    q = ref_rope((x @ w[pre + "self_attn.q_proj.weight"].T).view(n, NH, D), pos)
    k = ref_rope((x @ w[pre + "self_attn.k_proj.weight"].T).view(n, NKV, D), pos)
    v = (x @ w[pre + "self_attn.v_proj.weight"].T).view(n, NKV, D)
    k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, NH * D)
    return out @ w[pre + "self_attn.o_proj.weight"].T


def ref_mlp(w: Tensors, pre: str, x: torch.Tensor) -> torch.Tensor:
    g = torch.nn.functional.silu(x @ w[pre + "mlp.gate_proj.weight"].T)
    return (g * (x @ w[pre + "mlp.up_proj.weight"].T)) @ w[pre + "mlp.down_proj.weight"].T


def ref_eagle1(w: Tensors, tgt: LlamaForCausalLM, ids: torch.Tensor, feats: torch.Tensor) -> tuple:
    pos = torch.arange(len(ids))
    x = torch.cat((tgt.model.embed_tokens.weight[ids], feats), -1) @ w["fc.weight"].T
    x = x + w["fc.bias"] if "fc.bias" in w else x
    x = x + ref_layer_attn(w, "layers.0.", x, pos)
    out = x + ref_mlp(w, "layers.0.", ref_rms(x, w["layers.0.post_attention_layernorm.weight"]))
    return out @ tgt.lm_head_weight.T, out


def ref_eagle3(w: Tensors, tgt: LlamaForCausalLM, ids: torch.Tensor, feats: list) -> tuple:
    """feats: per-row 3h target features or h-wide fed-back features."""
    pos = torch.arange(len(ids))
    g = torch.cat([f @ w["fc.weight"].T if f.shape[-1] == 3 * H else f for f in feats])
    emb = ref_rms(tgt.model.embed_tokens.weight[ids], w["midlayer.input_layernorm.weight"])
    x_in = torch.cat((emb, ref_rms(g, w["midlayer.hidden_norm.weight"])), -1)
    x = g + ref_layer_attn(w, "midlayer.", x_in, pos)
    out = x + ref_mlp(w, "midlayer.", ref_rms(x, w["midlayer.post_attention_layernorm.weight"]))
    i = 1
    while f"layers.{i}.input_layernorm.weight" in w:  # vLLM's further layers: plain Llama ones
        pre = f"layers.{i}."
        x = out + ref_layer_attn(w, pre, ref_rms(out, w[pre + "input_layernorm.weight"]), pos)
        out = x + ref_mlp(w, pre, ref_rms(x, w[pre + "post_attention_layernorm.weight"]))
        i += 1
    return ref_rms(out, w["norm.weight"]) @ w["lm_head.weight"].T, out


def paged_forward(head: EagleHead, ids: torch.Tensor, feats: list) -> tuple:
    """Two paged extends over one draft KV pool: [0, SPLIT) then [SPLIT, T)."""
    cfg = head.config
    pool = TokenToKVPool(32, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                         torch.float32, CPU)  # fmt: skip
    r2t = ReqToTokenPool(1, 64, CPU)
    backend = TorchAttnBackend(r2t.req_to_token, cfg.head_dim**-0.5)
    loc = pool.alloc(len(ids))
    r2t.req_to_token[0, : len(ids)] = loc
    outs = []
    for (a, b), f in zip(((0, SPLIT), (SPLIT, len(ids))), feats, strict=True):
        fb = make_forward_batch(
            mode="extend",
            input_ids=ids[a:b],
            positions=torch.arange(a, b),
            out_cache_loc=loc[a:b],
            req_pool_indices=torch.tensor([0]),
            prefix_lens=torch.tensor([a]),
            extend_lens=torch.tensor([b - a]),
            kv_pool=pool,
            attn_backend=backend,
        )
        with torch.no_grad(), forward_context(fb):
            outs.append(head(ids[a:b], f, fb.positions))
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def head_inputs(width_first: int, width_second: int) -> tuple[torch.Tensor, list]:
    """T token ids and their features in two parts ([0, SPLIT) then the rest), of these widths."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (T,), generator=gen)
    return ids, [
        torch.randn(SPLIT, width_first, generator=gen),
        torch.randn(T - SPLIT, width_second, generator=gen),
    ]


def roundtrip(head: EagleHead, tmp_path, target: LlamaForCausalLM) -> EagleHead:
    """`head` saved to `tmp_path` and loaded again: the same tensors, attributes and forward."""
    save_eagle_head(head, str(tmp_path))
    again = load_eagle_head(str(tmp_path), head.algorithm, target, CPU, torch.float32)
    a, b = head.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for attr in ("aux_layer_ids", "feature_size", "draft_vocab_size", "fc_bias", "config"):
        assert getattr(head, attr) == getattr(again, attr), attr
    width = head.feature_size
    ids, feats = head_inputs(width, H)
    for x, y in zip(paged_forward(head, ids, feats), paged_forward(again, ids, feats), strict=True):
        assert torch.equal(x, y)
    return again


def reloaded(head: EagleHead, path: str, target: LlamaForCausalLM) -> EagleHead:
    """The head saved at `path`, loaded: the same tensors as `head` and the same forward."""
    again = load_eagle_head(path, head.algorithm, target, CPU, torch.float32)
    a, b = head.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids, feats = head_inputs(head.feature_size, H)
    for x, y in zip(paged_forward(head, ids, feats), paged_forward(again, ids, feats), strict=True):
        assert torch.equal(x, y)
    return again

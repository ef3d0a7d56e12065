"""EAGLE-1/2 and EAGLE-3 draft heads over a Llama-family target, with the published tensor names.

The heads run their decoder layers (layer i on layer_id i of the draft KV pool) inside an active
`forward_context`. Parameter names equal the checkpoint names, so a state_dict is the checkpoint:
- EAGLE (1/2): `fc` [h, 2h] (+bias), `layers.0.{self_attn,mlp,post_attention_layernorm}`; the
  embedding and lm_head are the target's. Features are the target's final *normed* hidden state.
- EAGLE3: `fc` [h, k*h] fusing the hidden states entering k target layers, `midlayer.*` whose
  attention reads 2h, `norm`, a draft-vocab `lm_head`, and `d2t` (target id = draft id + d2t).
  A head of `num_hidden_layers` N > 1 adds plain Llama decoder layers `layers.1` .. `layers.N-1`
  over the midlayer's output (vLLM's names: it reads `midlayer` as `layers.0`).
Reading their config.json, loading, saving and random init live in
`eagleserve.spec.head_loader`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from eagleserve.config import ModelConfig
from eagleserve.layers.forward_batch import ForwardBatch, get_forward_batch, in_forward
from eagleserve.models.cpu_layers import CpuHeadLayer, CpuLayers
from eagleserve.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    RMSNorm,
    Rotary,
    RotaryEmbedding,
)

ALGORITHMS = ("EAGLE", "EAGLE3")


def _stacked(weights: list[torch.Tensor]) -> nn.Linear:
    """One bias-free linear whose output rows are these weights' rows, in order."""
    weight = torch.cat(weights)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device,
                       dtype=weight.dtype)  # fmt: skip
    linear.weight.data.copy_(weight)
    return linear


class Eagle1Layer(nn.Module):
    """Layer 0 of an EAGLE-1/2 head: no input_layernorm (fc output feeds attention directly)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, 0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size)


class Eagle3MidLayer(nn.Module):
    """The EAGLE3 layer: attention over cat(input_layernorm(embed), hidden_norm(g)) [2h]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.hidden_norm = RMSNorm(h, eps)
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = LlamaAttention(cfg, 0, in_size=2 * h)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = LlamaMLP(h, cfg.intermediate_size)


class EagleHead(nn.Module):
    def __init__(
        self,
        algorithm: str,
        cfg: ModelConfig,
        target: LlamaForCausalLM,
        *,
        fc_bias: bool = False,
        aux_layer_ids: tuple[int, ...] = (),
        draft_vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown draft algorithm {algorithm!r}: EAGLE or EAGLE3")
        h = cfg.hidden_size
        self.algorithm = algorithm
        self.config = cfg
        self.hidden_size = h
        self.target_vocab_size = target.config.vocab_size
        # Plain attribute, not a submodule: the target owns embed/lm_head, and they must stay
        # out of the head's state_dict and parameters.
        self.__dict__["_target"] = target
        if algorithm == "EAGLE":
            if aux_layer_ids:
                raise ValueError("EAGLE heads read the final hidden state: no aux layers")
            self.aux_layer_ids: tuple[int, ...] = ()
            self.feature_size = h
            self.draft_vocab_size = self.target_vocab_size
            self.fc_bias = fc_bias
            if cfg.num_hidden_layers != 1:
                raise ValueError(f"EAGLE heads have one layer, not {cfg.num_hidden_layers}")
            self.fc = nn.Linear(2 * h, h, bias=fc_bias)  # input: cat(embed, feature)
            self.layers: nn.Module = nn.ModuleList([Eagle1Layer(cfg)])
        else:
            if not aux_layer_ids or fc_bias:
                raise ValueError("EAGLE3 heads need aux layer ids and have no fc bias")
            self.aux_layer_ids = tuple(aux_layer_ids)
            self.feature_size = len(aux_layer_ids) * h
            self.draft_vocab_size = draft_vocab_size or self.target_vocab_size
            self.fc_bias = False
            self.fc = nn.Linear(self.feature_size, h, bias=False)
            self.midlayer = Eagle3MidLayer(cfg)
            # Keys "1".."N-1": their checkpoint names are layers.1.*, ... (none for N = 1).
            self.layers = nn.ModuleDict(
                {str(i): LlamaDecoderLayer(cfg, i) for i in range(1, cfg.num_hidden_layers)}
            )
            self.norm = RMSNorm(h, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
            # [draft_vocab] int64; zeros = identity map (full draft vocab).
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
        # An EAGLE3 head's layers after the midlayer, in order (none on a one-layer head). With
        # any, a row's K/V in layers >= 1 depend on the rows before it (layer 0's attention): a
        # K/V write runs every layer over rows the active forward batch describes.
        self.upper_layers: tuple[LlamaDecoderLayer, ...] = (
            tuple(self.layers.values()) if algorithm == "EAGLE3" else ()
        )
        self.rotary_emb = RotaryEmbedding(cfg, target.model.rotary_emb.max_positions)
        self.kv_proj: nn.Linear | None = None  # set by fuse_projections
        self.cpu_layer: CpuHeadLayer | None = None  # set by use_row_kernels
        self.fused_kernels = False  # set by use_fused_kernels (spec/fused_head.py)
        self.target_ids: torch.Tensor | None = None  # set by freeze_vocab_map

    @property
    def target(self) -> LlamaForCausalLM:
        return self._target

    @property
    def attn(self) -> LlamaAttention:
        layer = self.layers[0] if self.algorithm == "EAGLE" else self.midlayer
        return layer.self_attn

    def _features(self, features: torch.Tensor) -> torch.Tensor:
        """The rows' features, checked, in the embeddings' dtype."""
        width = features.shape[-1]
        if width not in (self.feature_size, self.hidden_size):
            raise ValueError(
                f"{self.algorithm} head got features of width {width}, expected "
                f"{self.feature_size} (target) or {self.hidden_size} (previous draft step)"
            )
        return features.to(self.target.model.embed_tokens.weight.dtype)

    def _inputs(
        self, input_ids: torch.Tensor, features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows' token embeddings, their features in the embeddings' dtype)."""
        return self.target.model.embed_tokens(input_ids), self._features(features)

    def fused_features(self, features: torch.Tensor) -> torch.Tensor:
        """EAGLE3's g [T, h]: target features (k*h) fused by fc; a later step's h-wide output
        as it is (EAGLE-1's features too). Row by row: an extend fuses its rows once and hands
        the K/V write and its last rows' forward the result."""
        if features.shape[-1] == self.hidden_size:
            return features
        return self.fc(features.to(self.target.model.embed_tokens.weight.dtype))

    def _attention_input(
        self, emb: torch.Tensor, features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the layer's attention input, its residual stream) of rows with these embeddings
        and features (`_inputs`)."""
        if self.algorithm == "EAGLE":
            x = self.fc(torch.cat((emb, features), dim=-1))  # [T, h]
            return x, x
        g = self.fused_features(features)  # [T, h]
        m = self.midlayer
        return torch.cat((m.input_layernorm(emb), m.hidden_norm(g)), dim=-1), g  # [T, 2h]

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        logit_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T] (token t[j+1]), features [T, feature_size or h] (aligned with t[j]),
        positions [T]. Returns (logits [T, draft_vocab], fp32 except on the fused kernels, which
        keep the model dtype; next_features [T, h]). `logit_rows`: of these rows only, each
        request's last of an extend (every row still writes its K/V; on the one-call CPU layer
        only the last rows run the rest of it, which leaves their results as they are)."""
        if self.fused_kernels and in_forward() and logit_rows is None:  # embeddings in a kernel
            from eagleserve.spec import fused_head  # imports triton: only where it runs

            g = self.fused_features(self._features(features))
            rotary = self.rotary_emb.at(positions, g.dtype)
            return fused_head.layer_forward(self, input_ids, g, get_forward_batch(), rotary)
        layer = self.cpu_layer if in_forward() else None
        if layer is not None and CpuLayers.applies(get_forward_batch(), features):  # one call
            fb, rotary = get_forward_batch(), self.rotary_emb.at(positions, features.dtype)
            return layer.forward(input_ids, self._features(features), fb, rotary, logit_rows)
        emb, feats = self._inputs(input_ids, features)
        # Bound once: a fused q/k/v then rotates q and k together (one kernel on a CPU).
        rotary = self.rotary_emb.at(positions, emb.dtype)
        out = self._layers(emb, feats, positions, rotary)
        if logit_rows is not None:
            out = out[logit_rows]
        return self._logits(out), out  # next_features are pre-norm

    def extends_in_one_call(self, fb: ForwardBatch) -> bool:
        """Whether an extend over `fb` runs the one-call CPU layer (`logit_rows`)."""
        embed = self.target.model.embed_tokens.weight
        return self.cpu_layer is not None and CpuLayers.applies(fb, embed)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        if self.algorithm == "EAGLE":
            # No final norm: the target's lm_head reads the layer output directly.
            return self.target.compute_logits(out)
        return self.lm_head(self.norm(out)).float()

    def _layers(
        self, emb: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor, rotary: Rotary
    ) -> torch.Tensor:
        """The last layer's output [T, h] (pre-norm) of rows with these embeddings and
        features (`_inputs`), every layer's K/V written to the active forward's pool."""
        attn_in, residual = self._attention_input(emb, feats)
        x = residual + self.attn(attn_in, positions, rotary)
        layer = self.layers[0] if self.algorithm == "EAGLE" else self.midlayer
        out = x + layer.mlp(layer.post_attention_layernorm(x))
        for upper in self.upper_layers:
            out = upper(out, positions, rotary)
        return out

    def layers_output(
        self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """`_layers` of these rows on the modules (an EAGLE3 head of several layers: neither
        the one-call CPU layer nor the fused kernels serve one)."""
        emb, feats = self._inputs(input_ids, features)
        return self._layers(emb, feats, positions, self.rotary_emb.at(positions, emb.dtype))

    def write_kv(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        out_cache_loc: torch.Tensor,
    ) -> None:
        """Writes these rows' K/V to `out_cache_loc` in the active forward's KV pool and
        nothing else. A one-layer head's K/V of a row depend on its own input alone: the K/V
        projection is all it runs. With `upper_layers`, every layer runs, and the active forward
        batch must describe these rows (an extend), as their attention reads it."""
        if self.upper_layers:
            self.layers_output(input_ids, features, positions)
            return
        if self.fused_kernels:
            from eagleserve.spec import fused_head

            g = self.fused_features(self._features(features))
            rotary = self.rotary_emb.at(positions, g.dtype)
            fused_head.write_kv(self, input_ids, g, rotary, get_forward_batch(), out_cache_loc)
            return
        attn_in, _ = self._attention_input(*self._inputs(input_ids, features))
        attn = self.attn
        t, shape = attn_in.shape[0], (attn.num_kv_heads, attn.head_dim)
        if attn.qkv_proj is None or self.kv_proj is not None:  # q is not needed here
            if self.kv_proj is not None:
                k, v = self.kv_proj(attn_in).view(t, 2, *shape).unbind(1)
            else:
                k, v = attn.k_proj(attn_in).view(t, *shape), attn.v_proj(attn_in).view(t, *shape)
            k = self.rotary_emb.at(positions, attn_in.dtype).apply(k)
        else:
            _, k, v = attn.project(attn_in, positions, self.rotary_emb.at(positions, attn_in.dtype))
        get_forward_batch().kv_pool.set_kv(attn.layer_id, out_cache_loc, k, v)

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """q/k/v as one qkv_proj and gate/up as one gate_up_proj in every layer (rows stacked,
        so each output column is computed as before): fewer, larger matmuls for a head on the
        CPU kernels; and a one-layer head's kv_proj, the K/V rows alone, for write_kv."""
        first = self.layers[0] if self.algorithm == "EAGLE" else self.midlayer
        for layer in (first, *self.upper_layers):
            attn, mlp = layer.self_attn, layer.mlp
            pairs = ((attn, "qkv_proj", ("q_proj", "k_proj", "v_proj")),
                     (mlp, "gate_up_proj", ("gate_proj", "up_proj")))  # fmt: skip
            for module, fused, names in pairs:
                parts = [getattr(module, n) for n in names]
                if getattr(module, fused) is not None or any(p.bias is not None for p in parts):
                    continue
                setattr(module, fused, _stacked([p.weight for p in parts]))
                if module is attn and layer is first and not self.upper_layers:
                    # K/V alone, for the rows that only write them (write_kv)
                    self.kv_proj = _stacked([p.weight for p in parts[1:]])
                for n in names:
                    delattr(module, n)

    def use_fused_kernels(self) -> bool:
        """An EAGLE3 head on the fused Triton kernels its target runs (spec/fused_head.py):
        projections fused, then its forwards and K/V writes there. False where they do not
        apply (an EAGLE-1 head, biased projections): the head stays on the torch ops."""
        if self.algorithm != "EAGLE3" or self.upper_layers:
            return False
        self.fuse_projections()
        m = self.midlayer
        self.fused_kernels = (m.self_attn.qkv_proj is not None and m.mlp.gate_up_proj is not None
                              and self.kv_proj is not None)  # fmt: skip
        return self.fused_kernels

    def use_row_kernels(self) -> None:
        """The one-call RMSNorm, rotary and SiLU gate of kernels/ (a head next to a packed
        target; the same bits as the modules' torch ops), and an EAGLE3 head's whole layer
        and lm_head in one call where its linears are on the blocked tiles."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, LlamaMLP)):
                module.row_kernel = True
            elif isinstance(module, LlamaAttention):  # the rotary kernel's vector width
                module.row_kernel = module.head_dim % 16 == 0
        if self.algorithm == "EAGLE3" and not self.upper_layers:
            embed = self.target.model.embed_tokens
            self.cpu_layer = CpuHeadLayer.build(self.midlayer, self.norm, self.lm_head, embed,
                                                self.fc)  # fmt: skip

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.algorithm == "EAGLE":
            return draft_ids
        if self.target_ids is not None:  # one gather where a drafting step has two
            return self.target_ids[draft_ids]
        return draft_ids + self.d2t[draft_ids]

    def freeze_vocab_map(self) -> None:
        """Serving, after loading: the target id of every draft id as one table, so a draft
        maps its ids in one gather. `d2t` must not change afterwards."""
        if self.algorithm == "EAGLE3":
            ids = torch.arange(self.draft_vocab_size, device=self.d2t.device)
            self.target_ids = ids + self.d2t[ids]

    def materialize(self, device: torch.device, dtype: torch.dtype) -> EagleHead:
        """After construction on meta: real (uninitialized) parameters in `dtype` on `device`,
        fp32 rotary caches, identity d2t."""
        self.to_empty(device=device)
        self.rotary_emb.build(device)
        for p in self.parameters():
            p.data = p.data.to(dtype)
        if self.algorithm == "EAGLE3":
            self.d2t.zero_()
        return self


def build_head(
    algorithm: str,
    cfg: ModelConfig,
    target: LlamaForCausalLM,
    device: torch.device,
    dtype: torch.dtype,
    **kwargs: Any,
) -> EagleHead:
    """An EagleHead built on meta and materialized (weights still to be filled)."""
    with torch.device("meta"):
        head = EagleHead(algorithm, cfg, target, **kwargs)
    return head.materialize(torch.device(device), dtype)

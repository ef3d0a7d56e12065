"""A packed CPU target's decoder layers in one kernel call (kernels/cpu_layers.cpp), and an
EAGLE-3 head's layer with its lm_head in another (`CpuHeadLayer`).

The kernel runs, per layer, the kernels the modules of models/llama.py call one by one (the
RMSNorm, the q4 tiles, rotary, the K/V store, paged attention, the SiLU gate, torch's residual
adds), in their order and on the same tensors, so its output is theirs bit for bit; what it
saves is the Python between them, a large share of a batch-1 forward's time. It applies
where every layer is of that kind: Q4 weights packed for the CPU kernels, q/k/v and gate/up
fused, no biases, one rank; and to forwards whose attention runs the row kernel (an fp32 pool).
Anything else keeps the module path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from eagleserve.kernels import cpu_ext
from eagleserve.layers.attention import TorchAttnBackend
from eagleserve.layers.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from eagleserve.models.llama import BoundRotary, LlamaForCausalLM


def _tiles(linear: nn.Module | None) -> tuple[list[torch.Tensor], int] | None:
    """A packed linear's Q4 tiles (w, d, m; uint8 w) and output size; None for anything else
    (Q8 tiles, or a bias, which would be left out)."""
    blocked = getattr(linear, "blocked", None)
    if linear is None or blocked is None or blocked[0].dtype != torch.uint8:
        return None
    if linear.bias is not None:
        return None
    return list(blocked), int(linear.out_features)


class CpuLayers:
    """Every layer's weights, flattened once at load in the kernel's order, and the call."""

    def __init__(self, weights: list[torch.Tensor], out_features: list[int],
                 shape: tuple[float, int, int]) -> None:  # fmt: skip
        self.weights = weights  # 14 per layer (cpu_layers.cpp)
        self.out_features = out_features  # 4 per layer
        self.shape = shape  # (rms eps, heads, kv heads)

    @staticmethod
    def build(model: LlamaForCausalLM) -> CpuLayers | None:
        weights: list[torch.Tensor] = []
        out_features: list[int] = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if not (all(n.row_kernel for n in norms) and attn.row_kernel and mlp.row_kernel):
                return None
            if attn.row_parallel or mlp.row_parallel:
                return None
            tiles = [_tiles(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                         mlp.down_proj)]  # fmt: skip
            if any(t is None for t in tiles):
                return None
            (qkv, n_qkv), (o, n_o), (gate_up, n_gu), (down, n_down) = tiles  # type: ignore[misc]
            weights += [norms[0].weight.detach(), *qkv, *o, norms[1].weight.detach(), *gate_up,
                        *down]  # fmt: skip
            out_features += [n_qkv, n_o, n_gu, n_down]
        cfg = model.config
        eps = float(model.model.layers[0].input_layernorm.eps)
        return CpuLayers(weights, out_features,
                         (eps, cfg.num_attention_heads, cfg.num_key_value_heads))  # fmt: skip

    @staticmethod
    def applies(fb: ForwardBatch, h: torch.Tensor) -> bool:
        backend = fb.attn_backend
        return (
            h.dtype == torch.float32
            and isinstance(backend, TorchAttnBackend)
            and backend.uses_row_kernel(fb)
        )

    @staticmethod
    def attention_rows(fb: ForwardBatch) -> tuple[torch.Tensor | None, ...]:
        """What the kernels plan a forward's attention rows from (as `paged_attention`)."""
        backend = fb.attn_backend
        assert isinstance(backend, TorchAttnBackend)
        return (backend.req_to_token, fb.req_pool_indices, fb.prefix_lens, fb.extend_lens,
                fb.attn_metadata, fb.tree_mask)  # fmt: skip

    def forward(
        self, h: torch.Tensor, fb: ForwardBatch, rotary: BoundRotary, aux_layers: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h [T, hidden] -> (the last layer's output, the hidden states entering aux_layers,
        side by side: [T, len(aux_layers) * hidden], None without aux layers)."""
        backend = fb.attn_backend
        assert isinstance(backend, TorchAttnBackend)
        pool = fb.kv_pool
        return cpu_ext.decoder_layers(
            h,
            self.weights,
            self.out_features,
            self.shape,
            (rotary.cos, rotary.signed_sin),
            (pool.k_buffer, pool.v_buffer, fb.out_cache_loc),
            self.attention_rows(fb),  # type: ignore[arg-type]
            backend.sm_scale,
            aux_layers,
        )


class CpuHeadLayer:
    """An EAGLE-3 head's layer and lm_head on Q4 tiles in one kernel call (cpu_layers.cpp,
    `eagle3_layer`), the token embeddings and, for the target's features, the fc included: the
    modules' kernels in their order, so the bits are theirs. Built where every linear is Q4-tiled
    without bias and the norms, rotary and SiLU gate run the row kernels (a head beside a packed
    target, spec/eagle_head.py's use_row_kernels)."""

    def __init__(self, inputs: tuple[torch.Tensor, list[torch.Tensor]],
                 weights: list[torch.Tensor], out_features: list[int],
                 shape: tuple[float, int, int], layer_id: int) -> None:  # fmt: skip
        self.inputs = inputs  # the embedding table, the fc tiles
        self.weights, self.out_features, self.shape = weights, out_features, shape
        self.layer_id = layer_id  # its K/V's layer in the head's pool

    @staticmethod
    def build(
        layer: nn.Module, norm: nn.Module, lm_head: nn.Module, embed: nn.Module, fc: nn.Module
    ) -> CpuHeadLayer | None:
        """From an Eagle3MidLayer (input_layernorm, hidden_norm, self_attn, post-attention
        norm, mlp), the head's final norm, its lm_head, the target's embedding and the head's
        fc; None where the kernel cannot run them."""
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, norm)
        if not (all(n.row_kernel for n in norms) and attn.row_kernel and mlp.row_kernel):
            return None
        tiles = [_tiles(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                     mlp.down_proj, lm_head, fc)]  # fmt: skip
        table = embed.weight.detach()
        if any(t is None for t in tiles) or len({float(n.eps) for n in norms}) != 1:
            return None
        if table.dtype != torch.float32:
            return None
        (qkv, n_qkv), (o, n_o), (gate_up, n_gu), (down, n_down), (head, n_vocab), (f, _) = tiles  # type: ignore[misc]
        w = [n.weight.detach() for n in norms]
        weights = [w[0], w[1], *qkv, *o, w[2], *gate_up, *down, w[3], *head]
        shape = (float(norms[0].eps), attn.num_heads, attn.num_kv_heads)
        return CpuHeadLayer((table, f), weights, [n_qkv, n_o, n_gu, n_down, n_vocab], shape,
                            attn.layer_id)  # fmt: skip

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        fb: ForwardBatch,
        rotary: BoundRotary,
        last_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [T, draft vocab] fp32, the layer's output [T, hidden]) of the rows of these
        tokens and the features they continue from (the target's or a draft step's); with
        `last_rows` (each request's last row of the extend `fb`), of those rows, every row's
        K/V written."""
        backend = fb.attn_backend
        assert isinstance(backend, TorchAttnBackend)
        pool = fb.kv_pool
        return cpu_ext.eagle3_layer(
            input_ids, features, self.inputs, self.weights, self.out_features, self.shape,
            (rotary.cos, rotary.signed_sin),
            (pool.k_buffer[self.layer_id], pool.v_buffer[self.layer_id], fb.out_cache_loc),
            CpuLayers.attention_rows(fb), backend.sm_scale, last_rows,
        )  # fmt: skip

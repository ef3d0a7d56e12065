"""A training/feature attention backend: causal SDPA over the forward's own k/v, no KV pool.

It implements the `AttentionBackend` interface, so the target's own `LlamaForCausalLM` modules
run unchanged over whole sequences (and stay differentiable). Invariant: the forward holds
complete sequences from position 0 (no prefix cache); several sequences may be concatenated,
`fb.extend_lens` giving their lengths, and attention never crosses a sequence boundary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagleserve.layers.forward_batch import ForwardBatch, HostLens, forward_context
from eagleserve.models.llama import LlamaForCausalLM


class DenseCausalBackend:
    def __init__(self, sm_scale: float, padded_rows: int = 0) -> None:
        self.sm_scale = sm_scale
        # > 0: the forward holds equal-length padded sequences of this many rows each, padding
        # at the end (causal attention keeps it from reaching any real row): batched SDPA.
        self.padded_rows = padded_rows

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if self.padded_rows:
            fb.attn_metadata = None
            return
        lens = fb.extend_lens.tolist()
        if len(lens) == 1:
            fb.attn_metadata = None  # plain causal
            return
        seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        t = seg.numel()
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        fb.attn_metadata = (causal & (seg[:, None] == seg[None, :])).to(fb.input_ids.device)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor:
        # q [T, H, D]; k, v [T, Hkv, D] -> [T, H, D]. Inputs are 4-D [1, H, T, D]: on CPU only
        # 4-D inputs reach the fused flash kernel (3-D ones take the O(T^2)-memory math path).
        if self.padded_rows:
            n = self.padded_rows
            o = F.scaled_dot_product_attention(
                *(z.reshape(-1, n, *z.shape[1:]).transpose(1, 2) for z in (q, k, v)),
                is_causal=True,
                scale=self.sm_scale,
                enable_gqa=q.shape[1] != k.shape[1],
            )  # [B, H, n, D]
            return o.transpose(1, 2).reshape(q.shape)
        mask = fb.attn_metadata
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.sm_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return o[0].transpose(0, 1)


def dense_forward_batch(ids: list[torch.Tensor], backend: DenseCausalBackend) -> ForwardBatch:
    """A ForwardBatch over whole sequences `ids` (concatenated), positions from 0."""
    lens = torch.tensor([len(x) for x in ids])
    return ForwardBatch(
        mode="extend",
        input_ids=torch.cat(ids),
        positions=torch.cat([torch.arange(len(x)) for x in ids]),
        out_cache_loc=torch.empty(0, dtype=torch.long),
        req_pool_indices=torch.arange(len(ids)),
        prefix_lens=torch.zeros_like(lens),
        extend_lens=lens,
        host=HostLens.of(lens.tolist(), lens.tolist()),
        kv_pool=None,  # type: ignore[arg-type]  # never touched by this backend
        attn_backend=backend,
    )


def padded_forward_batch(ids: torch.Tensor, backend: DenseCausalBackend) -> ForwardBatch:
    """A ForwardBatch over `ids` [B, n] (equal-length rows, padded at the end), on ids' device."""
    bsz, n = ids.shape
    lens = torch.full((bsz,), n, device=ids.device)
    return ForwardBatch(
        mode="extend",
        input_ids=ids.reshape(-1),
        positions=torch.arange(n, device=ids.device).repeat(bsz),
        out_cache_loc=torch.empty(0, dtype=torch.long, device=ids.device),
        req_pool_indices=torch.arange(bsz, device=ids.device),
        prefix_lens=torch.zeros_like(lens),
        extend_lens=lens,
        host=HostLens.of([n] * bsz, [n] * bsz),
        kv_pool=None,  # type: ignore[arg-type]  # never touched by this backend
        attn_backend=backend,
    )


@torch.inference_mode()
def padded_features_and_final(
    model: LlamaForCausalLM, ids: torch.Tensor, layer_ids: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`features_and_final` of the rows of `ids` [B, n] in one batched forward: ([B*n, W],
    [B*n, h]); row b*n + t is position t of sequence b."""
    backend = DenseCausalBackend(model.config.head_dim**-0.5, padded_rows=ids.shape[1])
    fb = padded_forward_batch(ids, backend)
    return _forward_layers(model, fb, layer_ids, model.config.num_hidden_layers)


@torch.inference_mode()
def hidden_states_entering(
    model: LlamaForCausalLM, ids: list[torch.Tensor], layer_ids: tuple[int, ...]
) -> torch.Tensor:
    """[T, len(layer_ids) * h]: the residual entering each layer in `layer_ids`, concatenated;
    layer id == num_layers means the final *normed* state (what EAGLE-1 reads). Stops after the
    deepest layer needed, and never computes logits."""
    return _run_layers(model, ids, layer_ids, max(layer_ids))[0]


@torch.inference_mode()
def features_and_final(
    model: LlamaForCausalLM, ids: list[torch.Tensor], layer_ids: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(features as `hidden_states_entering`, final normed hidden [T, h]) of one full forward:
    the features are computed by exactly the same ops as `hidden_states_entering`'s."""
    n = model.config.num_hidden_layers
    out, final = _run_layers(model, ids, layer_ids, n)
    return out, final


def _run_layers(
    model: LlamaForCausalLM, ids: list[torch.Tensor], layer_ids: tuple[int, ...], stop: int
) -> tuple[torch.Tensor, torch.Tensor]:
    backend = DenseCausalBackend(model.config.head_dim**-0.5)
    return _forward_layers(model, dense_forward_batch(ids, backend), layer_ids, stop)


def _forward_layers(
    model: LlamaForCausalLM, fb: ForwardBatch, layer_ids: tuple[int, ...], stop: int
) -> tuple[torch.Tensor, torch.Tensor]:
    n_layers = model.config.num_hidden_layers
    out: dict[int, torch.Tensor] = {}
    with forward_context(fb):
        h = model.model.embed_tokens(fb.input_ids)
        for i in range(stop):
            if i in layer_ids:
                out[i] = h
            h = model.model.layers[i](h, fb.positions, model.model.rotary_emb)
        if stop == n_layers:
            h = model.model.norm(h)
        out[stop] = h
    return torch.cat([out[i] for i in sorted(layer_ids)], dim=-1), h

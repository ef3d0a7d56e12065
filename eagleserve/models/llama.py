"""Llama-family decoder in plain PyTorch, with Hugging Face parameter names.

Covers Llama 2/3 (incl. Llama-3 rope scaling), SmolLM2, Mistral and Qwen2 (q/k/v bias). Per-forward
metadata comes from `get_forward_batch()`; the K/V of new tokens go to the paged pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from eagleserve.config import ModelConfig
from eagleserve.distributed.parallel import all_reduce
from eagleserve.kernels import cpu_ext
from eagleserve.layers.forward_batch import get_forward_batch, in_forward

if TYPE_CHECKING:
    from eagleserve.models.cpu_layers import CpuLayers


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.row_kernel = False  # kernels/cpu_norm.cpp: set for a packed CPU target (quant.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_kernel and x.dtype == torch.float32 and in_forward():
            # One call instead of the composite's five ops, and each row normed by the same
            # ops whatever the batch (a prefill row as its decode would be).
            return cpu_ext.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op, bit-identical to the lines below for fp32 (checked in tests).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 and cast back before the weight, as transformers does.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin cache for every position, computed in fp32 like transformers."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_positions = max_positions
        self.build(torch.device("cpu") if torch.get_default_device().type == "meta" else None)

    def build(self, device: torch.device | None) -> None:
        """(Re)computes the caches on `device`; needed after materializing from meta tensors."""
        cfg, dim = self.cfg, self.cfg.head_dim
        exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
        inv_freq = 1.0 / (cfg.rope_theta**exponent)
        if cfg.rope_scaling_dict:
            inv_freq = _llama3_inv_freq(inv_freq, cfg.rope_scaling_dict)
        t = torch.arange(self.max_positions, dtype=torch.int64, device=device).float()
        freqs = t[:, None] * inv_freq[None, :]  # [max_pos, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        # rotate_half(x) * sin == roll(x, dim/2) * signed_sin, bit for bit (negation is exact).
        sign = torch.cat((-torch.ones_like(freqs[0]), torch.ones_like(freqs[0])))
        # [max_pos, 1, D]: a lookup is [T, 1, D], the heads' broadcast shape, in one op.
        self.register_buffer("cos_cache", emb.cos()[:, None, :], persistent=False)
        self.register_buffer("signed_sin_cache", (emb.sin() * sign)[:, None, :], persistent=False)
        # The caches rounded to a model dtype (on their device), made at its first lookup, which
        # a graph's warm-up runs before its capture: a lookup is then two gathers, not two
        # gathers and two casts (the same values: rounding commutes with a gather).
        self.rounded: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, ...]] = {}

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> BoundRotary:
        """The rotation of these positions, bound once per forward for every layer."""
        cos, sin = self.cos_cache, self.signed_sin_cache
        if dtype != cos.dtype:
            key = (dtype, cos.device)
            if key not in self.rounded:
                self.rounded[key] = (cos.to(dtype), sin.to(dtype))
            cos, sin = self.rounded[key]
        return BoundRotary(cos, sin, positions)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.at(positions, q.dtype)(positions, q, k)


class BoundRotary:
    """One forward's rotation: the cos / signed-sin tables [P, 1, D] in the model dtype and
    the positions [T]; called like RotaryEmbedding. `cos` / `signed_sin` [T, 1, D] are gathered
    at their first use, once for every layer: the fused kernels read the tables at the
    positions themselves, so a forward on them gathers nothing."""

    def __init__(
        self, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor
    ) -> None:
        self.cos_table, self.sin_table, self.positions = cos_table, sin_table, positions
        # Plain attributes, not functools.cached_property: on Python 3.11 that takes an RLock,
        # which torch.compile cannot trace (a graph break at every rotary of a compiled step).
        self._cos: torch.Tensor | None = None
        self._signed_sin: torch.Tensor | None = None

    @property
    def cos(self) -> torch.Tensor:
        if self._cos is None:
            self._cos = self.cos_table[self.positions]
        return self._cos

    @property
    def signed_sin(self) -> torch.Tensor:
        if self._signed_sin is None:
            self._signed_sin = self.sin_table[self.positions]
        return self._signed_sin

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, heads, D]: x*cos + rotate_half(x)*sin, as transformers computes it.
        return x * self.cos + x.roll(x.shape[-1] // 2, dims=-1) * self.signed_sin

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert positions.shape[0] == self.positions.shape[0], "bound to other positions"
        return self.apply(q), self.apply(k)


Rotary = RotaryEmbedding | BoundRotary


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, in_size: int | None = None) -> None:
        super().__init__()
        in_size = in_size or cfg.hidden_size
        self.layer_id = layer_id
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(in_size, cfg.q_size, bias=bias)
        self.k_proj = nn.Linear(in_size, cfg.kv_size, bias=bias)
        self.v_proj = nn.Linear(in_size, cfg.kv_size, bias=bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        # Set by models/quant.py when packed GGUF weights fuse q/k/v into one matmul.
        self.qkv_proj: nn.Module | None = None
        self.qkv_sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
        # Set by models/tp_shard.py on a tensor-parallel target: this rank holds some heads, and
        # o_proj's output is its share of the sum over ranks (a replicated draft head's is not).
        self.row_parallel = False
        # kernels/cpu_pointwise.cpp's rotary (set as RMSNorm's, for head_dim % 16 == 0)
        self.row_kernel = False

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        fb = get_forward_batch()
        q, k, v = self.project(x, positions, rotary)
        out = fb.attn_backend.forward(q, k, v, self.layer_id, fb)  # [T, H, D]
        out = self.o_proj(out.reshape(x.shape[0], -1))
        return all_reduce(out) if self.row_parallel else out

    def project(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, Hkv, D], q and k rotated."""
        t, nh, nkv = x.shape[0], self.num_heads, self.num_kv_heads
        if self.qkv_proj is not None and isinstance(rotary, BoundRotary):
            # q and k heads are adjacent in the fused output: one rotation for both.
            qkv = self.qkv_proj(x).view(t, nh + 2 * nkv, self.head_dim)
            if self.row_kernel and qkv.dtype == torch.float32 and in_forward():
                cpu_ext.rope_(qkv, rotary.cos, rotary.signed_sin, nh + nkv)  # same bits
                return qkv[:, :nh], qkv[:, nh : nh + nkv], qkv[:, nh + nkv :]
            qk = rotary.apply(qkv[:, : nh + nkv])
            q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :]
        else:
            if self.qkv_proj is not None:
                q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q = q.view(t, nh, self.head_dim)
            k = k.view(t, nkv, self.head_dim)
            v = v.view(t, nkv, self.head_dim)
            q, k = rotary(positions, q, k)
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.gate_up_proj: nn.Module | None = None  # fused gate/up (models/quant.py)
        self.row_parallel = False  # as LlamaAttention's
        self.row_kernel = False  # kernels/cpu_pointwise.cpp's silu_mul (set as RMSNorm's)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            act = F.silu(self.gate_proj(x)) * self.up_proj(x)
        else:
            gate_up = self.gate_up_proj(x)
            if self.row_kernel and gate_up.dtype == torch.float32 and in_forward():
                act = cpu_ext.silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
        out = self.down_proj(act)
        return all_reduce(out) if self.row_parallel else out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, rotary)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        # Built on the meta device (ModelRunner) the table gets no random init: torch runs it
        # through a Python reference whose first call imports torch._dynamo (seconds on a
        # CPU), for values the loader overwrites. Elsewhere it is initialized as usual.
        meta = torch.empty(0).is_meta
        shape = (cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape) if meta else None)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg, max_positions)


@dataclass
class ModelOutput:
    # [n, vocab] in the model dtype, rows = logits_indices (all rows when None). Whatever
    # computes on them upcasts first (sampling, penalties, logprobs); an argmax needs not.
    logits: torch.Tensor
    hidden_states: torch.Tensor  # [T, hidden] final normed hidden state of every token
    aux_hidden_states: torch.Tensor | None  # [T, k * hidden] residual entering aux layers
    # Views of a CUDA graph's output buffers, which its next replay overwrites.
    graph_buffers: bool = False
    # What the replayed graph's epilogue computed after the forward (ModelRunner.capture_graphs).
    epilogue: tuple[torch.Tensor, ...] = ()


GEMV_MAX_HIDDEN = 2048


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, cfg: ModelConfig, max_positions: int, aux_layer_ids: tuple[int, ...] = ()
    ) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Hidden states *entering* these layers are returned (EAGLE-3 fuses three of them).
        self.aux_layer_ids = aux_layer_ids
        # Every layer in one kernel call, where models/quant.py packed them all for it.
        self.cpu_layers: CpuLayers | None = None
        # --enable-deterministic-inference (models/batch_invariant.py): the logits GEMM too.
        self.batch_invariant = False
        # The layers on the fused Triton kernels (fused_forward.py; set by ModelRunner on a GPU
        # with merged q/k/v and gate/up).
        self.fused_kernels = False
        # With them, a small model takes the GEMV kernels (fused_forward.py) in the
        # batch-invariant mode, at every size (fused_forward.use_gemv): their tiles and K order
        # do not depend on the rows. A large one runs the batch-invariant GEMM there instead.
        self.gemv_capable = cfg.hidden_size <= GEMV_MAX_HIDDEN
        # Outside that mode, forwards of at most this many rows take them, at any model size:
        # set with the fused kernels from the device's tuned table (kernels/gemv_config.py),
        # 0 without one.
        self.fused_gemv_max_rows = 0

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:  # needs triton, which a CPU-only install may lack
            from eagleserve.kernels.batch_invariant import matmul

            return matmul(hidden, self.lm_head_weight)
        return F.linear(hidden, self.lm_head_weight)

    def forward(self) -> ModelOutput:
        fb = get_forward_batch()
        positions = fb.positions
        h = self.model.embed_tokens(fb.input_ids)
        rotary = self.model.rotary_emb.at(positions, h.dtype)
        if self.cpu_layers is not None and self.cpu_layers.applies(fb, h):
            assert isinstance(rotary, BoundRotary)
            layers = range(len(self.model.layers))  # the aux states the loop below would keep
            aux_ids = [i for i in layers if i in self.aux_layer_ids]
            h, aux_states = self.cpu_layers.forward(h, fb, rotary, aux_ids)
            h = self.model.norm(h)
        elif self.fused_kernels:
            from eagleserve.models.fused_forward import fused_layers

            assert isinstance(rotary, BoundRotary)
            h, aux_states = fused_layers(self, h, fb, rotary, self.aux_layer_ids)  # normed
        else:
            aux: list[torch.Tensor] = []
            for i, layer in enumerate(self.model.layers):
                if i in self.aux_layer_ids:
                    aux.append(h)
                h = layer(h, positions, rotary)
            aux_states = torch.cat(aux, dim=-1) if aux else None
            h = self.model.norm(h)
        rows = h if fb.logits_indices is None else h[fb.logits_indices]
        return ModelOutput(
            logits=self.compute_logits(rows),
            hidden_states=h,
            aux_hidden_states=aux_states,
        )

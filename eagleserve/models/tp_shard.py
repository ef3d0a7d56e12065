"""Which slice of the target one tensor-parallel rank holds, and the model surgery that makes a
LlamaForCausalLM hold only it (Megatron-style, as SGLang and vLLM split Llama).

- q/k/v and gate/up are column-parallel (rank r holds some output rows); o_proj and down_proj
  are row-parallel (the matching input columns), their partial sums all-reduced in llama.py.
- Attention is split by KV head, each rank taking the query heads of its KV heads, so a rank
  attends with its own heads only. KV heads are split as evenly as they go (SmolLM2's 3 over 2
  ranks: 2 and 1, with 6 and 3 query heads); with more ranks than KV heads the count must be a
  multiple of them, and each KV head is replicated on its ranks, which split its query heads.
- The vocabulary is split in equal ranges (the last padded with zero rows): the embedding looks
  up its own range and all-reduces (VocabParallelEmbedding); the lm_head gives each rank its
  range of logits, gathered into the whole row before sampling.
- Packed GGUF weights are split on 32-weight block boundaries (`slice_quant`), so a rank packs
  exactly its blocks: input-dim splits (o_proj, down_proj) must fall on multiples of 32.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eagleserve.config import ModelConfig
from eagleserve.distributed.parallel import all_gather_last_dim, all_reduce
from eagleserve.models.gguf_weights import BLOCK, QuantTensor
from eagleserve.models.llama import LlamaForCausalLM


def even_split(n: int, parts: int, i: int) -> range:
    """Part `i` of `parts` near-equal consecutive ranges of range(n) (the first ones longer)."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return range(start, start + base + (1 if i < extra else 0))


def _scaled(r: range, k: int) -> range:
    return range(r.start * k, r.stop * k)


@dataclass(frozen=True)
class TpShard:
    """Rank `rank` of `size`: its query heads, KV heads, MLP columns and vocabulary rows."""

    rank: int
    size: int
    q_heads: range
    kv_heads: range
    inter: range  # rows of gate/up = columns of down_proj
    vocab: range  # embedding / lm_head rows, may run past vocab_size (zero padding)
    head_dim: int
    vocab_size: int

    @classmethod
    def plan(cls, cfg: ModelConfig, rank: int, size: int, packed: bool) -> TpShard:
        """The split, or ValueError with the one line that says why `size` cannot split it."""
        nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        group = nh // nkv
        flag = f"--tp-size {size}"
        if size > nkv:
            if size % nkv:
                raise ValueError(
                    f"{flag} does not fit the model's {nkv} KV heads: with more ranks than KV "
                    f"heads the rank count must be a multiple of {nkv}"
                )
            copies = size // nkv
            if copies > group:
                raise ValueError(f"{flag} is more ranks than the model's {nh} attention heads")
            kv = rank // copies
            sub = even_split(group, copies, rank % copies)
            kv_heads = range(kv, kv + 1)
            q_heads = range(kv * group + sub.start, kv * group + sub.stop)
        else:
            kv_heads = even_split(nkv, size, rank)
            q_heads = _scaled(kv_heads, group)
        unit = BLOCK if packed else 1
        if cfg.intermediate_size % unit or cfg.intermediate_size // unit < size:
            raise ValueError(
                f"{flag}: the MLP width {cfg.intermediate_size} does not split into {size} "
                f"parts{' of whole 32-weight blocks' if packed else ''}"
            )
        if packed and (q_heads.start * cfg.head_dim) % BLOCK:
            raise ValueError(
                f"{flag}: packed weights split o_proj at 32-weight blocks, and head_dim "
                f"{cfg.head_dim} puts rank {rank}'s heads off a block boundary "
                "(--dtype float32 runs unpacked)"
            )
        per = -(-cfg.vocab_size // size)
        return cls(
            rank,
            size,
            q_heads,
            kv_heads,
            _scaled(even_split(cfg.intermediate_size // unit, size, rank), unit),
            range(rank * per, (rank + 1) * per),
            cfg.head_dim,
            cfg.vocab_size,
        )

    # ---- which slice of a checkpoint tensor --------------------------------------------------
    def _rows_and_cols(self, module: str) -> tuple[range | None, range | None]:
        """The (rows, cols) this rank keeps of the weight of the module called `module`."""
        last = module.rsplit(".", 1)[-1]
        if last == "q_proj":
            return _scaled(self.q_heads, self.head_dim), None
        if last in ("k_proj", "v_proj"):
            return _scaled(self.kv_heads, self.head_dim), None
        if last == "o_proj":
            return None, _scaled(self.q_heads, self.head_dim)
        if last in ("gate_proj", "up_proj"):
            return self.inter, None
        if last == "down_proj":
            return None, self.inter
        if module in ("model.embed_tokens", "lm_head"):
            return self.vocab, None
        return None, None

    def slice_tensor(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (weights and biases; others whole)."""
        module, _, kind = name.rpartition(".")
        rows, cols = self._rows_and_cols(module)
        if rows is not None:
            t = _pad_rows(t, rows.stop)[rows.start : rows.stop]
        if cols is not None and kind == "weight":
            t = t[:, cols.start : cols.stop]
        return t.contiguous()

    def slice_quant(self, module: str, t: QuantTensor) -> QuantTensor:
        """This rank's blocks of a packed GGUF weight (whole blocks: see `plan`)."""
        rows, cols = self._rows_and_cols(module)
        q, d, m = t.q, t.d, t.m
        if rows is not None:
            q, d = _pad_rows(q, rows.stop), _pad_rows(d, rows.stop)
            m = None if m is None else _pad_rows(m, rows.stop)
            q, d = q[rows.start : rows.stop], d[rows.start : rows.stop]
            m = None if m is None else m[rows.start : rows.stop]
        if cols is not None:
            assert cols.start % BLOCK == 0 and cols.stop % BLOCK == 0, "split inside a block"
            blocks = slice(cols.start // BLOCK, cols.stop // BLOCK)
            q, d = q[:, cols.start : cols.stop], d[:, blocks]
            m = None if m is None else m[:, blocks]
        m = None if m is None else m.contiguous()
        return QuantTensor(t.qtype, q.contiguous(), d.contiguous(), m)

    # ---- model surgery -----------------------------------------------------------------------
    def shard_meta(self, model: LlamaForCausalLM) -> None:
        """Replaces, on the meta device before weights load, every split module by one of this
        rank's shape (same names, so the checkpoint loads through `slice_tensor`)."""
        cfg = model.config
        h = cfg.hidden_size
        bias = cfg.attention_bias
        nq, nkv, dim = len(self.q_heads), len(self.kv_heads), self.head_dim
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.q_proj = nn.Linear(h, nq * dim, bias=bias)
            attn.k_proj = nn.Linear(h, nkv * dim, bias=bias)
            attn.v_proj = nn.Linear(h, nkv * dim, bias=bias)
            attn.o_proj = nn.Linear(nq * dim, h, bias=False)
            attn.num_heads, attn.num_kv_heads = nq, nkv
            attn.qkv_sizes = [nq * dim, nkv * dim, nkv * dim]
            attn.row_parallel = mlp.row_parallel = True
            mlp.gate_proj = nn.Linear(h, len(self.inter), bias=False)
            mlp.up_proj = nn.Linear(h, len(self.inter), bias=False)
            mlp.down_proj = nn.Linear(len(self.inter), h, bias=False)
        model.model.embed_tokens = VocabParallelEmbedding(self.vocab, h)
        if not cfg.tie_word_embeddings:
            model.lm_head = nn.Linear(h, len(self.vocab), bias=False)

    def gather_logits(self, model: LlamaForCausalLM) -> None:
        """After weights are final (packed or not): `compute_logits` returns whole rows."""
        local = model.compute_logits
        vocab = self.vocab_size

        def compute_logits(self_: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
            return all_gather_last_dim(local(hidden))[..., :vocab]

        model.compute_logits = types.MethodType(compute_logits, model)  # type: ignore[method-assign]


def _pad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    return t if t.shape[0] >= n else F.pad(t, (*([0, 0] * (t.dim() - 1)), 0, n - t.shape[0]))


class VocabParallelEmbedding(nn.Embedding):
    """Rows `vocab` of the embedding table: ids of other ranks look up zeros, and the all-reduce
    adds the one rank's row (exact: the other terms are 0)."""

    def __init__(self, vocab: range, hidden: int) -> None:
        super().__init__(len(vocab), hidden)
        self.vocab_start = vocab.start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside[..., None], 0.0))

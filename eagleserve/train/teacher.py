"""Teacher-forced targets: one dense forward of the frozen target over a whole sequence gives,
per position, the EAGLE features and the target's top-k next-token distribution.

Invariant: row t of every output belongs to position t (the features of the prefix x[:t+1],
the distribution of x[t+1]). Probabilities are the full-vocabulary softmax's top k (not
renormalized here; the loss renormalizes over the support the draft vocabulary keeps).
"""

from __future__ import annotations

import torch

from eagleserve.models.llama import LlamaForCausalLM
from eagleserve.train.dense_backend import features_and_final

LOGIT_ROWS = 512  # rows per lm_head chunk: bounds the [rows, vocab] fp32 logits buffer


@torch.inference_mode()
def top_k_distribution(
    model: LlamaForCausalLM, final: torch.Tensor, k: int, chunk_rows: int = LOGIT_ROWS
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int32 [T, k], probs fp16 [T, k]) of softmax(lm_head(final)), highest first."""
    ids, probs = [], []
    for rows in final.split(chunk_rows):
        logits = model.compute_logits(rows)  # fp32 [r, vocab]
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        val, idx = logits.topk(k, dim=-1)
        ids.append(idx.to(torch.int32))
        probs.append((val - lse).exp().to(torch.float16))
    return torch.cat(ids), torch.cat(probs)


@torch.inference_mode()
def teacher_targets(
    model: LlamaForCausalLM,
    ids: list[int],
    layer_ids: tuple[int, ...],
    k: int,
    need: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(features bf16 [T, W], top-k ids int32 [T, k], top-k probs fp16 [T, k]) of `ids`.

    The distribution is computed only on rows where `need` (bool [T]) is set (the lm_head is a
    large share of the forward); other rows hold id -1, probability 0. One sequence per
    forward: plain causal attention takes the fused CPU kernel, a packed block-diagonal mask
    does not."""
    feats, final = features_and_final(model, [torch.tensor(ids)], layer_ids)
    t = final.shape[0]
    need = torch.ones(t, dtype=torch.bool) if need is None else need
    top_ids = torch.full((t, k), -1, dtype=torch.int32)
    top_p = torch.zeros(t, k, dtype=torch.float16)
    if need.any():
        top_ids[need], top_p[need] = top_k_distribution(model, final[need], k)
    return feats.to(torch.bfloat16), top_ids, top_p

"""Target features for training sequences and the EAGLE3 draft vocabulary.

Features are computed once (target frozen) with the dense backend, stored in bf16 in memory:
EAGLE reads the final normed hidden state, EAGLE3 the residuals entering its three aux layers.
Labels are the next tokens of the sequences: the answers are the target's own greedy tokens, so
on answer positions label == target argmax, the token a greedy verify accepts.
"""

from __future__ import annotations

from collections import Counter

import torch
from tqdm import tqdm

from eagleserve.models.llama import LlamaForCausalLM
from eagleserve.train.dense_backend import hidden_states_entering

IGNORE = -100


def feature_layers(
    algorithm: str, aux_layer_ids: tuple[int, ...], n_layers: int
) -> tuple[int, ...]:
    """Entering-layer ids to read; n_layers stands for the final normed state."""
    return (n_layers,) if algorithm == "EAGLE" else tuple(aux_layer_ids)


def target_features(
    model: LlamaForCausalLM,
    seqs: list[list[int]],
    layer_ids: tuple[int, ...],
    max_len: int,
    tokens_per_forward: int = 1,
) -> list[torch.Tensor]:
    """Per sequence [min(len, max_len), len(layer_ids) * h] bf16, in order. Sequences may be
    packed into forwards of about `tokens_per_forward` tokens (block-diagonal causal attention);
    the default, one per forward, is fastest on CPU (masked SDPA takes its slow math path)."""
    feats: list[torch.Tensor] = []
    group: list[torch.Tensor] = []
    bar = tqdm(total=len(seqs), desc="Target features", unit="seq")

    def flush() -> None:
        out = hidden_states_entering(model, group, layer_ids).to(torch.bfloat16)
        feats.extend(out.split([len(g) for g in group]))
        bar.update(len(group))
        group.clear()

    for s in seqs:
        group.append(torch.tensor(s[:max_len]))
        if sum(len(g) for g in group) >= tokens_per_forward:
            flush()
    if group:
        flush()
    bar.close()
    return [f.clone() for f in feats]  # own storage: split views would pin the packed buffer


def draft_vocab(
    seqs: list[list[int]], prompt_lens: list[int], size: int, vocab_size: int
) -> torch.Tensor:
    """The `size` most frequent answer tokens (the ones the draft must propose), topped up with
    prompt tokens, then lowest ids; sorted target ids [size]."""
    answer = Counter(t for s, p in zip(seqs, prompt_lens) for t in s[p:])
    prompt = Counter(t for s, p in zip(seqs, prompt_lens) for t in s[:p])
    chosen = [t for t, _ in answer.most_common(size)]
    seen = set(chosen)
    for t, _ in prompt.most_common():
        if len(chosen) >= size:
            break
        if t not in seen:
            chosen.append(t)
            seen.add(t)
    t = 0
    while len(chosen) < size:
        if t not in seen:
            chosen.append(t)
        t += 1
    return torch.tensor(sorted(chosen[:size]), dtype=torch.long)


def label_map(draft_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """[vocab] target id -> draft id, IGNORE for tokens outside the draft vocab."""
    if draft_ids is None:
        return torch.arange(vocab_size)
    m = torch.full((vocab_size,), IGNORE, dtype=torch.long)
    m[draft_ids] = torch.arange(draft_ids.numel())
    return m


def answer_coverage(
    seqs: list[list[int]], prompt_lens: list[int], draft_ids: torch.Tensor
) -> float:
    """Share of answer tokens inside the draft vocabulary (the cap on draft accuracy)."""
    keep = set(draft_ids.tolist())
    toks = [t for s, p in zip(seqs, prompt_lens) for t in s[p:]]
    return sum(t in keep for t in toks) / max(1, len(toks))

"""The draft vocabulary: the most frequent answer tokens, and a trained head widened to more of
them without losing what it learnt (train/vocab.py)."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from eagleserve.spec.head_loader import init_eagle_head, load_eagle_head, save_eagle_head
from eagleserve.train.target import load_target
from eagleserve.train.ttt import head_step
from eagleserve.train.vocab import vocab_from_counts, widen_head, widened_ids

pytestmark = pytest.mark.usefixtures("torch_threads")


def _counts(g: torch.Generator, vocab: int, distinct: int) -> Counter:
    ids = torch.randperm(vocab, generator=g)[:distinct].tolist()
    freq = torch.randint(1, 1000, (distinct,), generator=g).tolist()
    return Counter(dict(zip(ids, freq, strict=True)))


def test_the_vocabulary_is_the_most_frequent_answer_tokens_then_the_lowest_unused() -> None:
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    counts = _counts(g, 500, 120)
    ids = vocab_from_counts(counts, 80, 500)
    assert ids.tolist() == sorted(set(ids.tolist())) and ids.numel() == 80
    chosen = set(ids.tolist())
    assert min(counts[t] for t in chosen) >= max(counts[t] for t in counts if t not in chosen)
    more = vocab_from_counts(counts, 150, 500)  # 120 counted, then ids 0, 1, ... unused
    unused = [t for t in range(500) if t not in counts][:30]
    assert set(more.tolist()) == set(counts) | set(unused)


def test_widened_ids_keep_the_old_ones_and_add_the_most_frequent_others() -> None:
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    counts = _counts(g, 500, 300)
    kept = torch.randperm(500, generator=g)[:100].sort().values  # counted or not
    ids = widened_ids(counts, kept, 180, 500)
    assert ids.numel() == 180 and bool((ids[1:] > ids[:-1]).all())
    assert set(kept.tolist()) <= set(ids.tolist())
    added = set(ids.tolist()) - set(kept.tolist())
    others = [t for t in counts if t not in added and t not in set(kept.tolist())]
    assert min(counts[t] for t in added) >= max(counts[t] for t in others)
    with pytest.raises(ValueError):
        widened_ids(counts, kept, 99, 500)  # narrowing


def test_a_widened_head_keeps_what_it_learnt_and_maps_new_rows_like_the_old(
    tiny_model_dir: str, tmp_path
) -> None:
    """Every weight and old token's row kept (so the old tokens' logits are unchanged); a new
    token's row is the target's row through the map that takes the target's rows to the head's
    (recovered exactly when the head's rows are such a map); saved, it loads as widened."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    target, _ = load_target(tiny_model_dir, "float32", 64)
    vocab = target.config.vocab_size
    old = torch.randperm(vocab, generator=g)[:100].sort().values
    head = init_eagle_head("EAGLE3", target, draft_token_ids=old, seed=3)
    ref = target.lm_head_weight.detach().float()
    h = ref.shape[1]
    fit = torch.randn(h, h, generator=g) / h**0.5
    with torch.no_grad():
        for p in head.parameters():  # a "trained" head: nothing left at its initial values
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        head.lm_head.weight.copy_(ref[old] @ fit)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    ids_in = torch.randint(0, vocab, (2, 9), generator=g)
    feats = torch.randn(2, 9, head.feature_size, generator=g)
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        hid = head_step(head, ids_in, feats, pos, [])[0]
        logits_before = head.lm_head(hid)

    ids = widened_ids(_counts(g, vocab, 200), old, 160, vocab)
    widen_head(head, target.lm_head_weight, ids)
    assert head.draft_vocab_size == 160 and head.lm_head.weight.shape == (160, h)
    assert torch.equal(head.to_target_ids(torch.arange(160)), ids)
    state = head.state_dict()
    assert all(
        torch.equal(state[k], v) for k, v in before.items() if k not in ("lm_head.weight", "d2t")
    )
    at_old = torch.searchsorted(ids, old)
    assert torch.equal(head.lm_head.weight[at_old], before["lm_head.weight"])
    new = ~torch.isin(ids, old)
    torch.testing.assert_close(head.lm_head.weight[new], ref[ids[new]] @ fit, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        logits = head.lm_head(head_step(head, ids_in, feats, pos, [])[0])
    assert torch.equal(logits[..., at_old], logits_before)

    out = str(tmp_path / "wide")
    save_eagle_head(head, out)
    loaded = load_eagle_head(out, "EAGLE3", target, torch.device("cpu"), torch.float32)
    assert torch.equal(loaded.to_target_ids(torch.arange(160)), ids)
    assert torch.equal(loaded.lm_head.weight, head.lm_head.weight)
    assert os.path.isfile(os.path.join(out, "config.json"))
    with pytest.raises(ValueError, match="own vocabulary"):
        widen_head(head, target.lm_head_weight, old[1:])  # not a superset of its vocabulary
